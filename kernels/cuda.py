"""CUDA implementations of the moe_compile ops, registered lazily on first CUDA use.

Imported by ``registry.implementation`` the first time an op sees a CUDA tensor, which reads
``IMPLS``; never imported on CPU, so CPU CI never needs Triton. If Triton is missing, only the
plain-torch route_permute is listed and the references run the rest.

What runs where (all sync-free: no .item()/.tolist()/nonzero, static launch shapes):

    route_permute              Triton stable counting sort in two launches (per-block key counts, then
                               placement; up to ROUTE_PERMUTE_MAX_COUNTS blocks x keys), else torch:
                               int32 stable sort + searchsorted + scatter (no atomics)
    permute_rows               Triton gather (dropped rows written as 0)
    permute_scale(_backward)   the same gather times each row's weight; its backward one pass over dxp
    grouped_mm  16-bit, sm90,  Triton TMA grouped GEMM (_triton_tma: bias in the epilogue, rows past
                aligned        offsets[-1] zeroed in the same launch; 0.98-1.13x CUTLASS and 1.1-1.3x
                               the pointer kernel on the benchmark layers' GEMMs,
                               examples/benchmark/gmm_ab.py)
                bf16, sm100,   torch._grouped_mm (CUTLASS, offsets stay on the device) + one pass
                big groups     that zeros rows past offsets[-1] and adds the bias (big: more than
                               AUTO_TRITON_MAX_ROWS_PER_GROUP rows per expert on average)
                otherwise      Triton persistent grouped GEMM (fp32 via tf32x3 / tf32 following
                               torch.get_float32_matmul_precision()), bias in the epilogue
    grouped_mm_cat    sm90     two TMA launches writing the halves of one output (torchtitan's w1 / w3),
                               else two grouped_mm and their cat
    grouped_mm_cat_dx sm90     one TMA launch, K = 2I, over two weights of one layout (one descriptor
                               [2, E, I, H] spanning both), else two grouped_mm added
    grouped_mm_list            one strided view + the grouped_mm path when the weights are evenly
                               spaced views of one buffer; else Triton reading each expert in place
                               through a cached table of offsets in pinned host memory (no copy;
                               weight_tables: a table is freed only once no launch can read it)
    grouped_mm_wgrad  bf16,    quack-kernels' warp-specialised varlen GEMM (_quack, optional extra
                sm90, aligned  "quack"; 1.07-1.27x CUTLASS on the benchmark layers' weight gradients,
                               examples/benchmark/quack_ab.py), fp32 or bf16 out directly
                bf16           torch._grouped_mm 2Dx2D (x^T, dy) + one pass to fp32 that zeros
                               empty groups; otherwise a Triton kernel writing fp32 directly
    grouped_bias_grad          Triton segmented column sum (fp32, fixed order)
    unpermute_combine(+bwd)    Triton gather-reduce over top-k in fp32, routing weights fused
    unpermute_sum              the same kernel without weights (its backward is permute_rows)
    swiglu(+bwd)               Triton, fp32 math; the backward reads h and da once, writes dh once
    weighted_swiglu(+bwd)      the same with each row's routing weight; the backward also sums the
                               weight's gradient over each row (BM rows per program, columns in turn)
    router_topk                Triton: one int64 key per score (torch.topk's order, ties to the lower index),
                               K rounds of a row max (E <= 1024, k <= 64); else torch.topk

``torch._grouped_mm`` is avoided for fp32/fp16: its fallback copies ``offs`` to the host (a sync).

Worked example (T=3, K=2, E=4, expert_ids = [[1, 3], [0, 1], [3, 1]]):
    route_permute -> perm [2, 0, 3, 5, 1, 4], inv [1, 4, 0, 2, 5, 3], offsets [1, 4, 4, 6]
    grouped_mm(xp[6, K], w[4, K, N], offsets) -> row 0 uses w[0], rows 1..3 w[1], rows 4..5 w[3]
"""
from __future__ import annotations

import torch

from . import weight_tables
from .layout import even_step

try:  # Triton is optional: without it the references stay in place.
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

# Forward/dgrad grouped GEMM backend. "auto": the TMA kernel on sm90 (bf16/fp16, aligned); elsewhere
# CUTLASS (torch._grouped_mm) for large groups where legal, the Triton pointer kernel for the rest.
# "tma" / "cutlass": that kernel wherever legal. "triton": always the pointer kernel.
# Tests set each to cover every path on one GPU (fp32 always takes the pointer kernel).
GMM_BACKEND = "auto"
# Off sm90 (or for inputs the TMA kernel cannot describe), auto picks the pointer kernel when the
# average group is at most this many rows: measured on an H200 before the TMA kernel existed,
# DeepSeek-V3-like (E=256, 128 rows/expert) up projection 373 TFLOP/s Triton vs 297 CUTLASS;
# Qwen3-30B-A3B (512 rows/expert) 467 Triton vs 500-565 CUTLASS; GPT-OSS/Mixtral (1024) CUTLASS ahead.
AUTO_TRITON_MAX_ROWS_PER_GROUP = 128


# Weight-gradient grouped GEMM. "auto": quack's kernel (kernels/_quack.py) on sm90 where quack-kernels
# is installed and the operands fit, else as "cutlass"; "cutlass": torch._grouped_mm where legal, the
# Triton kernel for the rest; "quack": like auto, but an error if quack cannot be imported (tests,
# benchmarks). GMM_BACKEND="triton" overrides.
WGRAD_BACKEND = "auto"
WGRAD_BACKENDS = ("auto", "cutlass", "quack")
# Tile scheduler of quack's weight gradient. "dynamic": each SM takes the next tile from an atomic
# counter when it is done; "static": tile i runs on SM i mod #SMs; "auto": static where that is
# balanced for any routing (each expert's tile count a multiple of the SM count:
# _quack.static_is_balanced), else dynamic. A tile's work is its expert's row count, so under uneven
# routing an unbalanced static schedule leaves SMs idle. H200, Qwen3-30B-A3B weight gradients with
# ~1/3 of the experts empty (examples/benchmark/quack_ab.py --spread 1.5): down (64 tiles per
# expert) 438 static -> 535 TFLOP/s dynamic; up (132 tiles, balanced) 542 static, 515 dynamic; on
# even routing dynamic is 4-6% slower (docs/benchmarks.md section 2.7).
WGRAD_SCHEDULER = "auto"
WGRAD_SCHEDULERS = ("auto", "dynamic", "static")

# Our Triton kernels launch through kernels/_launch.py (a cached compiled kernel launched directly:
# the same kernel, less host work per call); False: through kernel[grid](...) (A/B runs).
LEAN_LAUNCH = True

_CUTLASS_DEVICE: dict[int | None, bool] = {}


def _cutlass_device(t: torch.Tensor) -> bool:
    """sm90/sm100: where torch._grouped_mm has its CUTLASS kernel (elsewhere it syncs)."""
    ok = _CUTLASS_DEVICE.get(t.device.index)
    if ok is None:
        ok = hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(t.device)[0] in (9, 10)
        _CUTLASS_DEVICE[t.device.index] = ok
    return ok


_TMA_DEVICE: dict[int | None, bool] = {}


def _tma_device(device: torch.device) -> bool:
    """sm90 (Hopper): where the TMA grouped GEMM (``_triton_tma``) was tuned and measured."""
    index = torch.cuda.current_device() if device.index is None else device.index
    ok = _TMA_DEVICE.get(index)
    if ok is None:
        ok = torch.cuda.get_device_capability(index)[0] == 9
        _TMA_DEVICE[index] = ok
    return ok


def _tma_ok_2d(t: torch.Tensor) -> bool:
    """One of the last two strides is 1 and the other a multiple of 16 bytes that spans a whole row
    (column): no broadcast (stride 0) or overlapping rows; 16-byte aligned base."""
    es = t.element_size()
    s0, s1 = t.stride(-2), t.stride(-1)
    ok = ((s1 == 1 and (s0 * es) % 16 == 0 and s0 >= max(1, t.shape[-1]))
          or (s0 == 1 and (s1 * es) % 16 == 0 and s1 >= max(1, t.shape[-2])))
    if t.dim() == 3:
        ok = ok and (t.stride(0) * es) % 16 == 0
    return ok and t.data_ptr() % 16 == 0


# torch._grouped_mm (CUTLASS) raises "Can't process more than 1024 groups" from 1024 groups on
CUTLASS_MAX_GROUPS = 1023


def _use_cutlass(*ts: torch.Tensor, groups: int) -> bool:
    return (GMM_BACKEND != "triton" and groups <= CUTLASS_MAX_GROUPS and all(t.dtype == torch.bfloat16 for t in ts)
            and _cutlass_device(ts[0]) and all(_tma_ok_2d(t) for t in ts))


# --------------------------------------------------------------------------------- routing
# Triton route_permute's placement launch holds every block's key counts in registers: at most this
# many (65,536 rows over 128 experts: 64 blocks x 256 bins = 16,384), over at most this many experts
# (32,766 experts in one block did not finish compiling in 90 s); above either, the torch sort runs.
ROUTE_PERMUTE_MAX_COUNTS = 32768
ROUTE_PERMUTE_MAX_EXPERTS = 1024


def route_permute(expert_ids: torch.Tensor, num_experts: int):
    """Stable counting-sort permutation, on the device.

    expert_ids [[1, 3], [0, 1], [3, 1]], E=4 -> key [1, 3, 0, 1, 3, 1] (ids outside [0, E) -> E),
    perm = argsort(key, stable) = [2, 0, 3, 5, 1, 4], offsets[e] = #(key <= e) = [1, 4, 4, 6],
    inv[perm[p]] = p = [1, 4, 0, 2, 5, 3].
    """
    if triton is not None and expert_ids.dtype in (torch.int32, torch.int64) and num_experts <= ROUTE_PERMUTE_MAX_EXPERTS:
        from . import _triton_moe

        if _triton_moe.route_permute_counts(expert_ids.numel(), num_experts) <= ROUTE_PERMUTE_MAX_COUNTS:
            return _triton_moe.route_permute(expert_ids, num_experts)
    flat = expert_ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):   # uint8 / int8 / int16 ids: E itself may not fit them
        flat = flat.to(torch.int32)
    n = flat.numel()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts).to(torch.int32)
    sorted_key, perm = torch.sort(key, stable=True)
    bounds = torch.arange(num_experts, dtype=torch.int32, device=flat.device)
    offsets = torch.searchsorted(sorted_key, bounds, right=True, out_int32=True)
    inv = torch.empty_like(perm)
    inv.scatter_(0, perm, torch.arange(n, dtype=perm.dtype, device=flat.device))
    return perm, inv, offsets


# ----------------------------------------------------------------------------- grouped GEMM
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None = None):
    """Per-group x @ w[e] (+ bias[e]); rows past offsets[-1] are 0.

    x [5, 2] rows 0..1 -> group 0, rows 2..3 -> group 1, row 4 dropped (offsets [2, 4]):
    y[0:2] = x[0:2] @ w[0], y[2:4] = x[2:4] @ w[1], y[4] = 0.
    """
    from . import _triton_gmm, _triton_moe

    offsets = offsets.to(torch.int32) if offsets.dtype != torch.int32 else offsets.contiguous()
    large = GMM_BACKEND == "cutlass" or x.shape[0] > AUTO_TRITON_MAX_ROWS_PER_GROUP * w.shape[0]
    if GMM_BACKEND in ("auto", "tma") and x.shape[0] > 0 and _tma_device(x.device):
        from . import _triton_tma

        if _triton_tma.supported(x, w):
            return _triton_tma.grouped_mm(x, w, offsets, bias)  # zeroes rows past offsets[-1] itself
    if large and GMM_BACKEND != "tma" and _use_cutlass(x, w, groups=w.shape[0]) and w.shape[2] % 8 == 0 \
            and x.shape[0] > 0:
        y = torch._grouped_mm(x, w, offs=offsets)
        if y.stride(-1) != 1 or y.stride(0) != y.shape[1]:  # padded rows: never expected for N % 8 == 0
            y = y.contiguous()
        return _triton_moe.rows_fixup(y, offsets, bias)
    y = _triton_gmm.grouped_mm(x, w, offsets, bias)
    return _triton_moe.rows_fixup(y, offsets, None)


def _list_plan(ws: list[torch.Tensor]) -> tuple:
    """How to read per-expert weights (``weight_tables``: the plans, and when a table may be freed),
    cached on the experts' addresses plus expert 0's shape, strides and dtype (the other experts are
    assumed to keep the layout they had when the plan was made, as module parameters do). The per-call
    host cost is one pass of data_ptr() instead of several passes of shape/stride/storage checks over
    E tensors (~250 us for 128 experts). A table's offsets are 16-byte aligned; nothing is allocated
    on the device, so a table made during a CUDA-graph warm-up is not a stray allocation of the graph
    pool, and there is no host-to-device copy to order.
    """
    w0 = ws[0]
    ptrs = tuple(map(torch.Tensor.data_ptr, ws))
    key = (ptrs, tuple(w0.shape), w0.stride(), w0.dtype, w0.device.index)
    plan = weight_tables.get(key)
    if plan is None:
        es = w0.element_size()
        odd = next((i for i, w in enumerate(ws) if w.dtype != w0.dtype or w.device != w0.device), None)
        if odd is not None:
            raise ValueError(f"grouped_mm_list: expert {odd}'s weight is {ws[odd].dtype} on {ws[odd].device}, expert "
                             f"0's {w0.dtype} on {w0.device}; every expert's weight needs one dtype and device "
                             "(cast the experts together: experts.to(dtype))")
        uniform = all(w.shape == w0.shape and w.stride() == w0.stride() for w in ws)
        step = even_step(ws) if len(ws) > 1 else 0
        if uniform and (len(ws) == 1 or step):
            plan = ("view", step)
        elif uniform and not any(p % 16 for p in ptrs):
            plan = weight_tables.new_table([(p - ptrs[0]) // es for p in ptrs])
        else:
            plan = ("stack",)
        weight_tables.put(key, plan, torch.cuda.is_current_stream_capturing())
    return plan


def grouped_mm_list(x: torch.Tensor, ws: list[torch.Tensor], offsets: torch.Tensor, biases: list[torch.Tensor]):
    """grouped_mm over per-expert weights ws[e] [K, N] (ModuleList weights, usually ``W_e.t()``).

    Evenly spaced views of one buffer (re-homed weights) -> one strided [E, K, N] view -> the
    grouped_mm path (CUTLASS for bf16). Separate tensors -> the Triton grouped GEMM reading each
    expert in place through a table of offsets (no per-step stack copy). E.g. 3 experts at
    addresses 0x1000, 0x9000, 0x5000 (bf16) -> table [0, 16384, 8192].
    """
    from . import _triton_gmm, _triton_moe

    bias = torch.stack(biases) if biases else None
    plan = _list_plan(ws)
    w0 = ws[0]
    if plan[0] == "view":
        w3 = w0.as_strided((len(ws), *w0.shape), (plan[1], *w0.stride()), w0.storage_offset())
        return grouped_mm(x, w3, offsets, bias)
    if plan[0] == "stack":
        return grouped_mm(x, torch.stack(ws), offsets, bias)
    offsets = offsets.to(torch.int32) if offsets.dtype != torch.int32 else offsets.contiguous()
    weight_tables.note_read(plan, torch.cuda.current_stream(x.device), torch.cuda.is_current_stream_capturing())
    y = _triton_gmm.grouped_mm(x, w0, offsets, bias, w_table=plan[1])
    return _triton_moe.rows_fixup(y, offsets, None)


def pairs_without_copy(device: torch.device) -> bool:
    """grouped_mm_cat writes its two halves into one output and grouped_mm_cat_dx is one TMA launch here
    (when the weights allow: ``_triton_tma.halves_supported`` / ``pair_supported``): the lowering emits the
    pair only then (elsewhere the halves and their cat would be one copy more than two GEMMs)."""
    return triton is not None and GMM_BACKEND in ("auto", "tma") and _tma_device(device)


def grouped_mm_cat(x: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, offsets: torch.Tensor):
    """[x @ wa[e] | x @ wb[e]] -> [M, Na + Nb]: two TMA launches, each writing its half of the output, where
    the weights allow it, else each half through the grouped_mm path and their cat."""
    offsets = offsets.to(torch.int32) if offsets.dtype != torch.int32 else offsets.contiguous()
    if GMM_BACKEND in ("auto", "tma") and x.shape[0] > 0 and _tma_device(x.device):
        from . import _triton_tma

        if _triton_tma.halves_supported(x, wa, wb):
            return _triton_tma.grouped_mm_halves(x, wa, wb, offsets)
    return torch.cat([grouped_mm(x, wa, offsets), grouped_mm(x, wb, offsets)], dim=1)


def grouped_mm_cat_dx(dy: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, offsets: torch.Tensor):
    """dy[:, :Na] @ wa[e]^T + dy[:, Na:] @ wb[e]^T -> [M, K]: one TMA launch with K = Na + Nb (one fp32
    sum) where the weights allow it, else two grouped GEMMs added."""
    offsets = offsets.to(torch.int32) if offsets.dtype != torch.int32 else offsets.contiguous()
    if GMM_BACKEND in ("auto", "tma") and dy.shape[0] > 0 and _tma_device(dy.device):
        from . import _triton_tma

        if _triton_tma.pair_supported(dy, wa, wb):
            return _triton_tma.grouped_mm_cat_dx(dy, wa, wb, offsets)
    na = wa.shape[2]
    return (grouped_mm(dy[:, :na].contiguous(), wa.transpose(1, 2), offsets)
            + grouped_mm(dy[:, na:].contiguous(), wb.transpose(1, 2), offsets))


def grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, num_experts: int):
    """dw[e] = x[rows e]^T @ dy[rows e] as fp32 [E, K, N]; 0 for empty groups."""
    return _wgrad(x, dy, offsets, num_experts, torch.float32)


def grouped_mm_wgrad_lowp(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, num_experts: int):
    """Like grouped_mm_wgrad but returns x.dtype (fp32 accumulation, one rounding at the end)."""
    return _wgrad(x, dy, offsets, num_experts, x.dtype)


def _wgrad(x, dy, offsets, num_experts, out_dtype):
    from . import _quack, _triton_gmm, _triton_moe

    offsets = offsets.to(torch.int32) if offsets.dtype != torch.int32 else offsets.contiguous()
    if WGRAD_BACKEND != "cutlass" and GMM_BACKEND != "triton" and _tma_device(x.device):
        if WGRAD_BACKEND not in WGRAD_BACKENDS:
            raise ValueError(f"moe_compile.kernels.cuda.WGRAD_BACKEND is {WGRAD_BACKEND!r}; use one of {WGRAD_BACKENDS}")
        if WGRAD_SCHEDULER not in WGRAD_SCHEDULERS:
            raise ValueError(f"moe_compile.kernels.cuda.WGRAD_SCHEDULER is {WGRAD_SCHEDULER!r}; "
                             f"use one of {WGRAD_SCHEDULERS}")
        if WGRAD_BACKEND == "quack" and not _quack.available():
            raise RuntimeError(f"moe_compile.kernels.cuda.WGRAD_BACKEND is 'quack' but {_quack.why_not()}; "
                               "pip install 'moe_compile[quack]', or set it to 'auto'")
        if _quack.usable(x, dy, out_dtype):
            dynamic = WGRAD_SCHEDULER == "dynamic" or (WGRAD_SCHEDULER == "auto" and not _quack.static_is_balanced(
                x.shape[1], dy.shape[1], _triton_gmm.num_sms(x.device)))
            return _quack.grouped_mm_wgrad(x, dy, offsets, num_experts, out_dtype, dynamic=dynamic)
    k, n = x.shape[1], dy.shape[1]
    # CUTLASS writes bf16 [E, K, N] (fp32 accumulation): an fp32 out_dtype would get bf16-rounded values
    if out_dtype == x.dtype and _use_cutlass(x, dy, groups=num_experts) and k % 8 == 0 and n % 8 == 0 \
            and x.shape[0] > 0:
        dw = torch._grouped_mm(x.t(), dy, offs=offsets)
        if dw.stride(-1) == 1 and dw.stride(-2) == n:   # the CUTLASS kernel need not write groups with no rows
            return _triton_moe.zero_empty_groups(dw, offsets)
    return _triton_gmm.grouped_mm_wgrad(x, dy, offsets, num_experts, out_dtype)


def grouped_bias_grad(dy: torch.Tensor, offsets: torch.Tensor, num_experts: int):
    from . import _triton_moe

    return _triton_moe.grouped_bias_grad(dy, offsets, num_experts)


# ------------------------------------------------------------------------- permute / combine
def permute_rows(x, perm, offsets, top_k):
    from . import _triton_moe

    return _triton_moe.permute_rows(x, perm, offsets, top_k)


def permute_scale(x, perm, offsets, weights, out_dtype):
    from . import _triton_scale, reference

    if reference._scale_dtype(x, weights) != torch.float32 or out_dtype == torch.float64:   # the kernel: fp32
        return reference.permute_scale(x, perm, offsets, weights, out_dtype)
    return _triton_scale.permute_scale(x, perm, offsets, weights, out_dtype)


def permute_scale_backward(dxp, x, inv, weights, offsets):
    from . import _triton_scale, reference

    if reference._scale_dtype(dxp, x, weights) != torch.float32:
        return reference.permute_scale_backward(dxp, x, inv, weights, offsets)
    return _triton_scale.permute_scale_backward(dxp, x, inv, weights, offsets)


def _float64(*ts) -> bool:
    """The combine kernels sum in fp32: an fp64 operand or output goes to the reference."""
    return any(t == torch.float64 or getattr(t, "dtype", None) == torch.float64 for t in ts)


def unpermute_combine(y, inv, weights, offsets, out_dtype=None):
    from . import _triton_moe, reference

    if _float64(y, weights, out_dtype):
        return reference.unpermute_combine(y, inv, weights, offsets, out_dtype)
    return _triton_moe.unpermute_combine(y, inv, weights, offsets, out_dtype)


def unpermute_combine_backward(dout, y, inv, weights, offsets):
    from . import _triton_moe, reference

    if _float64(dout, y, weights):
        return reference.unpermute_combine_backward(dout, y, inv, weights, offsets)
    return _triton_moe.unpermute_combine_backward(dout, y, inv, weights, offsets)


def unpermute_sum(y, perm, inv, offsets, top_k, out_dtype=None):
    from . import _triton_moe, reference

    if _float64(y, out_dtype):
        return reference.unpermute_sum(y, perm, inv, offsets, top_k, out_dtype)
    return _triton_moe.unpermute_sum(y, perm, inv, offsets, top_k, out_dtype)


def weighted_swiglu(h, weights, perm, offsets):
    from . import _triton_act

    return _triton_act.weighted_swiglu(h, weights, perm, offsets)


def weighted_swiglu_backward(h, weights, perm, offsets, da):
    from . import _triton_act

    return _triton_act.weighted_swiglu_backward(h, weights, perm, offsets, da)


def swiglu(h):
    from . import _triton_act

    return _triton_act.swiglu(h)


def swiglu_backward(h, da):
    from . import _triton_act

    return _triton_act.swiglu_backward(h, da)


def router_topk(scores, k):
    from . import _triton_moe

    if _triton_moe.router_topk_supported(scores, k):
        return _triton_moe.router_topk(scores, k)
    return torch.topk(scores, k, dim=-1)


_ALL = {
    "route_permute": route_permute,
    "router_topk": router_topk,
    "permute_rows": permute_rows,
    "permute_scale": permute_scale,
    "permute_scale_backward": permute_scale_backward,
    "grouped_mm": grouped_mm,
    "grouped_mm_list": grouped_mm_list,
    "grouped_mm_cat": grouped_mm_cat,
    "grouped_mm_cat_dx": grouped_mm_cat_dx,
    "grouped_mm_wgrad": grouped_mm_wgrad,
    "grouped_bias_grad": grouped_bias_grad,
    "unpermute_combine": unpermute_combine,
    "unpermute_combine_backward": unpermute_combine_backward,
    "grouped_mm_wgrad_lowp": grouped_mm_wgrad_lowp,
    "swiglu": swiglu,
    "swiglu_backward": swiglu_backward,
    "unpermute_sum": unpermute_sum,
    "weighted_swiglu": weighted_swiglu,
    "weighted_swiglu_backward": weighted_swiglu_backward,
}

# op name -> implementation on CUDA tensors (registry.py reads this); without Triton only route_permute,
# whose torch path needs none
IMPLS = {name: fn for name, fn in _ALL.items() if triton is not None or name == "route_permute"}
