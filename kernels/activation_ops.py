"""Activation ops of the expert function.

    swiglu(h[M,2N]) -> a[M,N] = silu(h[:, :N]) * h[:, N:]   (bwd: swiglu_backward, one pass)

Why an op: Inductor differentiates silu(h[:, :N]) * h[:, N:] through two slice_backward + add,
one kernel that loads h twice for every element of dh (0.20 ms for a Qwen3-30B-A3B layer's
backward on an H200, against 0.12 ms for one read of h and da and one write of dh). The lowering
(lowering/swiglu.py) uses this op only on the output of a moe_compile grouped GEMM.
"""
from __future__ import annotations

import torch

from .common import check
from .registry import implementation


def _check_swiglu(h: torch.Tensor) -> None:
    check(h.dim() == 2 and h.shape[1] % 2 == 0, "swiglu", f"h must be [M, 2N], got {tuple(h.shape)}")


@torch.library.custom_op("moe_compile::swiglu", mutates_args=())
def swiglu(h: torch.Tensor) -> torch.Tensor:
    _check_swiglu(h)
    return implementation("swiglu", h)(h)


@swiglu.register_fake
def _(h):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@torch.library.custom_op("moe_compile::swiglu_backward", mutates_args=())
def swiglu_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    _check_swiglu(h)
    check(da.shape == (h.shape[0], h.shape[1] // 2), "swiglu_backward",
               f"da {tuple(da.shape)} must be [M, N] for h {tuple(h.shape)}")
    return implementation("swiglu_backward", h)(h, da)


@swiglu_backward.register_fake
def _(h, da):
    return torch.empty_like(h)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_bwd(ctx, da):
    (h,) = ctx.saved_tensors
    return swiglu_backward(h, da)


swiglu.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)
