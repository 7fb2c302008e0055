"""Activation ops of the expert function.

    swiglu(h[M,2N]) -> a[M,N] = silu(h[:, :N]) * h[:, N:]   (bwd: swiglu_backward, one pass)
    weighted_swiglu(h, weights[T,K], perm[M], offsets) -> a[p] = weights.flat[perm[p]] * swiglu(h)[p]
                                     (bwd: weighted_swiglu_backward -> dh and dweights, one pass)

Why an op: Inductor differentiates silu(h[:, :N]) * h[:, N:] through two slice_backward + add,
one kernel that loads h twice for every element of dh (0.20 ms for a Qwen3-30B-A3B layer's
backward on an H200, against 0.12 ms for one read of h and da and one write of dh). The lowering
(lowering/swiglu.py) uses this op only on the output of a moe_compile grouped GEMM.

Why weighted_swiglu: with each permuted row's routing weight applied before the bias-free down
projection (``lowering/weights_in_swiglu.py``), the combine becomes a plain sum whose backward is a
gather, and the weights' gradient <da[p], swiglu(h)[p]> comes from the activation's backward, which
reads h and da anyway: the combine's backward no longer reads the expert outputs y [M, H] (one
read of M x H less per layer and training step), and y is not kept for the backward (M x H less
activation memory per layer).
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
    return h.new_empty(h.shape)  # contiguous, as every implementation


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_bwd(ctx, da):
    (h,) = ctx.saved_tensors
    return swiglu_backward(h, da)


swiglu.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)


# --------------------------------------------------------------------------- weighted_swiglu
def _check_weighted(h, weights, perm, offsets) -> None:
    _check_swiglu(h)
    check(weights.is_floating_point() and weights.dim() == 2, "weighted_swiglu",
          f"weights must be floating [T, K], got {weights.dtype} {tuple(weights.shape)}")
    check(perm.dim() == 1 and perm.numel() == h.shape[0] == weights.numel(), "weighted_swiglu",
          f"h has {h.shape[0]} rows, perm {perm.numel()}, weights {weights.numel()}: all must be T*K")
    check(offsets.dim() == 1 and offsets.numel() > 0, "weighted_swiglu",
          f"offsets must be [E] with E >= 1 (route_permute's), got {tuple(offsets.shape)}")


@torch.library.custom_op("moe_compile::weighted_swiglu", mutates_args=())
def weighted_swiglu(h: torch.Tensor, weights: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    _check_weighted(h, weights, perm, offsets)
    return implementation("weighted_swiglu", h)(h, weights, perm, offsets)


@weighted_swiglu.register_fake
def _(h, weights, perm, offsets):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@torch.library.custom_op("moe_compile::weighted_swiglu_backward", mutates_args=())
def weighted_swiglu_backward(h: torch.Tensor, weights: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor,
                             da: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_weighted(h, weights, perm, offsets)
    check(da.shape == (h.shape[0], h.shape[1] // 2), "weighted_swiglu_backward",
          f"da {tuple(da.shape)} must be [M, N] for h {tuple(h.shape)}")
    return implementation("weighted_swiglu_backward", h)(h, weights, perm, offsets, da)


@weighted_swiglu_backward.register_fake
def _(h, weights, perm, offsets, da):
    return h.new_empty(h.shape), weights.new_empty(weights.shape)   # contiguous, as every implementation


def _weighted_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _weighted_bwd(ctx, da):
    h, weights, perm, offsets = ctx.saved_tensors
    dh, dw = weighted_swiglu_backward(h, weights, perm, offsets, da)
    return dh, (dw if ctx.needs_input_grad[1] else None), None, None


weighted_swiglu.register_autograd(_weighted_bwd, setup_context=_weighted_setup)
