"""CUDA implementations of the moe_compile ops, registered lazily on first CUDA use.

Imported by ``ops._impl`` the first time an op sees a CUDA tensor. Never imported on CPU, so CPU
CI never needs Triton. Ops without a registered CUDA kernel run the pure-torch reference.
"""
