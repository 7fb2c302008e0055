"""Kernels behind the moe_compile custom ops (``torch.ops.moe_compile.*``).

``reference.py`` holds the pure-torch ground truth; ``ops.py`` the custom ops (fake + autograd);
``cuda.py`` registers GPU kernels lazily (Triton is imported only there, only on first CUDA use).
"""
