"""Routing ops: group routed (token, slot) pairs by expert and combine expert outputs back per token.

    route_permute(expert_ids[T,K], E)            -> perm[N] i64, inv[N] i64, offsets[E] i32
    permute_rows(x[T,H], perm, inv, offsets, K)  -> xp[N,H]          (gather; bwd = combine)
    permute_scale(x[T,H], perm, inv, offsets, weights[T,K], out_dtype) -> xp[N,H]
                                                    (gather, each row times its pair's weight: the
                                                    rows an expert input scale multiplies; x kept, not xp)
    saved_copy(x) -> a copy of x the partitioner cannot recompute from x (what a backward keeps of x)
    unpermute_combine(y[N,H], inv, weights[T,K], offsets, out_dtype=None) -> out[T,H] (weighted gather-reduce)
    unpermute_sum(y[N,H], perm, inv, offsets, K, out_dtype=None) -> out[T,H]  (weight 1; bwd = permute_rows:
                                                    y not kept)
      out_dtype: the output's dtype (default y's): a wider one sums narrower rows as ``y.to(out_dtype)``
      would, without materialising or keeping that copy (bf16 expert rows into an fp32 combine)
    router_topk(scores[..., E], k)               -> values[..., k], indices[..., k] i64  (torch.topk
                                                    on the last dim; bwd: scatter into zeros)

Static output shapes, no host sync; rows past offsets[-1] ("dropped": expert ids outside [0, E))
are zero in every output. Implementations: ``registry.implementation``.
"""
from __future__ import annotations

import torch

from .common import check
from .registry import implementation


def _check_offsets(op: str, offsets: torch.Tensor) -> None:
    check(offsets.dim() == 1 and offsets.numel() >= 1 and not offsets.is_floating_point(), op,
          f"offsets must be route_permute's [E] integer group ends with E >= 1, got {offsets.dtype} "
          f"{tuple(offsets.shape)}")

# --------------------------------------------------------------------------- route_permute
@torch.library.custom_op("moe_compile::route_permute", mutates_args=())
def route_permute(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check(not expert_ids.is_floating_point(), "route_permute", f"expert_ids must be integer, got {expert_ids.dtype}")
    check(num_experts > 0, "route_permute", f"num_experts must be positive, got {num_experts}")
    return implementation("route_permute", expert_ids)(expert_ids, num_experts)


@route_permute.register_fake
def _(expert_ids, num_experts):
    n = expert_ids.numel()
    return (expert_ids.new_empty(n, dtype=torch.long), expert_ids.new_empty(n, dtype=torch.long),
            expert_ids.new_empty(num_experts, dtype=torch.int32))


# --------------------------------------------------------------------------- permute_rows
@torch.library.custom_op("moe_compile::permute_rows", mutates_args=())
def permute_rows(x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor,
                 top_k: int) -> torch.Tensor:
    check(x.dim() == 2, "permute_rows", f"x must be [T, H], got {tuple(x.shape)}")
    check(perm.numel() == x.shape[0] * top_k, "permute_rows",
           f"perm has {perm.numel()} rows but x has {x.shape[0]} tokens x top_k {top_k}")
    _check_offsets("permute_rows", offsets)
    return implementation("permute_rows", x)(x, perm, offsets, top_k)


@permute_rows.register_fake
def _(x, perm, inv, offsets, top_k):
    return x.new_empty(perm.shape[0], x.shape[1])


def _routing_setup(ctx, inputs, output):
    """permute_rows and unpermute_sum (inputs: rows, perm, inv, offsets, top_k), each the other's
    backward: only the routing is kept, never the rows."""
    _, perm, inv, offsets, top_k = inputs
    ctx.save_for_backward(perm, inv, offsets)
    ctx.top_k = top_k


def _permute_rows_bwd(ctx, dxp):
    perm, inv, offsets = ctx.saved_tensors
    return unpermute_sum(dxp, perm, inv, offsets, ctx.top_k), None, None, None, None


permute_rows.register_autograd(_permute_rows_bwd, setup_context=_routing_setup)


# --------------------------------------------------------------------------- permute_scale
@torch.library.custom_op("moe_compile::permute_scale", mutates_args=())
def permute_scale(x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor,
                  weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """xp[p] = (x[perm[p] // K] * weights.flat[perm[p]]).to(out_dtype), the product in
    promote(x, weights, fp32) (0 for dropped rows): ``permute_rows`` then the model's ``rows * w`` (and
    a cast of that product) in one pass. The backward reads x, never a [N, H] copy of the rows."""
    check(x.dim() == 2 and weights.dim() == 2 and weights.shape[0] == x.shape[0], "permute_scale",
          f"x must be [T, H] and weights [T, K], got {tuple(x.shape)} and {tuple(weights.shape)}")
    check(perm.numel() == inv.numel() == weights.numel(), "permute_scale",
          f"perm {perm.numel()} and inv {inv.numel()} must have one entry per (token, slot) pair, "
          f"{weights.numel()}")
    check(out_dtype.is_floating_point, "permute_scale", f"out_dtype must be a floating dtype, got {out_dtype}")
    _check_offsets("permute_scale", offsets)
    return implementation("permute_scale", x)(x, perm, offsets, weights, out_dtype)


@permute_scale.register_fake
def _(x, perm, inv, offsets, weights, out_dtype):
    return x.new_empty(perm.shape[0], x.shape[1], dtype=out_dtype)


def _scale_setup(ctx, inputs, output):
    x, perm, inv, offsets, weights, _ = inputs
    ctx.save_for_backward(x, inv, offsets, weights)


def _scale_bwd(ctx, dxp):
    x, inv, offsets, weights = ctx.saved_tensors
    dx, dw = permute_scale_backward(dxp.contiguous(), x, inv, weights, offsets)
    return (dx if ctx.needs_input_grad[0] else None), None, None, None, \
        (dw if ctx.needs_input_grad[4] else None), None


permute_scale.register_autograd(_scale_bwd, setup_context=_scale_setup)


@torch.library.custom_op("moe_compile::permute_scale_backward", mutates_args=())
def permute_scale_backward(dxp: torch.Tensor, x: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor,
                           offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [T, H] in x's dtype, dweights [T, K] in theirs): dx[t] = sum_j w[t, j] * dxp[inv[t*K + j]],
    dw[t, j] = <dxp[inv[t*K + j]], x[t]>, fp32 sums rounded once (0 for dropped pairs)."""
    _check_offsets("permute_scale_backward", offsets)
    return implementation("permute_scale_backward", x)(dxp, x, inv, weights, offsets)


@permute_scale_backward.register_fake
def _(dxp, x, inv, weights, offsets):
    return x.new_empty(x.shape), weights.new_empty(weights.shape)   # contiguous, as every implementation


@torch.library.custom_op("moe_compile::saved_copy", mutates_args=())
def saved_copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of x that AOTAutograd's partitioner keeps: it recomputes a plain ``clone`` from x
    in the backward. For a tensor a backward reads that the caller may write in place after the forward
    (``permute_scale``'s x where x is a graph input)."""
    return x.clone(memory_format=torch.contiguous_format)


@saved_copy.register_fake
def _(x):
    return x.new_empty(x.shape)


saved_copy.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)


# --------------------------------------------------------------------------- unpermute_combine
def _check_out_dtype(op: str, y: torch.Tensor, out_dtype: torch.dtype | None) -> None:
    check(out_dtype is None or (out_dtype.is_floating_point and torch.promote_types(y.dtype, out_dtype) == out_dtype),
          op, f"out_dtype {out_dtype} must be a floating dtype at least as wide as the rows' {y.dtype}")


@torch.library.custom_op("moe_compile::unpermute_combine", mutates_args=())
def unpermute_combine(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    check(weights.dim() == 2 and y.dim() == 2, "unpermute_combine",
          f"y must be [T*K, H] and weights [T, K], got {tuple(y.shape)} and {tuple(weights.shape)}")
    check(y.shape[0] == weights.numel() == inv.numel(), "unpermute_combine",
           f"y has {y.shape[0]} rows, inv {inv.numel()}, weights {weights.numel()}: all must be T*K")
    _check_out_dtype("unpermute_combine", y, out_dtype)
    _check_offsets("unpermute_combine", offsets)
    return implementation("unpermute_combine", y)(y, inv, weights, offsets, out_dtype)


@unpermute_combine.register_fake
def _(y, inv, weights, offsets, out_dtype=None):
    return y.new_empty(weights.shape[0], y.shape[1], dtype=out_dtype or y.dtype)


def _combine_setup(ctx, inputs, output):
    y, inv, weights, offsets, _ = inputs
    ctx.save_for_backward(y, inv, weights, offsets)


def _combine_bwd(ctx, dout):
    y, inv, weights, offsets = ctx.saved_tensors
    # dout in the output's dtype; dy in y's, rounded once (as the backward of y.to(out_dtype) rounds it)
    dy, dw = unpermute_combine_backward(dout.contiguous(), y, inv, weights, offsets)
    return dy, None, (dw if ctx.needs_input_grad[2] else None), None, None


unpermute_combine.register_autograd(_combine_bwd, setup_context=_combine_setup)


@torch.library.custom_op("moe_compile::unpermute_combine_backward", mutates_args=())
def unpermute_combine_backward(dout: torch.Tensor, y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor,
                               offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_offsets("unpermute_combine_backward", offsets)
    return implementation("unpermute_combine_backward", y)(dout, y, inv, weights, offsets)


@unpermute_combine_backward.register_fake
def _(dout, y, inv, weights, offsets):
    return y.new_empty(y.shape), weights.new_empty(weights.shape)   # contiguous, as every implementation


# --------------------------------------------------------------------------- unpermute_sum
@torch.library.custom_op("moe_compile::unpermute_sum", mutates_args=())
def unpermute_sum(y: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor,
                  top_k: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[t] = sum_j y[inv[t*K + j]] over rows inside a group (fp32, j in order): the combine of
    unweighted experts, or of experts whose rows were weighted before (``weighted_swiglu``)."""
    check(y.dim() == 2 and top_k > 0 and perm.numel() == inv.numel() == y.shape[0]
          and y.shape[0] % top_k == 0, "unpermute_sum",
          f"y {tuple(y.shape)}, perm {perm.numel()}, inv {inv.numel()}: y must have T*K rows (K={top_k})")
    _check_out_dtype("unpermute_sum", y, out_dtype)
    _check_offsets("unpermute_sum", offsets)
    return implementation("unpermute_sum", y)(y, perm, inv, offsets, top_k, out_dtype)


@unpermute_sum.register_fake
def _(y, perm, inv, offsets, top_k, out_dtype=None):
    return y.new_empty(y.shape[0] // top_k, y.shape[1], dtype=out_dtype or y.dtype)


def _sum_setup(ctx, inputs, output):
    y, perm, inv, offsets, top_k, _ = inputs
    _routing_setup(ctx, (y, perm, inv, offsets, top_k), output)
    ctx.rows_dtype = y.dtype


def _sum_bwd(ctx, dout):
    perm, inv, offsets = ctx.saved_tensors
    # a wider output's gradient rounded to the rows' dtype once, as y.to(out_dtype)'s backward rounds it: before
    # the gather (a copy: the same values), so the cast reads [T, H] and no wide [T*K, H] copy is made
    dout = dout if dout.dtype == ctx.rows_dtype else dout.to(ctx.rows_dtype)
    return permute_rows(dout, perm, inv, offsets, ctx.top_k), None, None, None, None, None


unpermute_sum.register_autograd(_sum_bwd, setup_context=_sum_setup)


# --------------------------------------------------------------------------- router_topk
@torch.library.custom_op("moe_compile::router_topk", mutates_args=())
def router_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(scores, k, dim=-1)`` (sorted): the k largest entries of each row, largest first,
    ranked as torch.topk's CUDA kernel ranks them (NaN above everything, -0 just below +0). Where
    entries tie at the k-th place the lower indices are taken (as that kernel does); the order of
    equal entries among the k may differ from torch.topk's, which does not specify it."""
    check(scores.dim() >= 1 and scores.is_floating_point(), "router_topk",
          f"scores must be a floating tensor with a last dim, got {scores.dtype} {tuple(scores.shape)}")
    check(1 <= k <= scores.shape[-1], "router_topk", f"k={k} must be in [1, {scores.shape[-1]}] (the last dim)")
    return implementation("router_topk", scores)(scores, k)


@router_topk.register_fake
def _(scores, k):
    shape = (*scores.shape[:-1], k)
    return scores.new_empty(shape), scores.new_empty(shape, dtype=torch.long)


def _router_topk_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.shape = inputs[0].shape


def _router_topk_bwd(ctx, dvalues, dindices):
    (indices,) = ctx.saved_tensors
    return dvalues.new_zeros(ctx.shape).scatter(-1, indices, dvalues), None


router_topk.register_autograd(_router_topk_bwd, setup_context=_router_topk_setup)
