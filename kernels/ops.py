"""The moe_compile custom ops: the seam between the graph rewrite and the kernels.

Every op has static output shapes (no data-dependent sizes, no host sync in the graph), a fake
(meta) implementation, an autograd formula built from other ops of this file, and a pure-torch
reference in ``reference.py``. Faster implementations register per device type with
``register_impl(op_name, "cuda", fn)``; ``cuda.py`` does so lazily the first time an op sees a
CUDA tensor and Triton is importable.

    route_permute(expert_ids[T,K], E)            -> perm[N] i64, inv[N] i64, offsets[E] i32
    permute_rows(x[T,H], perm, inv, offsets, K)  -> xp[N,H]          (gather; bwd = combine)
    grouped_mm(x[M,K], w[E,K,N], offsets, bias?) -> y[M,N]           (x @ w[e] per group)
    grouped_mm_list(x, ws: E x [K,N], offsets, biases)  -> y[M,N]     (ModuleList weights, no stacking;
                                                                       transposed=True: E x [N,K])
    grouped_mm_list_cat(x, ws_a, ws_b, offsets)          -> [M,Na+Nb] (sibling linears, e.g. w1|w3)
    unpermute_combine(y[N,H], inv, weights[T,K], offsets) -> out[T,H] (weighted gather-reduce)

Rows past offsets[-1] ("dropped": expert ids outside [0, E)) are zero in every output.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import reference

_IMPLS: dict[tuple[str, str], Callable] = {}
_CUDA_LOADED = False


def register_impl(op_name: str, device_type: str, fn: Callable) -> None:
    """Use ``fn`` instead of the reference for ``op_name`` on ``device_type`` tensors."""
    _IMPLS[(op_name, device_type)] = fn


def _impl(op_name: str, t: torch.Tensor) -> Callable:
    global _CUDA_LOADED
    if t.device.type == "cuda" and not _CUDA_LOADED:
        _CUDA_LOADED = True
        from . import cuda  # noqa: F401  (registers what it can; never required)
    return _IMPLS.get((op_name, t.device.type)) or getattr(reference, op_name)


def _check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"moe_compile.{op}: {msg}")


# --------------------------------------------------------------------------- route_permute
@torch.library.custom_op("moe_compile::route_permute", mutates_args=())
def route_permute(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(not expert_ids.is_floating_point(), "route_permute", f"expert_ids must be integer, got {expert_ids.dtype}")
    _check(num_experts > 0, "route_permute", f"num_experts must be positive, got {num_experts}")
    return _impl("route_permute", expert_ids)(expert_ids, num_experts)


@route_permute.register_fake
def _(expert_ids, num_experts):
    n = expert_ids.numel()
    return (expert_ids.new_empty(n, dtype=torch.long), expert_ids.new_empty(n, dtype=torch.long),
            expert_ids.new_empty(num_experts, dtype=torch.int32))


# --------------------------------------------------------------------------- permute_rows
@torch.library.custom_op("moe_compile::permute_rows", mutates_args=())
def permute_rows(x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor,
                 top_k: int) -> torch.Tensor:
    _check(x.dim() == 2, "permute_rows", f"x must be [T, H], got {tuple(x.shape)}")
    _check(perm.numel() == x.shape[0] * top_k, "permute_rows",
           f"perm has {perm.numel()} rows but x has {x.shape[0]} tokens x top_k {top_k}")
    return _impl("permute_rows", x)(x, perm, offsets, top_k)


@permute_rows.register_fake
def _(x, perm, inv, offsets, top_k):
    return x.new_empty(perm.shape[0], x.shape[1])


def _permute_rows_setup(ctx, inputs, output):
    x, perm, inv, offsets, top_k = inputs
    ctx.save_for_backward(inv, offsets)
    ctx.shape = (x.shape[0], top_k)


def _permute_rows_bwd(ctx, dxp):
    inv, offsets = ctx.saved_tensors
    ones = dxp.new_ones(ctx.shape, dtype=torch.float32)
    return unpermute_combine(dxp, inv, ones, offsets), None, None, None, None


permute_rows.register_autograd(_permute_rows_bwd, setup_context=_permute_rows_setup)


# --------------------------------------------------------------------------- grouped_mm
def _check_gmm(op, x, w_shape, w_dtype, offsets, num_groups):
    _check(x.dim() == 2, op, f"x must be 2-D [M, K], got {tuple(x.shape)}")
    _check(x.shape[1] == w_shape[0], op, f"x has K={x.shape[1]} but the expert weight has K={w_shape[0]}")
    _check(x.dtype == w_dtype, op, f"x is {x.dtype} but the expert weights are {w_dtype}; cast one of them")
    _check(offsets.numel() == num_groups, op, f"offsets has {offsets.numel()} groups, weights have {num_groups}")


@torch.library.custom_op("moe_compile::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check(w.dim() == 3, "grouped_mm", f"w must be 3-D [E, K, N], got {tuple(w.shape)}")
    _check_gmm("grouped_mm", x, w.shape[1:], w.dtype, offsets, w.shape[0])
    return _impl("grouped_mm", x)(x, w, offsets, bias)


@grouped_mm.register_fake
def _(x, w, offsets, bias=None):
    return x.new_empty(x.shape[0], w.shape[-1])


def _grouped_mm_setup(ctx, inputs, output):
    x, w, offsets, bias = inputs
    ctx.save_for_backward(x, w, offsets)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _weight_grad(x, dy, offsets, num_experts, w_dtype, w_col_major):
    """dL/dw in w's dtype and layout, rounded once (see fused.grouped_mm_weight_grad)."""
    from .fused import grouped_mm_weight_grad

    return grouped_mm_weight_grad(x, dy, offsets, num_experts, w_dtype, w_col_major)


def _grouped_mm_bwd(ctx, dy):
    x, w, offsets = ctx.saved_tensors
    dy = dy.contiguous()
    dx = grouped_mm(dy, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
    dw = (_weight_grad(x, dy, offsets, w.shape[0], w.dtype, w.stride(-2) == 1)
          if ctx.needs_input_grad[1] else None)
    db = (grouped_bias_grad(dy, offsets, w.shape[0]).to(ctx.bias_dtype)
          if ctx.has_bias and ctx.needs_input_grad[3] else None)
    return dx, dw, None, db


grouped_mm.register_autograd(_grouped_mm_bwd, setup_context=_grouped_mm_setup)


@torch.library.custom_op("moe_compile::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, num_experts: int) -> torch.Tensor:
    return _impl("grouped_mm_wgrad", x)(x, dy, offsets, num_experts)


@grouped_mm_wgrad.register_fake
def _(x, dy, offsets, num_experts):
    return x.new_empty(num_experts, x.shape[1], dy.shape[1], dtype=torch.float32)


@torch.library.custom_op("moe_compile::grouped_bias_grad", mutates_args=())
def grouped_bias_grad(dy: torch.Tensor, offsets: torch.Tensor, num_experts: int) -> torch.Tensor:
    return _impl("grouped_bias_grad", dy)(dy, offsets, num_experts)


@grouped_bias_grad.register_fake
def _(dy, offsets, num_experts):
    return dy.new_empty(num_experts, dy.shape[1], dtype=torch.float32)


# --------------------------------------------------------------------------- grouped_mm_list
_DATA_PTR = torch.Tensor.data_ptr  # map(_DATA_PTR, ws): the per-step address scan, ~2x a generator
_STEP_CACHE: dict = {}   # (addresses, shape, strides, dtype, device) -> element step, 0: not evenly spaced


def even_step(ws: list[torch.Tensor]) -> int:
    """Element step between E same-layout views of one storage, evenly spaced; else 0."""
    first = ws[0]
    base = first.untyped_storage().data_ptr()
    if not all(w.shape == first.shape and w.stride() == first.stride() and w.dtype == first.dtype
               and w.device == first.device and w.untyped_storage().data_ptr() == base for w in ws):
        return 0
    step = ws[1].storage_offset() - first.storage_offset()
    ok = step > 0 and all(w.storage_offset() == first.storage_offset() + e * step for e, w in enumerate(ws))
    return step if ok else 0


def strided_stack(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """[E, K, N] zero-copy view of E tensors [K, N] that are evenly spaced views of one storage
    (e.g. ModuleList weights re-homed into one buffer), else None.

    Called on every step with E-long lists: the full check runs once per set of addresses (cached);
    later calls only gather the addresses and check that the view stays inside the first tensor's
    storage (memory inside it belongs to no other tensor, so the cached answer still holds)."""
    if len(ws) < 2:
        return None
    first = ws[0]
    last = ws[-1]
    key = (tuple(map(_DATA_PTR, ws)), tuple(first.shape), first.stride(), tuple(last.shape), last.stride(),
           first.dtype, first.device)
    step = _STEP_CACHE.get(key)
    if step is None:
        if len(_STEP_CACHE) > 1024:
            _STEP_CACHE.clear()
        step = _STEP_CACHE[key] = even_step(ws)
    if not step:
        return None
    extent = first.storage_offset() + (len(ws) - 1) * step + sum((d - 1) * st for d, st in zip(first.shape, first.stride()))
    if (extent + 1) * first.element_size() > first.untyped_storage().nbytes():
        return None
    return first.as_strided((len(ws), *first.shape), (step, *first.stride()), first.storage_offset())


def stack_expert_weights(ws: list[torch.Tensor]) -> torch.Tensor:
    """[E, K, N] from E tensors [K, N]: ``strided_stack`` when possible, else a copy.
    For kernels that need one 3-D operand; the reference never copies."""
    view = strided_stack(ws)
    return view if view is not None else torch.stack(ws)


def _match_inputs(ctx, grads: tuple) -> tuple:
    """One gradient per argument the op was called with: a defaulted trailing flag that the caller
    left out gets no entry (torch.library matches the backward's return to the call's arguments)."""
    n = len(ctx.needs_input_grad)
    return grads[:n] + (None,) * (n - len(grads))


def _list_kn(ws: list[torch.Tensor], transposed: bool) -> list[torch.Tensor]:
    """ws as [K, N] operands: ``transposed`` lists hold [N, K] (nn.Linear weights) used as ws[e].T."""
    return [w.t() for w in ws] if transposed else ws


@torch.library.custom_op("moe_compile::grouped_mm_list", mutates_args=())
def grouped_mm_list(x: torch.Tensor, ws: list[torch.Tensor], offsets: torch.Tensor,
                    biases: list[torch.Tensor], transposed: bool = False) -> torch.Tensor:
    """``biases``: E tensors [N], or an empty list for no bias. ``transposed``: ws[e] is [N, K]
    (an nn.Linear weight) and group e computes x @ ws[e].T. The lowering passes the parameters
    themselves this way: no per-expert view in the graph, none saved for backward (each costs host
    time on every step: 384 of them for a 128-expert SwiGLU layer)."""
    _check(len(ws) > 0 and all(w.dim() == 2 for w in ws), "grouped_mm_list", "ws must be a non-empty list of 2-D [K, N]")
    _check_gmm("grouped_mm_list", x, ws[0].shape[::-1] if transposed else ws[0].shape, ws[0].dtype, offsets, len(ws))
    if transposed and not biases:
        view = strided_stack(ws)  # [E, N, K] -> one zero-copy grouped GEMM on its transpose
        if view is not None:
            return _impl("grouped_mm", x)(x, view.transpose(1, 2), offsets, None)
    return _impl("grouped_mm_list", x)(x, _list_kn(ws, transposed), offsets, biases)


@grouped_mm_list.register_fake
def _(x, ws, offsets, biases, transposed=False):
    return x.new_empty(x.shape[0], ws[0].shape[0] if transposed else ws[0].shape[-1])


def _grouped_mm_list_setup(ctx, inputs, output):
    x, ws, offsets, biases, transposed = inputs
    ctx.save_for_backward(x, offsets, *ws)
    ctx.has_bias = len(biases) > 0
    ctx.bias_dtype = biases[0].dtype if biases else None
    ctx.transposed = transposed


def _kn_col_major(w: torch.Tensor, transposed: bool) -> bool:
    """The [K, N] operand that w stands for (w, or w.T when ``transposed``) is column-major."""
    return w.stride(-1) == 1 if transposed else w.stride(0) == 1


def _list_weight_grads(x, dy, offsets, ws, transposed) -> list[torch.Tensor]:
    """Per-expert weight gradients shaped like ws[e], from one grouped weight-gradient GEMM."""
    g = _weight_grad(x, dy, offsets, len(ws), ws[0].dtype, _kn_col_major(ws[0], transposed))  # [E, K, N]
    return list((g.transpose(1, 2) if transposed else g).unbind(0))


def _grouped_mm_list_bwd(ctx, dy):
    x, offsets, *ws = ctx.saved_tensors
    dy = dy.contiguous()
    e = len(ws)
    # dx = dy @ W_e^T per group: with transposed ws ([N, K]) that is the list itself, untransposed
    dx = grouped_mm_list(dy, ws, offsets, [], not ctx.transposed) if ctx.needs_input_grad[0] else None
    dws = _list_weight_grads(x, dy, offsets, ws, ctx.transposed) if ctx.needs_input_grad[1] else [None] * e
    dbs = [None] * e if ctx.has_bias else []
    if ctx.has_bias and ctx.needs_input_grad[3]:
        dbs = list(grouped_bias_grad(dy, offsets, e).to(ctx.bias_dtype).unbind(0))
    return _match_inputs(ctx, (dx, dws, None, dbs))


grouped_mm_list.register_autograd(_grouped_mm_list_bwd, setup_context=_grouped_mm_list_setup)


# --------------------------------------------------------------------------- grouped_mm_list_cat
def pair_view(ws_a: list[torch.Tensor], ws_b: list[torch.Tensor], transposed: bool = False) -> torch.Tensor | None:
    """[E, K, Na+Nb] zero-copy view when ws_a[e] and ws_b[e] are the row blocks [0, Na) and
    [Na, Na+Nb) of one row-major [E, Na+Nb, K] buffer (nn.Linear w1 | w3 re-homed together,
    lowering/rehome.py), else None. ws[e] are [K, N] views ``W_e.t()``, or with ``transposed``
    the [N, K] weights ``W_e`` themselves.

    Example: E=2, K=4, Na=Nb=3, buffer B [2, 6, 4]: ws_a[e] = B[e, :3].t(), ws_b[e] = B[e, 3:].t()
    (or B[e, :3], B[e, 3:] with ``transposed``) -> B.transpose(1, 2) (strides (24, 1, 4))."""
    va, vb = strided_stack(ws_a), strided_stack(ws_b)
    if va is None or vb is None:
        return None
    if not transposed:
        va, vb = va.transpose(1, 2), vb.transpose(1, 2)  # -> [E, N, K] views of the weights
    na, nb, k = va.shape[1], vb.shape[1], va.shape[2]
    if va.stride() != vb.stride() or va.stride(2) != 1 or va.stride(1) != k \
            or va.untyped_storage().data_ptr() != vb.untyped_storage().data_ptr() \
            or vb.storage_offset() != va.storage_offset() + na * k or va.stride(0) < (na + nb) * k:
        return None
    return va.as_strided((va.shape[0], na + nb, k), va.stride(), va.storage_offset()).transpose(1, 2)


@torch.library.custom_op("moe_compile::grouped_mm_list_cat", mutates_args=())
def grouped_mm_list_cat(x: torch.Tensor, ws_a: list[torch.Tensor], ws_b: list[torch.Tensor],
                        offsets: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """Two sibling grouped linears of one input, e.g. SwiGLU's w1 and w3: y = [x @ ws_a[e] | x @ ws_b[e]]
    per group -> [M, Na + Nb]. One grouped GEMM over ``pair_view`` when the weights share one buffer,
    else two (and a concatenation). ``transposed``: as in ``grouped_mm_list`` (ws[e] is [N, K])."""
    _check(len(ws_a) == len(ws_b) > 0, "grouped_mm_list_cat", "ws_a and ws_b must list the same experts")
    for ws in (ws_a, ws_b):
        _check_gmm("grouped_mm_list_cat", x, ws[0].shape[::-1] if transposed else ws[0].shape, ws[0].dtype,
                   offsets, len(ws))
    view = pair_view(ws_a, ws_b, transposed)
    if view is not None:
        return _impl("grouped_mm", x)(x, view, offsets, None)
    return torch.cat([grouped_mm_list(x, ws_a, offsets, [], transposed),
                      grouped_mm_list(x, ws_b, offsets, [], transposed)], dim=1)


@grouped_mm_list_cat.register_fake
def _(x, ws_a, ws_b, offsets, transposed=False):
    d = 0 if transposed else -1
    return x.new_empty(x.shape[0], ws_a[0].shape[d] + ws_b[0].shape[d])


@torch.library.custom_op("moe_compile::grouped_mm_list_cat_dx", mutates_args=())
def grouped_mm_list_cat_dx(dy: torch.Tensor, ws_a: list[torch.Tensor], ws_b: list[torch.Tensor],
                           offsets: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """Input gradient of grouped_mm_list_cat: dy[:, :Na] @ W_a[e]^T + dy[:, Na:] @ W_b[e]^T, where
    W[e] = ws[e] ([K, N]), or ws[e].T with ``transposed``."""
    view = pair_view(ws_a, ws_b, transposed)
    if view is not None:
        return _impl("grouped_mm", dy)(dy, view.transpose(1, 2), offsets, None)
    na = ws_a[0].shape[0 if transposed else 1]
    untr = not transposed  # dy_a @ W_a^T: the [N, K] weights as they are, or the [K, N] views transposed
    return (grouped_mm_list(dy[:, :na].contiguous(), ws_a, offsets, [], untr)
            + grouped_mm_list(dy[:, na:].contiguous(), ws_b, offsets, [], untr))


@grouped_mm_list_cat_dx.register_fake
def _(dy, ws_a, ws_b, offsets, transposed=False):
    return dy.new_empty(dy.shape[0], ws_a[0].shape[1 if transposed else 0])


def _list_cat_setup(ctx, inputs, output):
    x, ws_a, ws_b, offsets, transposed = inputs
    ctx.save_for_backward(x, offsets, *ws_a, *ws_b)
    ctx.e = len(ws_a)
    ctx.transposed = transposed


def _list_cat_bwd(ctx, dy):
    x, offsets, *ws = ctx.saved_tensors
    ws_a, ws_b = ws[:ctx.e], ws[ctx.e:]
    tr = ctx.transposed
    dy = dy.contiguous()
    dx = grouped_mm_list_cat_dx(dy, ws_a, ws_b, offsets, tr) if ctx.needs_input_grad[0] else None
    na = ws_a[0].shape[0 if tr else 1]
    dwa, dwb = [None] * ctx.e, [None] * ctx.e
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        g = _weight_grad(x, dy, offsets, ctx.e, ws_a[0].dtype, _kn_col_major(ws_a[0], tr))  # [E, K, Na+Nb]
        if tr:
            g = g.transpose(1, 2)  # [E, Na+Nb, K]: the weights' own layout
            dwa, dwb = list(g[:, :na].unbind(0)), list(g[:, na:].unbind(0))
        else:
            dwa, dwb = list(g[:, :, :na].unbind(0)), list(g[:, :, na:].unbind(0))
    return _match_inputs(ctx, (dx, dwa, dwb, None))


grouped_mm_list_cat.register_autograd(_list_cat_bwd, setup_context=_list_cat_setup)


# --------------------------------------------------------------------------- unpermute_combine
@torch.library.custom_op("moe_compile::unpermute_combine", mutates_args=())
def unpermute_combine(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    _check(weights.dim() == 2, "unpermute_combine", f"weights must be [T, K], got {tuple(weights.shape)}")
    _check(y.shape[0] == weights.numel() == inv.numel(), "unpermute_combine",
           f"y has {y.shape[0]} rows, inv {inv.numel()}, weights {weights.numel()}: all must be T*K")
    return _impl("unpermute_combine", y)(y, inv, weights, offsets)


@unpermute_combine.register_fake
def _(y, inv, weights, offsets):
    return y.new_empty(weights.shape[0], y.shape[1])


def _combine_setup(ctx, inputs, output):
    y, inv, weights, offsets = inputs
    ctx.save_for_backward(y, inv, weights, offsets)


def _combine_bwd(ctx, dout):
    y, inv, weights, offsets = ctx.saved_tensors
    dy, dw = unpermute_combine_backward(dout.contiguous(), y, inv, weights, offsets)
    return dy, None, (dw if ctx.needs_input_grad[2] else None), None


unpermute_combine.register_autograd(_combine_bwd, setup_context=_combine_setup)


@torch.library.custom_op("moe_compile::unpermute_combine_backward", mutates_args=())
def unpermute_combine_backward(dout: torch.Tensor, y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor,
                               offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl("unpermute_combine_backward", y)(dout, y, inv, weights, offsets)


@unpermute_combine_backward.register_fake
def _(dout, y, inv, weights, offsets):
    return torch.empty_like(y), torch.empty_like(weights)


OP_NAMES = ("route_permute", "permute_rows", "grouped_mm", "grouped_mm_list", "grouped_mm_list_cat",
            "unpermute_combine")


# Backward graphs call fused.grouped_mm_wgrad_lowp. A compiled backward loaded from Inductor's /
# AOTAutograd's cache in a new process is not re-traced, so nothing else would import fused.py
# before the generated code looks up torch.ops.moe_compile.grouped_mm_wgrad_lowp.
from . import fused  # noqa: E402,F401
