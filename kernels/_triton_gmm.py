"""Triton grouped GEMMs (imported only by ``cuda.py``; never on CPU CI).

Legend: M routed rows (sorted by expert), K contraction, N output columns, E experts (groups).
``offsets[e]`` is the int32 cumulative end row of group e; group e owns rows
[offsets[e-1], offsets[e]); rows past offsets[-1] belong to no group.

Tile schedule (sync-free, computed on the device inside every program)::

    offsets = [3, 3, 300]        (E=3, BM=128, N=200, BN=128 -> 2 n-tiles)
    counts  = [3, 0, 297]        m_tiles = [1, 0, 3]   tiles = [2, 0, 6]   cumsum = [2, 2, 8]
    tile 5 -> group e = #(cumsum <= 5) = 2, local tile 5 - 2 = 3 -> (m-tile 1, n-tile 1) after the
    GROUP_M swizzle -> rows 3+128 .. 3+255 of x times columns 128..199 of w[2].

The grid is persistent (at most a few programs per SM), each walks tiles pid, pid+P, ... up to the
total computed from ``offsets``: no host sync, static launch shape, CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def group_tiles(offs_ptr, M, N, E, E_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Per-group row ranges and tile counts from ``offsets`` (module docstring's worked example):
    (eidx, starts, counts, m_tiles, g_tiles, g_end, total)."""
    eidx = tl.arange(0, E_P2)
    emask = eidx < E
    ends = tl.minimum(tl.load(offs_ptr + eidx, mask=emask, other=0), M)
    starts = tl.minimum(tl.load(offs_ptr + eidx - 1, mask=emask & (eidx > 0), other=0), M)
    counts = tl.where(emask, tl.maximum(ends - starts, 0), 0)
    m_tiles = (counts + BM - 1) // BM
    g_tiles = m_tiles * tl.cdiv(N, BN)
    g_end = tl.cumsum(g_tiles, 0)
    return eidx, starts, counts, m_tiles, g_tiles, g_end, tl.sum(g_tiles, 0)


@triton.jit
def tile_coords(tile, eidx, starts, counts, m_tiles, g_tiles, g_end, N, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Global tile index -> (group e, its first row, its end row, m-tile, n-tile), GROUP_M swizzle
    inside the group."""
    n_tiles = tl.cdiv(N, BN)
    e = tl.sum((g_end <= tile).to(tl.int32), 0)
    sel = eidx == e
    g_first = tl.sum(tl.where(sel, g_end - g_tiles, 0), 0)
    mt_e = tl.sum(tl.where(sel, m_tiles, 0), 0)
    row_start = tl.sum(tl.where(sel, starts, 0), 0)
    row_end = tl.sum(tl.where(sel, starts + counts, 0), 0)
    local = tile - g_first
    width = GROUP_M * n_tiles
    first_m = (local // width) * GROUP_M
    gsz = tl.minimum(mt_e - first_m, GROUP_M)
    return e, row_start, row_end, first_m + (local % width) % gsz, (local % width) // gsz


@triton.jit
def _gmm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, offs_ptr, idx_ptr, wtab_ptr,
                M, N, K, E,
                sxm, sxk, swe, swk, swn, sbe, sym,
                TOP_K: tl.constexpr, HAS_GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, W_TABLE: tl.constexpr,
                E_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr, IS_FP32: tl.constexpr,
                PRECISION: tl.constexpr):
    """y[rows of e] = x[rows of e] @ w[e] (+ b[e]); with HAS_GATHER, row r of the A operand is
    x[idx[r] // TOP_K] (the permutation fused into the load); with W_TABLE, w[e] starts at the
    element offset wtab[e] from w_ptr (per-expert tensors read in place, e.g. ModuleList weights)."""
    pid = tl.program_id(0)
    eidx, starts, counts, m_tiles, g_tiles, g_end, total = group_tiles(offs_ptr, M, N, E, E_P2, BM, BN)
    for tile in range(pid, total, NUM_PROGS):
        e, row_start, row_end, pid_m, pid_n = tile_coords(tile, eidx, starts, counts, m_tiles, g_tiles, g_end,
                                                          N, BN, GROUP_M)
        rows = row_start + pid_m * BM + tl.arange(0, BM)
        rmask = rows < row_end
        cols = pid_n * BN + tl.arange(0, BN)
        cmask = cols < N
        if HAS_GATHER:
            src = tl.load(idx_ptr + rows, mask=rmask, other=0) // TOP_K
        else:
            src = rows
        # offsets in int64 (k * stride passes 2^31 elements for a column-major x or an N-strided w)
        ks = tl.arange(0, BK).to(tl.int64)
        a_rows = x_ptr + src.to(tl.int64)[:, None] * sxm
        if W_TABLE:  # element offset of expert e from w_ptr, 16-byte aligned (checked on the host)
            w_base = w_ptr + tl.multiple_of(tl.load(wtab_ptr + e), 8)
        else:
            w_base = w_ptr + e.to(tl.int64) * swe
        b_cols = w_base + cols.to(tl.int64)[None, :] * swn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + ks
            kmask = kk < K
            a = tl.load(a_rows + kk[None, :] * sxk, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_cols + kk[:, None] * swk, mask=kmask[:, None] & cmask[None, :], other=0.0)
            if IS_FP32:
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            bias = tl.load(b_ptr + e.to(tl.int64) * sbe + cols, mask=cmask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * sym + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _wgrad_kernel(x_ptr, dy_ptr, dw_ptr, offs_ptr, M, K, N,
                  sxm, sxk, sym, syn,
                  BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                  IS_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """dw[e, k-tile, n-tile] = x[rows of e, k-tile]^T @ dy[rows of e, n-tile]; empty groups get 0."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BK)
    n_tiles = tl.cdiv(N, BN)
    e = pid // (k_tiles * n_tiles)
    rem = pid % (k_tiles * n_tiles)
    ks = ((rem // n_tiles) * BK + tl.arange(0, BK)).to(tl.int64)  # int64 products: a column-major x or dy
    ns = ((rem % n_tiles) * BN + tl.arange(0, BN)).to(tl.int64)   # may pass 2^31 elements
    kmask = ks < K
    nmask = ns < N
    end = tl.minimum(tl.load(offs_ptr + e), M)
    start = tl.minimum(tl.load(offs_ptr + e - 1, mask=e > 0, other=0), end)
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    rs = tl.arange(0, BM)
    for r0 in range(start, end, BM):
        rows = r0 + rs
        rmask = rows < end
        r64 = rows.to(tl.int64)
        a = tl.load(x_ptr + r64[None, :] * sxm + ks[:, None] * sxk, mask=kmask[:, None] & rmask[None, :], other=0.0)
        b = tl.load(dy_ptr + r64[:, None] * sym + ns[None, :] * syn, mask=rmask[:, None] & nmask[None, :], other=0.0)
        if IS_FP32:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, b, acc)
    out = dw_ptr + e.to(tl.int64) * K * N + ks[:, None] * N + ns[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=kmask[:, None] & nmask[None, :])


_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter (TRITON_INTERPRET=1) on CPU tensors
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _precision() -> str:
    # torch semantics: "highest" means true fp32 matmuls; tf32x3 (3 tf32 products) is within fp32
    # rounding for these sizes at a third of tf32's speed, far faster than Triton's FMA "ieee".
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


CONFIG_OVERRIDE: dict | None = None  # set by the micro-benchmark to sweep tile configs


def _gmm_config(dtype: torch.dtype, m: int, n: int, k: int):
    if CONFIG_OVERRIDE is not None and dtype != torch.float32:
        return dict(CONFIG_OVERRIDE)
    if dtype == torch.float32:
        # tf32x3 on an H200, Qwen3-30B-A3B shapes (M 65536, E 128): 63-66 TFLOP/s with the weight
        # K-major (forward), 44 with it N-major (data gradient: tf32 wgmma wants K-major B); 4 stages
        # 1-2% over 3; 128x128 / 64x128 / 128x256 tiles no better forward, 30-50% slower backward
        return dict(BM=64 if m <= 64 else 128, BN=64, BK=32, GROUP_M=8, num_warps=4, num_stages=4)
    # 128x256x64, 8 warps, 3 stages: 472 TFLOP/s on the Qwen3-30B-A3B up projection (H200),
    # vs 371 for 128x128x64 and 438 for 64x256x64 (moe_layer.py --micro)
    return dict(BM=64 if m <= 64 else 128, BN=256 if n >= 256 else (128 if n > 64 else 64), BK=64, GROUP_M=8,
                num_warps=8, num_stages=3)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None = None,
               gather_idx: torch.Tensor | None = None, top_k: int = 1, out: torch.Tensor | None = None,
               num_rows: int | None = None, w_table: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] = per-group x @ w[e] (+ bias[e]); rows past offsets[-1] are NOT written here.

    With ``gather_idx`` (the route permutation), A row r is x[gather_idx[r] // top_k] and M is
    ``num_rows`` (= gather_idx.numel()): the gather fused into the A-load, kept for
    ``examples/benchmark/fusion_ab.py`` (21-28% slower on an H200 than permute_rows plus the TMA
    kernel, and in training the weight gradient needs the gathered rows anyway). With ``w_table``
    (int64 [E] element offsets, multiples of 8; device memory or pinned host memory, which the
    kernel reads through unified addressing), ``w`` is expert 0's [K, N] weight giving dtype and
    strides, and expert e starts at ``w.data_ptr() + w_table[e] * w.element_size()``.
    """
    m = num_rows if num_rows is not None else x.shape[0]
    if w_table is not None:
        k, n, e = x.shape[1], w.shape[1], w_table.numel()
        w = w.unsqueeze(0)
    else:
        k, n, e = x.shape[1], w.shape[2], w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = _gmm_config(x.dtype, m, n, k)
    bm, bn = cfg["BM"], cfg["BN"]
    upper = (triton.cdiv(m, bm) + e) * triton.cdiv(n, bn)
    progs = max(1, min(upper, 2 * num_sms(x.device)))
    if bias is not None:
        bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    _gmm_kernel[(progs,)](
        x, w, bias if bias is not None else x, out, offsets, gather_idx if gather_idx is not None else offsets,
        w_table if w_table is not None else offsets,
        m, n, k, e,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        TOP_K=top_k, HAS_GATHER=gather_idx is not None, HAS_BIAS=bias is not None, W_TABLE=w_table is not None,
        E_P2=triton.next_power_of_2(e), NUM_PROGS=progs, IS_FP32=x.dtype == torch.float32,
        PRECISION=_precision(), **cfg)
    return out


def grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, num_experts: int,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[E, K, N] with dw[e] = x[rows e]^T @ dy[rows e]; every element written (0 for empty e)."""
    m, k = x.shape
    n = dy.shape[1]
    dw = torch.empty(num_experts, k, n, dtype=out_dtype, device=x.device)
    if dw.numel() == 0:
        return dw
    fp32 = x.dtype == torch.float32
    # fp32 (tf32x3), H200, Qwen3-30B-A3B shapes: BK 128 x BN 64 over 32-row steps, 4 stages, 55 TFLOP/s
    # vs 36 for 64 x 64 x 32 with 3 stages (the weight gradient was 69 ms of an autocast Qwen3 step
    # of 4 layers); 128 x 128, 256 x 64 with 8 warps, 16- or 64-row steps: 33-55
    bk, bn = (128, 64) if fp32 else (128, 128)
    bm = 32 if fp32 else 64
    grid = (num_experts * triton.cdiv(k, bk) * triton.cdiv(n, bn),)
    _wgrad_kernel[grid](x, dy, dw, offsets, m, k, n, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
                        BM=bm, BK=bk, BN=bn, IS_FP32=fp32, PRECISION=_precision(),
                        num_warps=4 if fp32 else 8, num_stages=4 if fp32 else 3)
    return dw
