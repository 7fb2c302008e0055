"""Extra moe_compile ops that the fast path wants and the base contract (``ops.py``) lacks.

    grouped_mm_wgrad_lowp(x[M,K], dy[M,N], offsets, E) -> dw[E,K,N] in x.dtype
    swiglu(h[M,2N]) -> a[M,N] = silu(h[:, :N]) * h[:, N:]   (bwd: swiglu_backward, one pass)

Why: ``grouped_mm``'s backward calls ``grouped_mm_wgrad`` (fp32 [E, K, N]) and then ``.to(w.dtype)``.
For bf16 weights that is three full passes over an fp32 copy of every expert weight per step
(write fp32, read fp32, write bf16): ~12 extra bytes per weight element, e.g. 7 GB and ~2.4 ms on an
H100 for one Qwen3-30B-A3B layer (604M expert weights), more than half the layer's GEMM time. This
op accumulates in fp32 and rounds once to x.dtype inside the GEMM (CUTLASS ``torch._grouped_mm``
2Dx2D on sm90, else Triton), so the weight gradient costs one bf16 write.

``ops._grouped_mm_bwd`` and ``_grouped_mm_list_bwd`` use it through ``grouped_mm_weight_grad`` for
low-precision weights of the same dtype as x (measured on an H200 for one Qwen3-30B-A3B layer:
9.9 ms -> 4.3 ms forward+backward, docs/benchmarks.md).

Worked example (E=2, offsets=[2, 2]: group 0 = rows 0..1, group 1 empty, row 2 dropped)::

    x = [[1, 2], [3, 4], [9, 9]], dy = [[1], [1], [7]]  ->  dw[0] = x[0:2]^T dy[0:2] = [[4], [6]],
    dw[1] = [[0], [0]]                                        (row 2 is in no group)
"""
from __future__ import annotations

import torch

from . import ops, reference


def _impl(name: str, t: torch.Tensor):
    ops._impl("grouped_mm", t)  # loads the CUDA registrations on first CUDA use
    return ops._IMPLS.get((name, t.device.type)) or _REFERENCES[name]


def grouped_mm_wgrad_lowp_reference(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, num_experts: int):
    return reference.grouped_mm_wgrad(x, dy, offsets, num_experts).to(x.dtype)


_REFERENCES = {"grouped_mm_wgrad_lowp": grouped_mm_wgrad_lowp_reference, "swiglu": reference.swiglu,
               "swiglu_backward": reference.swiglu_backward}


@torch.library.custom_op("moe_compile::grouped_mm_wgrad_lowp", mutates_args=())
def grouped_mm_wgrad_lowp(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, num_experts: int) -> torch.Tensor:
    ops._check(x.dim() == 2 and dy.dim() == 2 and x.shape[0] == dy.shape[0], "grouped_mm_wgrad_lowp",
               f"x {tuple(x.shape)} and dy {tuple(dy.shape)} must be 2-D with the same number of rows")
    ops._check(x.dtype == dy.dtype, "grouped_mm_wgrad_lowp", f"x is {x.dtype} but dy is {dy.dtype}")
    ops._check(offsets.numel() == num_experts, "grouped_mm_wgrad_lowp",
               f"offsets has {offsets.numel()} groups, num_experts is {num_experts}")
    return _impl("grouped_mm_wgrad_lowp", x)(x, dy, offsets, num_experts)


@grouped_mm_wgrad_lowp.register_fake
def _(x, dy, offsets, num_experts):
    return x.new_empty(num_experts, x.shape[1], dy.shape[1])


def grouped_mm_weight_grad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, num_experts: int,
                           w_dtype: torch.dtype, w_col_major: bool) -> torch.Tensor:
    """dL/dw for ``y = grouped_mm(x, w, offsets)``: [E, K, N] in ``w_dtype``, laid out like w.

    ``w_col_major``: w is a transposed view of [E, N, K] storage (``w.stride(-2) == 1``): nn.Linear
    weights ``W_e.t()`` and HF ``gate_up_proj.transpose(1, 2)``. Then the gradient is computed as
    dy_e^T x_e = [E, N, K] (row-major, the parameter's own layout) and returned transposed, so
    autograd accumulates it into the parameter without a strided copy (1.9 ms per step for one
    Qwen3-30B-A3B layer on an H200 when the gradient comes back row-major [E, K, N]). Low-precision
    weights get the gradient rounded once inside the GEMM (``grouped_mm_wgrad_lowp``).

    Used by ``ops._grouped_mm_bwd`` and ``ops._grouped_mm_list_bwd`` (ws[e] is [K, N]).
    """
    a, b = (dy, x) if w_col_major else (x, dy)
    if w_dtype != torch.float32 and x.dtype == w_dtype:
        g = grouped_mm_wgrad_lowp(a, b, offsets, num_experts)
    else:
        g = ops.grouped_mm_wgrad(a, b, offsets, num_experts).to(w_dtype)
    return g.transpose(1, 2) if w_col_major else g


# --------------------------------------------------------------------------- swiglu
# Why an op: Inductor differentiates silu(h[:, :N]) * h[:, N:] through two slice_backward + add,
# one kernel that loads h twice for every element of dh (0.20 ms for a Qwen3-30B-A3B layer's
# backward on an H200, against 0.12 ms for one read of h and da and one write of dh). The lowering
# (lowering/swiglu.py) uses this op only on the output of a moe_compile grouped GEMM.
def _check_swiglu(h: torch.Tensor) -> None:
    ops._check(h.dim() == 2 and h.shape[1] % 2 == 0, "swiglu", f"h must be [M, 2N], got {tuple(h.shape)}")


@torch.library.custom_op("moe_compile::swiglu", mutates_args=())
def swiglu(h: torch.Tensor) -> torch.Tensor:
    _check_swiglu(h)
    return _impl("swiglu", h)(h)


@swiglu.register_fake
def _(h):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@torch.library.custom_op("moe_compile::swiglu_backward", mutates_args=())
def swiglu_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    _check_swiglu(h)
    ops._check(da.shape == (h.shape[0], h.shape[1] // 2), "swiglu_backward",
               f"da {tuple(da.shape)} must be [M, N] for h {tuple(h.shape)}")
    return _impl("swiglu_backward", h)(h, da)


@swiglu_backward.register_fake
def _(h, da):
    return torch.empty_like(h)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_bwd(ctx, da):
    (h,) = ctx.saved_tensors
    return swiglu_backward(h, da)


swiglu.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)


FUSED_OP_NAMES = ("grouped_mm_wgrad_lowp", "swiglu", "swiglu_backward")
