"""Triton kernels for the memory-bound MoE ops (imported only by ``cuda.py``; the activation's: ``_triton_act.py``).

Every kernel reads ``total = offsets[E-1]`` on the device (no host sync) and treats rows p >= total
as dropped. All grids depend on static shapes only (CUDA-graph safe). Reductions accumulate in fp32
in a fixed order (deterministic, no atomics).

Worked example used below (T=3, K=2, E=4): expert_ids = [[1, 3], [0, 1], [3, 1]]
    perm = [2, 0, 3, 5, 1, 4], inv = [1, 4, 0, 2, 5, 3], offsets = [1, 4, 4, 6] (total 6)
    permute_rows: xp = [x[1], x[0], x[1], x[2], x[0], x[2]]          (x[perm[p] // 2])
    combine:      out[0] = w[0,0]*y[1] + w[0,1]*y[4]                 (y[inv[0]], y[inv[1]])
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import lean  # @lean kernels: a cached compiled kernel launched directly (less host work per call)
from ._triton_gmm import num_sms


@lean
@triton.jit
def _permute_rows_kernel(x_ptr, perm_ptr, offs_ptr, xp_ptr, w_ptr, NR, H, E, sxm,
                         TOP_K: tl.constexpr, HAS_W: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    """xp[p] = x[perm[p] // TOP_K] for p < total, else 0; with HAS_W times w.flat[perm[p]] in fp32,
    rounded once to xp's dtype (permute_scale)."""
    total = tl.load(offs_ptr + E - 1)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    rmask = rows < NR
    valid = rmask & (rows < total)
    cmask = cols < H
    pair = tl.load(perm_ptr + rows, mask=valid, other=0)
    src = pair // TOP_K
    v = tl.load(x_ptr + src.to(tl.int64)[:, None] * sxm + cols[None, :], mask=valid[:, None] & cmask[None, :],
                other=0.0)
    if HAS_W:
        wr = tl.load(w_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        v = v.to(tl.float32) * wr[:, None]
    tl.store(xp_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], v.to(xp_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@lean
@triton.jit
def _combine_kernel(y_ptr, inv_ptr, w_ptr, offs_ptr, out_ptr, T, H, E, sym,
                    TOP_K: tl.constexpr, HAS_W: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """out[t] = sum_j w[t, j] * y[inv[t*K + j]] over kept rows (inv < total), fp32, j in order
    (w = 1 without HAS_W)."""
    total = tl.load(offs_ptr + E - 1)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    tmask = t < T
    cmask = cols < H
    acc = tl.zeros((BT, BH), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = tl.load(inv_ptr + t * TOP_K + j, mask=tmask, other=0)
        keep = tmask & (p < total)
        v = tl.load(y_ptr + p.to(tl.int64)[:, None] * sym + cols[None, :], mask=keep[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        if HAS_W:
            v = tl.load(w_ptr + t * TOP_K + j, mask=keep, other=0.0).to(tl.float32)[:, None] * v
        acc += v
    tl.store(out_ptr + t.to(tl.int64)[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


@lean
@triton.jit
def _combine_bwd_kernel(dout_ptr, y_ptr, inv_ptr, w_ptr, offs_ptr, dy_ptr, dw_ptr, NQ, H, E, sdm, sym,
                        TOP_K: tl.constexpr, BQ: tl.constexpr, BH: tl.constexpr):
    """For each slot q (token q // K): dy[inv[q]] = w[q] * dout[q // K] (0 if dropped),
    dw[q] = <dout[q // K], y[inv[q]]> (0 if dropped). inv is a permutation: every dy row written."""
    total = tl.load(offs_ptr + E - 1)
    q = tl.program_id(0) * BQ + tl.arange(0, BQ)
    qmask = q < NQ
    p = tl.load(inv_ptr + q, mask=qmask, other=0)
    keep = qmask & (p < total)
    wq = tl.load(w_ptr + q, mask=keep, other=0.0).to(tl.float32)
    t64 = (q // TOP_K).to(tl.int64)
    p64 = p.to(tl.int64)
    dacc = tl.zeros((BQ,), dtype=tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        cmask = cols < H
        d = tl.load(dout_ptr + t64[:, None] * sdm + cols[None, :], mask=qmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        yv = tl.load(y_ptr + p64[:, None] * sym + cols[None, :], mask=keep[:, None] & cmask[None, :],
                     other=0.0).to(tl.float32)
        g = tl.where(keep[:, None], d * wq[:, None], 0.0)
        tl.store(dy_ptr + p64[:, None] * H + cols[None, :], g.to(dy_ptr.dtype.element_ty),
                 mask=qmask[:, None] & cmask[None, :])
        dacc += tl.sum(d * yv, axis=1)
    # a dropped pair's weight is never read in eager: 0, even where dout is inf (inf * 0 = NaN otherwise)
    tl.store(dw_ptr + q, tl.where(keep, dacc, 0.0).to(dw_ptr.dtype.element_ty), mask=qmask)


@lean
@triton.jit
def _bias_grad_kernel(dy_ptr, offs_ptr, db_ptr, M, N, sym, BM: tl.constexpr, BN: tl.constexpr):
    """db[e, cols] = sum over rows of group e of dy[rows, cols] (fp32, rows in order)."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < N
    end = tl.minimum(tl.load(offs_ptr + e), M)
    start = tl.minimum(tl.load(offs_ptr + e - 1, mask=e > 0, other=0), end)
    acc = tl.zeros((BN,), dtype=tl.float32)
    for r0 in range(start, end, BM):
        rows = r0 + tl.arange(0, BM)
        v = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * sym + cols[None, :],
                    mask=(rows < end)[:, None] & cmask[None, :], other=0.0)
        acc += tl.sum(v.to(tl.float32), axis=0)
    tl.store(db_ptr + e.to(tl.int64) * N + cols, acc, mask=cmask)


@lean
@triton.jit
def _rows_fixup_kernel(y_ptr, offs_ptr, b_ptr, M, N, E, sym, sbe,
                       HAS_BIAS: tl.constexpr, E_P2: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    """After a grouped GEMM that skipped rows >= total: y[rows >= total] = 0 and, with HAS_BIAS,
    y[r] += b[group(r)] for r < total (group(r) = #(offsets <= r)). Row blocks entirely inside the
    groups return at once when there is no bias."""
    total = tl.load(offs_ptr + E - 1)
    row0 = tl.program_id(0) * BR
    rows = row0 + tl.arange(0, BR)
    rmask = rows < M
    valid = rmask & (rows < total)
    if HAS_BIAS:
        eidx = tl.arange(0, E_P2)
        ends = tl.load(offs_ptr + eidx, mask=eidx < E, other=2147483647)
        grp = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        grp = tl.minimum(grp, E - 1).to(tl.int64)
        for n0 in range(0, N, BN):
            cols = n0 + tl.arange(0, BN)
            m2 = rmask[:, None] & (cols < N)[None, :]
            ptrs = y_ptr + rows.to(tl.int64)[:, None] * sym + cols[None, :]
            v = tl.load(ptrs, mask=valid[:, None] & (cols < N)[None, :], other=0.0).to(tl.float32)
            b = tl.load(b_ptr + grp[:, None] * sbe + cols[None, :], mask=valid[:, None] & (cols < N)[None, :],
                        other=0.0).to(tl.float32)
            tl.store(ptrs, tl.where(valid[:, None], v + b, 0.0).to(y_ptr.dtype.element_ty), mask=m2)
    else:
        if row0 + BR > total:
            for n0 in range(0, N, BN):
                cols = n0 + tl.arange(0, BN)
                ptrs = y_ptr + rows.to(tl.int64)[:, None] * sym + cols[None, :]
                zero = tl.zeros((BR, BN), dtype=y_ptr.dtype.element_ty)
                tl.store(ptrs, zero, mask=(rmask & ~valid)[:, None] & (cols < N)[None, :])


@lean
@triton.jit
def _zero_empty_groups_kernel(dw_ptr, offs_ptr, E, KN, s_e, num_progs, E_P2: tl.constexpr, BLOCK: tl.constexpr):
    """In place: dw[e] = 0 for every group e without rows; groups with rows are not touched.

    Persistent: the blocks of all empty groups are shared by every program, so zeroing one empty
    expert uses the whole GPU (one program per (expert, slice) left a single empty expert to 8 SMs).
    offsets [3, 3, 3, 7] (E=4): empty = [0, 1, 1, 0], cum = [0, 1, 2, 2]; the j-th empty group is
    #(cum <= j): j=0 -> 1, j=1 -> 2."""
    pid = tl.program_id(0)
    eidx = tl.arange(0, E_P2)
    emask = eidx < E
    ends = tl.load(offs_ptr + eidx, mask=emask, other=0)
    starts = tl.load(offs_ptr + eidx - 1, mask=emask & (eidx > 0), other=0)
    empty = (emask & (ends <= starts)).to(tl.int32)
    cum = tl.cumsum(empty, 0)
    n_blocks = tl.cdiv(KN, BLOCK)
    zero = tl.zeros((BLOCK,), dtype=dw_ptr.dtype.element_ty)
    for w in range(pid, tl.sum(empty, 0) * n_blocks, num_progs):
        e = tl.sum((cum <= w // n_blocks).to(tl.int32), 0)
        i = (w % n_blocks) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dw_ptr + e.to(tl.int64) * s_e + i, zero, mask=i < KN)


# ------------------------------------------------------------------------------ route_permute
# Stable counting sort of n expert ids in two launches (cuda.route_permute's docstring has the
# contract): 1) each block of RP_BLOCK ids counts its keys (key = id, or E for an id outside [0, E));
# 2) each block finds where its keys go (all experts' totals before its key, plus the same key's
# counts in earlier blocks), sorts (key, index) pairs inside the block, which keeps equal keys in
# index order, and writes perm[dest] = i, inv[i] = dest. Block 0 also writes offsets. Against the torch
# path (stable radix sort, searchsorted, scatter: ~10 small launches the host issues one by one),
# Qwen3-30B-A3B 8 layers per block on an H200 (model_step --gaps, two rounds each in one call): GPU
# idle time 5.1 / 5.5 -> 3.7 / 3.5 ms per step. The kernel names contain "route_permute" so that
# model_step's split counts them as MoE.
RP_BLOCK = 1024


@triton.jit
def _rp_keys(ids_ptr, start, n, E, BLOCK: tl.constexpr):
    """The sort keys of ids[start : start + BLOCK]: the id, E for an id outside [0, E), E + 1 past n."""
    idx = start + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + idx, mask=idx < n, other=0)
    key = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
    return tl.where(idx < n, key, E + 1)  # E + 1: padding past n, counted nowhere


@lean
@triton.jit
def _route_permute_count_kernel(ids_ptr, counts_ptr, n, E, BINS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    key = _rp_keys(ids_ptr, b * BLOCK, n, E, BLOCK)
    tl.store(counts_ptr + b * BINS + tl.arange(0, BINS), tl.histogram(key, BINS))


@lean
@triton.jit
def _route_permute_place_kernel(ids_ptr, counts_ptr, perm_ptr, inv_ptr, offs_ptr, n, E, NB,
                                BINS: tl.constexpr, NB_P2: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    blocks = tl.arange(0, NB_P2)
    bins = tl.arange(0, BINS)
    counts = tl.load(counts_ptr + blocks[:, None] * BINS + bins[None, :], mask=(blocks < NB)[:, None], other=0)
    totals = tl.sum(counts, 0)                                    # [BINS] rows per key
    before_key = tl.cumsum(totals, 0) - totals                    # rows of smaller keys
    earlier = tl.sum(tl.where((blocks < b)[:, None], counts, 0), 0)  # same key, earlier blocks
    mine = tl.sum(tl.where((blocks == b)[:, None], counts, 0), 0)
    base = before_key + earlier - (tl.cumsum(mine, 0) - mine)     # minus this block's smaller keys
    key = _rp_keys(ids_ptr, b * BLOCK, n, E, BLOCK)
    local = tl.arange(0, BLOCK)
    pairs = tl.sort(key * BLOCK + local)                         # stable: equal keys keep index order
    skey = pairs // BLOCK
    dest = tl.gather(base, skey, 0) + local                     # position p in the block's sorted order
    src = b * BLOCK + pairs % BLOCK
    ok = skey <= E
    tl.store(perm_ptr + dest, src.to(tl.int64), mask=ok)
    tl.store(inv_ptr + src, dest.to(tl.int64), mask=ok)
    if b == 0:
        tl.store(offs_ptr + bins, (before_key + totals).to(tl.int32), mask=bins < E)


def _rp_grid(n: int, num_experts: int) -> tuple[int, int]:
    """(blocks, bins) for n ids: key counts are [blocks, bins], bins a power of two >= E + 2 keys."""
    return triton.cdiv(n, RP_BLOCK), triton.next_power_of_2(num_experts + 2)


def route_permute_counts(n: int, num_experts: int) -> int:
    """How many key counts the placement launch holds in registers for n ids over E experts."""
    blocks, bins = _rp_grid(n, num_experts)
    return triton.next_power_of_2(max(blocks, 1)) * bins


def route_permute(expert_ids: torch.Tensor, num_experts: int):
    """(perm, inv, offsets) as ``cuda.route_permute``; two launches, no host sync."""
    flat = expert_ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    n = flat.numel()
    if n == 0 or num_experts == 0:  # no expert: every id is dropped, in index order (as the reference)
        order = torch.arange(n, dtype=torch.long, device=flat.device)
        return order, order.clone(), torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    perm = torch.empty(n, dtype=torch.long, device=flat.device)
    inv = torch.empty(n, dtype=torch.long, device=flat.device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=flat.device)  # block 0 writes all E
    nb, bins = _rp_grid(n, num_experts)
    counts = torch.empty(nb, bins, dtype=torch.int32, device=flat.device)
    _route_permute_count_kernel[(nb,)](flat, counts, n, num_experts, BINS=bins, BLOCK=RP_BLOCK, num_warps=4)
    _route_permute_place_kernel[(nb,)](flat, counts, perm, inv, offsets, n, num_experts, nb, BINS=bins,
                                       NB_P2=triton.next_power_of_2(nb), BLOCK=RP_BLOCK, num_warps=4)
    return perm, inv, offsets


# ------------------------------------------------------------------------------------ wrappers
def permute_rows(x: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor, top_k: int) -> torch.Tensor:
    x = x if x.stride(1) == 1 else x.contiguous()
    perm, offsets = perm.contiguous(), offsets.contiguous()  # the kernels index them as flat arrays
    nr, h = perm.numel(), x.shape[1]
    xp = torch.empty(nr, h, dtype=x.dtype, device=x.device)
    if xp.numel() == 0:
        return xp
    # 16 rows x 256 columns per program for 16-bit rows: 89 vs 101 us (BR 4 x BH 1024) on Qwen3's gather,
    # 76 vs 79 GPT-OSS, 37 vs 38 DeepSeek-V3-like (H200, 3.4 of 4.27 TB/s copy); same bytes written
    bh = min(triton.next_power_of_2(h), 256 if x.element_size() <= 2 else 512)
    br = max(1, 4096 // bh)
    _permute_rows_kernel[(triton.cdiv(nr, br), triton.cdiv(h, bh))](
        x, perm, offsets, xp, x, nr, h, offsets.numel(), x.stride(0), TOP_K=top_k, HAS_W=False, BR=br, BH=bh,
        num_warps=4)
    return xp


def unpermute_combine(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                      out_dtype: torch.dtype | None = None):
    return _combine(y, inv, weights.contiguous(), offsets, *weights.shape, out_dtype or y.dtype)


def unpermute_sum(y: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor, top_k: int,
                  out_dtype: torch.dtype | None = None):
    return _combine(y, inv, None, offsets, y.shape[0] // top_k, top_k, out_dtype or y.dtype)


def _combine(y, inv, weights, offsets, t: int, k: int, out_dtype: torch.dtype):
    """The sum is fp32 whatever the dtypes (y's rows widened exactly on load), rounded once to out_dtype."""
    y = y if y.stride(1) == 1 else y.contiguous()
    inv, offsets = inv.contiguous(), offsets.contiguous()
    h = y.shape[1]
    out = torch.empty(t, h, dtype=out_dtype, device=y.device)
    if out.numel() == 0:
        return out
    # one token x 1024 columns per program: 80 vs 84 us (BT 4 x BH 512) on Qwen3, 65 vs 69 GPT-OSS, equal
    # on DeepSeek-V3-like (H200, 3.8 of 4.27 TB/s copy); the same sum in the same order per element
    bh = min(triton.next_power_of_2(h), 1024)
    bt = max(1, 1024 // bh)
    _combine_kernel[(triton.cdiv(t, bt), triton.cdiv(h, bh))](
        y, inv, weights if weights is not None else y, offsets, out, t, h, offsets.numel(), y.stride(0), TOP_K=k,
        HAS_W=weights is not None, BT=bt, BH=bh, num_warps=4)
    return out


def unpermute_combine_backward(dout, y, inv, weights, offsets):
    dout = dout if dout.stride(1) == 1 else dout.contiguous()
    y = y if y.stride(1) == 1 else y.contiguous()
    t, k = weights.shape
    nq, h = y.shape
    weights, inv, offsets = weights.contiguous(), inv.contiguous(), offsets.contiguous()
    dy = torch.empty(nq, h, dtype=y.dtype, device=y.device)
    dw = torch.empty(t, k, dtype=weights.dtype, device=y.device)
    if nq == 0:
        return dy, dw
    bh = min(triton.next_power_of_2(h), 256)
    bq = 16
    _combine_bwd_kernel[(triton.cdiv(nq, bq),)](
        dout, y, inv, weights, offsets, dy, dw, nq, h, offsets.numel(), dout.stride(0), y.stride(0),
        TOP_K=k, BQ=bq, BH=bh, num_warps=4)
    return dy, dw


def grouped_bias_grad(dy: torch.Tensor, offsets: torch.Tensor, num_experts: int) -> torch.Tensor:
    m, n = dy.shape
    dy = dy if dy.stride(1) == 1 else dy.contiguous()
    offsets = offsets.contiguous()
    db = torch.empty(num_experts, n, dtype=torch.float32, device=dy.device)
    if db.numel() == 0:
        return db
    bn = min(triton.next_power_of_2(n), 256)
    _bias_grad_kernel[(num_experts, triton.cdiv(n, bn))](dy, offsets, db, m, n, dy.stride(0), BM=32, BN=bn,
                                                         num_warps=4)
    return db


def rows_fixup(y: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """In place: zero rows past offsets[-1]; add bias[group] to the others (if bias)."""
    m, n = y.shape
    if y.numel() == 0:
        return y
    e = offsets.numel()
    if bias is not None:
        bias = bias.contiguous()
    br = 32
    bn = min(triton.next_power_of_2(n), 256)
    _rows_fixup_kernel[(triton.cdiv(m, br),)](
        y, offsets, bias if bias is not None else y, m, n, e, y.stride(0), bias.stride(0) if bias is not None else 0,
        HAS_BIAS=bias is not None, E_P2=triton.next_power_of_2(e), BR=br, BN=bn, num_warps=4)
    return y


def zero_empty_groups(dw: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """In place on [E, K, N] with contiguous [K, N] blocks: zero the experts that got no rows."""
    e, k, n = dw.shape
    if dw.numel() == 0:
        return dw
    progs = 4 * num_sms(dw.device)
    _zero_empty_groups_kernel[(progs,)](dw, offsets, e, k * n, dw.stride(0), progs, E_P2=triton.next_power_of_2(e),
                                        BLOCK=4096, num_warps=4)
    return dw


# --------------------------------------------------------------------------------- router top-k
_INT64_MIN = tl.constexpr(-(2 ** 63))


@lean
@triton.jit
def _router_topk_kernel(x_ptr, val_ptr, idx_ptr, R, E, sx, K: tl.constexpr, E_P2: tl.constexpr,
                        BR: tl.constexpr):
    """Rows [BR] x columns [E_P2] of scores; each entry becomes one int64 key that orders like the
    value, ties to the lower column: (order-preserving int32 of the fp32 bits) << 32 | (E_P2-1-col).
    The int32 is the bit order torch.topk's CUDA radix select ranks by: every NaN above +inf (one
    canonical NaN), -0 just below +0. K rounds of "take the row maximum, then retire it" write the
    top K in descending order."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, E_P2)
    rmask = rows < R
    mask = rmask[:, None] & (cols < E)[None, :]
    rbase = rows.to(tl.int64) * sx
    x = tl.load(x_ptr + rbase[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    bits = tl.where(x != x, 0x7FC00000, x.to(tl.int32, bitcast=True))  # every NaN as the canonical one
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
    comp = (key.to(tl.int64) << 32) | (E_P2 - 1 - cols).to(tl.int64)[None, :]
    comp = tl.where(mask, comp, _INT64_MIN)
    for j in range(K):
        best = tl.max(comp, axis=1)
        col = (E_P2 - 1) - (best & 0xFFFFFFFF).to(tl.int32)
        v = tl.load(x_ptr + rbase + col, mask=rmask)
        tl.store(val_ptr + rows.to(tl.int64) * K + j, v, mask=rmask)
        tl.store(idx_ptr + rows.to(tl.int64) * K + j, col.to(tl.int64), mask=rmask)
        comp = tl.where(comp == best[:, None], _INT64_MIN, comp)


ROUTER_TOPK_MAX_E = 1024   # columns one program holds as int64 keys (register budget)
ROUTER_TOPK_MAX_K = 64     # K rounds of a row max each: past this a sort is cheaper


def router_topk_supported(scores: torch.Tensor, k: int) -> bool:
    return scores.shape[-1] <= ROUTER_TOPK_MAX_E and k <= ROUTER_TOPK_MAX_K and scores.dtype in (
        torch.float32, torch.bfloat16, torch.float16)


def router_topk(scores: torch.Tensor, k: int):
    """(values, indices) as torch.topk(scores, k, dim=-1); needs ``router_topk_supported``."""
    e = scores.shape[-1]
    x = scores.reshape(-1, e)
    x = x if x.stride(-1) == 1 else x.contiguous()
    r = x.shape[0]
    values = torch.empty(r, k, dtype=scores.dtype, device=scores.device)
    indices = torch.empty(r, k, dtype=torch.long, device=scores.device)
    if r:
        e_p2 = triton.next_power_of_2(e)
        br = max(1, min(64, 2048 // e_p2))
        _router_topk_kernel[(triton.cdiv(r, br),)](x, values, indices, r, e, x.stride(0), K=k, E_P2=e_p2, BR=br,
                                                  num_warps=4)
    shape = (*scores.shape[:-1], k)
    return values.view(shape), indices.view(shape)
