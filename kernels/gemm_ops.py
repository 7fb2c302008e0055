"""Grouped GEMM ops: one GEMM per expert group of rows, over stacked or per-expert (ModuleList) weights.

    grouped_mm(x[M,K], w[E,K,N], offsets, bias?) -> y[M,N]           (x @ w[e] per group)
    grouped_mm_list(x, ws: E x [K,N], offsets, biases)  -> y[M,N]     (ModuleList weights, no stacking;
                                                                       transposed=True: E x [N,K])
    grouped_mm_list_cat(x, ws_a, ws_b, offsets)          -> [M,Na+Nb] (sibling linears, e.g. w1|w3)
    grouped_mm_wgrad(x, dy, offsets, E)      -> fp32 [E,K,N];  grouped_mm_wgrad_lowp -> x.dtype
    grouped_bias_grad(dy, offsets, E)        -> fp32 [E,N]
    (float64 inputs: every op computes in float64, with its reference on every device; the others
    accumulate in float32)

Rows past offsets[-1] are zero in every output. Autograd formulas are built from these ops.

Why ``grouped_mm_wgrad_lowp``: ``grouped_mm``'s backward could call ``grouped_mm_wgrad`` (fp32
[E, K, N]) and then ``.to(w.dtype)``: for bf16 weights three full passes over an fp32 copy of every
expert weight per step (~12 extra bytes per weight element, e.g. 7 GB and ~2.4 ms on an H100 for
one Qwen3-30B-A3B layer). The lowp op accumulates in fp32 and rounds once to x.dtype inside the
GEMM, so the weight gradient costs one bf16 write (9.9 ms -> 4.3 ms forward+backward for that
layer on an H200, docs/benchmarks.md).

Worked example of the weight gradient (E=2, offsets=[2, 2]: group 0 = rows 0..1, group 1 empty,
row 2 dropped)::

    x = [[1, 2], [3, 4], [9, 9]], dy = [[1], [1], [7]]  ->  dw[0] = x[0:2]^T dy[0:2] = [[4], [6]],
    dw[1] = [[0], [0]]                                        (row 2 is in no group)
"""
from __future__ import annotations

import torch

from .common import check
from .layout import TMA_K_STEP, pair_view, strided_stack
from .registry import implementation


# --------------------------------------------------------------------------- grouped_mm
def check_gmm(op, x, w_shape, w_dtype, offsets, num_groups):
    check(x.dim() == 2, op, f"x must be 2-D [M, K], got {tuple(x.shape)}")
    check(x.shape[1] == w_shape[0], op, f"x has K={x.shape[1]} but the expert weight has K={w_shape[0]}")
    check(x.dtype == w_dtype, op, f"x is {x.dtype} but the expert weights are {w_dtype}; cast one of them")
    check(not offsets.is_floating_point(), op, f"offsets must be integer group ends (route_permute's), got {offsets.dtype}")
    check(offsets.dim() == 1 and offsets.numel() == num_groups, op,
          f"offsets has shape {tuple(offsets.shape)}, the weights have {num_groups} groups: it must be [{num_groups}]")


def check_wgrad(op, x, dy, offsets, num_experts):
    check(x.dim() == 2 and dy.dim() == 2 and x.shape[0] == dy.shape[0], op,
          f"x {tuple(x.shape)} and dy {tuple(dy.shape)} must be 2-D with the same number of rows")
    check(x.dtype == dy.dtype, op, f"x is {x.dtype} but dy is {dy.dtype}")
    check(offsets.dim() == 1 and offsets.numel() == num_experts, op,
          f"offsets has shape {tuple(offsets.shape)}, num_experts is {num_experts}: it must be [num_experts]")


@torch.library.custom_op("moe_compile::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    check(w.dim() == 3, "grouped_mm", f"w must be 3-D [E, K, N], got {tuple(w.shape)}")
    check_gmm("grouped_mm", x, w.shape[1:], w.dtype, offsets, w.shape[0])
    if bias is not None:
        check(tuple(bias.shape) == (w.shape[0], w.shape[2]), "grouped_mm",
              f"bias must be [E, N] = {(w.shape[0], w.shape[2])} (one row per expert), got {tuple(bias.shape)}")
    return implementation("grouped_mm", x)(x, w, offsets, bias)


@grouped_mm.register_fake
def _(x, w, offsets, bias=None):
    return x.new_empty(x.shape[0], w.shape[-1])


def _grouped_mm_setup(ctx, inputs, output):
    x, w, offsets, bias = inputs
    ctx.save_for_backward(x, w, offsets)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _weight_grad(x, dy, offsets, num_experts, w_dtype, w_col_major):
    """dL/dw in w's dtype and layout, rounded once (see grouped_mm_weight_grad)."""
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
    check_wgrad("grouped_mm_wgrad", x, dy, offsets, num_experts)
    return implementation("grouped_mm_wgrad", x)(x, dy, offsets, num_experts)


@grouped_mm_wgrad.register_fake
def _(x, dy, offsets, num_experts):
    return x.new_empty(num_experts, x.shape[1], dy.shape[1], dtype=torch.promote_types(x.dtype, torch.float32))


@torch.library.custom_op("moe_compile::grouped_bias_grad", mutates_args=())
def grouped_bias_grad(dy: torch.Tensor, offsets: torch.Tensor, num_experts: int) -> torch.Tensor:
    check(dy.dim() == 2, "grouped_bias_grad", f"dy must be 2-D [M, N], got {tuple(dy.shape)}")
    check(offsets.dim() == 1 and offsets.numel() == num_experts, "grouped_bias_grad",
          f"offsets must be [num_experts={num_experts}], got {tuple(offsets.shape)}")
    return implementation("grouped_bias_grad", dy)(dy, offsets, num_experts)


@grouped_bias_grad.register_fake
def _(dy, offsets, num_experts):
    return dy.new_empty(num_experts, dy.shape[1], dtype=torch.promote_types(dy.dtype, torch.float32))


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
    check(len(ws) > 0 and all(w.dim() == 2 for w in ws), "grouped_mm_list", "ws must be a non-empty list of 2-D [K, N]")
    check_gmm("grouped_mm_list", x, ws[0].shape[::-1] if transposed else ws[0].shape, ws[0].dtype, offsets, len(ws))
    check(len(biases) in (0, len(ws)), "grouped_mm_list", f"{len(biases)} biases for {len(ws)} experts: give one per "
          "expert, or none")
    if transposed and not biases:
        view = strided_stack(ws)  # [E, N, K] -> one zero-copy grouped GEMM on its transpose
        if view is not None:
            return implementation("grouped_mm", x)(x, view.transpose(1, 2), offsets, None)
    return implementation("grouped_mm_list", x)(x, _list_kn(ws, transposed), offsets, biases)


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
@torch.library.custom_op("moe_compile::grouped_mm_list_cat", mutates_args=())
def grouped_mm_list_cat(x: torch.Tensor, ws_a: list[torch.Tensor], ws_b: list[torch.Tensor],
                        offsets: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """Two sibling grouped linears of one input, e.g. SwiGLU's w1 and w3: y = [x @ ws_a[e] | x @ ws_b[e]]
    per group -> [M, Na + Nb]. One grouped GEMM over ``pair_view`` when the weights share one buffer,
    else two (and a concatenation). ``transposed``: as in ``grouped_mm_list`` (ws[e] is [N, K])."""
    check(len(ws_a) == len(ws_b) > 0, "grouped_mm_list_cat", "ws_a and ws_b must list the same experts")
    for ws in (ws_a, ws_b):
        check_gmm("grouped_mm_list_cat", x, ws[0].shape[::-1] if transposed else ws[0].shape, ws[0].dtype,
                   offsets, len(ws))
    view = pair_view(ws_a, ws_b, transposed)
    if view is not None:
        return implementation("grouped_mm", x)(x, view, offsets, None)
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
        return implementation("grouped_mm", dy)(dy, view.transpose(1, 2), offsets, None)
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


# --------------------------------------------------------------------------- grouped_mm_cat
def _check_cat(op, x, wa, wb, offsets, k_dim):
    for w in (wa, wb):
        check(w.dim() == 3, op, f"wa and wb must be 3-D [E, K, N], got {tuple(w.shape)}")
    check(wa.shape[:2] == wb.shape[:2] and wa.dtype == wb.dtype, op,
          f"wa {tuple(wa.shape)} {wa.dtype} and wb {tuple(wb.shape)} {wb.dtype} must share E, K and dtype")
    k = wa.shape[1] if k_dim == 1 else wa.shape[2] + wb.shape[2]
    check_gmm(op, x, (k, 0), wa.dtype, offsets, wa.shape[0])


@torch.library.custom_op("moe_compile::grouped_mm_cat", mutates_args=())
def grouped_mm_cat(x: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Two sibling grouped linears of one input with stacked weights (torchtitan's w1 and w3, each
    [E, K, N*] as grouped_mm takes them): [x @ wa[e] | x @ wb[e]] per group -> [M, Na + Nb], one output
    that the SwiGLU op reads whole. On Hopper two TMA grouped GEMMs write the two halves of that output
    (``_triton_tma.grouped_mm_halves``), else each half is its own GEMM and the two are concatenated."""
    _check_cat("grouped_mm_cat", x, wa, wb, offsets, 1)
    return implementation("grouped_mm_cat", x)(x, wa, wb, offsets)


@grouped_mm_cat.register_fake
def _(x, wa, wb, offsets):
    return x.new_empty(x.shape[0], wa.shape[2] + wb.shape[2])


@torch.library.custom_op("moe_compile::grouped_mm_cat_dx", mutates_args=())
def grouped_mm_cat_dx(dy: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Input gradient of grouped_mm_cat: dy[:, :Na] @ wa[e]^T + dy[:, Na:] @ wb[e]^T per group -> [M, K],
    one fp32 accumulation over both halves (one GEMM with K = Na + Nb where the kernel allows it)."""
    _check_cat("grouped_mm_cat_dx", dy, wa, wb, offsets, 2)
    return implementation("grouped_mm_cat_dx", dy)(dy, wa, wb, offsets)


@grouped_mm_cat_dx.register_fake
def _(dy, wa, wb, offsets):
    return dy.new_empty(dy.shape[0], wa.shape[1])


def cat_without_copy(device: torch.device, dtype: torch.dtype, nh: int) -> bool:
    """The lowering emits grouped_mm_cat for two sibling linears with 3-D weights [E, K, nh] run in ``dtype``
    on ``device``: on CPU (the reference, where the rewrite is tested), and where the CUDA kernels write its
    halves in place and run its input gradient as one GEMM (sm90, 16-bit, nh a multiple of the k-step;
    the weights' addresses are checked at run time, where the op falls back to two GEMMs). Elsewhere its
    halves and their cat would cost one copy more than the two grouped_mm it replaces."""
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or nh % TMA_K_STEP:
        return False
    from . import cuda

    return cuda.pairs_without_copy(device)


def _cat_setup(ctx, inputs, output):
    x, wa, wb, offsets = inputs
    ctx.save_for_backward(x, wa, wb, offsets)


def _cat_bwd(ctx, dy):
    x, wa, wb, offsets = ctx.saved_tensors
    dy = dy.contiguous()
    na = wa.shape[2]
    dx = grouped_mm_cat_dx(dy, wa, wb, offsets) if ctx.needs_input_grad[0] else None
    dwa = (_weight_grad(x, dy[:, :na], offsets, wa.shape[0], wa.dtype, wa.stride(-2) == 1)
           if ctx.needs_input_grad[1] else None)
    dwb = (_weight_grad(x, dy[:, na:], offsets, wb.shape[0], wb.dtype, wb.stride(-2) == 1)
           if ctx.needs_input_grad[2] else None)
    return dx, dwa, dwb, None


grouped_mm_cat.register_autograd(_cat_bwd, setup_context=_cat_setup)


# --------------------------------------------------------------------------- weight gradients
@torch.library.custom_op("moe_compile::grouped_mm_wgrad_lowp", mutates_args=())
def grouped_mm_wgrad_lowp(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, num_experts: int) -> torch.Tensor:
    check_wgrad("grouped_mm_wgrad_lowp", x, dy, offsets, num_experts)
    return implementation("grouped_mm_wgrad_lowp", x)(x, dy, offsets, num_experts)


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

    Used by the backwards of grouped_mm, grouped_mm_list and grouped_mm_list_cat (ws[e] is [K, N]).
    """
    a, b = (dy, x) if w_col_major else (x, dy)
    if w_dtype != torch.float32 and x.dtype == w_dtype:
        g = grouped_mm_wgrad_lowp(a, b, offsets, num_experts)
    else:
        g = grouped_mm_wgrad(a, b, offsets, num_experts).to(w_dtype)
    return g.transpose(1, 2) if w_col_major else g
