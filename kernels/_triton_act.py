"""Triton kernels of the expert activation (imported only by ``cuda.py``): SwiGLU and its backward,
plain or with each permuted row's routing weight (``weighted_swiglu``). fp32 math, one rounding per
output; rows past ``offsets[E-1]`` (dropped) get weight 0, and the weighted kernels write them as 0
without reading them; static grids (CUDA-graph safe); the
weight's gradient sums each row's columns in order in fp32 (deterministic, no atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import lean  # @lean kernels: a cached compiled kernel launched directly (less host work per call)


# ----------------------------------------------------------------------------------- swiglu
@triton.jit
def silu_mul(g, u):
    """silu(g) * u, in the precision of g and u (fp32 here)."""
    return g * tl.sigmoid(g) * u


@triton.jit
def swiglu_grads(g, u, d):
    """(dL/dg, dL/du) of d-weighted silu(g) * u: (d * u * silu'(g), d * silu(g)), silu'(g) = s + g s (1 - s)."""
    s = tl.sigmoid(g)
    return d * u * (s + g * s * (1.0 - s)), d * g * s


@lean
@triton.jit
def _swiglu_kernel(h_ptr, a_ptr, w_ptr, perm_ptr, offs_ptr, M, N, E, sh, sa,
                   HAS_W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """a[r, c] = silu(h[r, c]) * h[r, N + c], fp32 math, one rounding; with HAS_W times the row's
    routing weight w[perm[r]] (0 for dropped rows r >= offsets[E-1])."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < M
    mask = rmask[:, None] & (cols < N)[None, :]
    load = mask
    if HAS_W:   # a dropped row's output is 0 whatever h holds: its h is not read (the padded receive
        # rows of expert parallelism, ep·T·k rows for T·k routed ones, are most of the bytes otherwise)
        q, keep = _row_pairs(perm_ptr, offs_ptr, rows, rmask, E)
        load = keep[:, None] & (cols < N)[None, :]
    base = h_ptr + rows.to(tl.int64)[:, None] * sh + cols[None, :]
    g = tl.load(base, mask=load, other=0.0).to(tl.float32)
    u = tl.load(base + N, mask=load, other=0.0).to(tl.float32)
    a = silu_mul(g, u)
    if HAS_W:
        a = a * tl.load(w_ptr + q, mask=keep, other=0.0).to(tl.float32)[:, None]
    tl.store(a_ptr + rows.to(tl.int64)[:, None] * sa + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_pairs(perm_ptr, offs_ptr, rows, rmask, E):
    """(q, keep) [BM]: each row's (token, slot) pair perm[r] (0 where masked), and whether the row is
    inside a group (r < offsets[E-1]; a dropped row's weight is 0)."""
    keep = rmask & (rows < tl.load(offs_ptr + E - 1))
    return tl.load(perm_ptr + rows, mask=rmask, other=0), keep


@lean
@triton.jit
def _swiglu_bwd_kernel(h_ptr, da_ptr, dh_ptr, M, N, sh, sda, sdh, BM: tl.constexpr, BN: tl.constexpr):
    """dh[r, c] = da * u * silu'(g), dh[r, N + c] = da * silu(g): h and da read once, dh written once."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    hb = h_ptr + r64 * sh + cols[None, :]
    g = tl.load(hb, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(hb + N, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(da_ptr + r64 * sda + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dg, du = swiglu_grads(g, u, d)
    ob = dh_ptr + r64 * sdh + cols[None, :]
    tl.store(ob, dg.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(ob + N, du.to(dh_ptr.dtype.element_ty), mask=mask)


@lean
@triton.jit
def _weighted_swiglu_bwd_kernel(h_ptr, da_ptr, w_ptr, perm_ptr, offs_ptr, dh_ptr, dw_ptr, M, N, E, sh, sda, sdh,
                                BM: tl.constexpr, BN: tl.constexpr):
    """BM rows per program, their columns in BN chunks: dh = swiglu grads of w_r * da, and
    dw[perm[r]] = <da[r], silu(g) u> (fp32, columns in order; 0 for dropped rows)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    q, keep = _row_pairs(perm_ptr, offs_ptr, rows, rmask, E)
    w = tl.load(w_ptr + q, mask=keep, other=0.0).to(tl.float32)
    r64 = rows.to(tl.int64)[:, None]
    acc = tl.zeros((BM,), dtype=tl.float32)
    for c0 in range(0, N, BN):
        cols = c0 + tl.arange(0, BN)
        mask = rmask[:, None] & (cols < N)[None, :]
        load = keep[:, None] & (cols < N)[None, :]   # dropped rows: dh = 0 and dw = 0, h and da not read
        hb = h_ptr + r64 * sh + cols[None, :]
        g = tl.load(hb, mask=load, other=0.0).to(tl.float32)
        u = tl.load(hb + N, mask=load, other=0.0).to(tl.float32)
        d = tl.load(da_ptr + r64 * sda + cols[None, :], mask=load, other=0.0).to(tl.float32)
        acc += tl.sum(d * silu_mul(g, u), axis=1)
        dg, du = swiglu_grads(g, u, d * w[:, None])
        ob = dh_ptr + r64 * sdh + cols[None, :]
        tl.store(ob, dg.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(ob + N, du.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + q, tl.where(keep, acc, 0.0).to(dw_ptr.dtype.element_ty), mask=rmask)


def _swiglu_grid(m: int, n: int):
    bn = min(256, triton.next_power_of_2(max(n, 16)))
    bm = max(1, 4096 // bn)
    return bm, bn, (triton.cdiv(m, bm), triton.cdiv(n, bn))


def swiglu(h: torch.Tensor) -> torch.Tensor:
    h = h if h.stride(-1) == 1 else h.contiguous()
    m, n = h.shape[0], h.shape[1] // 2
    a = torch.empty(m, n, dtype=h.dtype, device=h.device)
    if a.numel():
        bm, bn, grid = _swiglu_grid(m, n)
        _swiglu_kernel[grid](h, a, h, h, h, m, n, 1, h.stride(0), a.stride(0), HAS_W=False, BM=bm, BN=bn,
                             num_warps=4)
    return a


def weighted_swiglu(h: torch.Tensor, weights: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor):
    h = h if h.stride(-1) == 1 else h.contiguous()
    weights, perm, offsets = weights.contiguous(), perm.contiguous(), offsets.contiguous()
    m, n = h.shape[0], h.shape[1] // 2
    a = torch.empty(m, n, dtype=h.dtype, device=h.device)
    if a.numel():
        bm, bn, grid = _swiglu_grid(m, n)
        _swiglu_kernel[grid](h, a, weights, perm, offsets, m, n, offsets.numel(), h.stride(0), a.stride(0),
                             HAS_W=True, BM=bm, BN=bn, num_warps=4)
    return a


def weighted_swiglu_backward(h, weights, perm, offsets, da):
    h = h if h.stride(-1) == 1 else h.contiguous()
    da = da if da.stride(-1) == 1 else da.contiguous()
    weights, perm, offsets = weights.contiguous(), perm.contiguous(), offsets.contiguous()
    m, n = h.shape[0], h.shape[1] // 2
    dh = torch.empty(m, 2 * n, dtype=h.dtype, device=h.device)
    dw = torch.empty(weights.shape, dtype=weights.dtype, device=weights.device)
    if m:
        # BM rows x BN columns per step, the row's columns in turn (the weight's gradient sums them);
        # 32 x 128: H200, 199 / 167 / 622 us on DeepSeek-V3-like / Qwen3 / Mixtral widths against 208 /
        # 170 / 625 for 16 x 256 (the plain backward's tile) and 208 / 183 / 617 for the plain backward
        bn = min(128, triton.next_power_of_2(max(n, 16)))
        bm = max(1, 4096 // bn)
        _weighted_swiglu_bwd_kernel[(triton.cdiv(m, bm),)](
            h, da, weights, perm, offsets, dh, dw, m, n, offsets.numel(), h.stride(0), da.stride(0), dh.stride(0),
            BM=bm, BN=bn, num_warps=4)
    return dh, dw


def swiglu_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    h = h if h.stride(-1) == 1 else h.contiguous()
    da = da if da.stride(-1) == 1 else da.contiguous()
    m, n = h.shape[0], h.shape[1] // 2
    dh = torch.empty(m, 2 * n, dtype=h.dtype, device=h.device)
    if dh.numel():
        bm, bn, grid = _swiglu_grid(m, n)
        _swiglu_bwd_kernel[grid](h, da, dh, m, n, h.stride(0), da.stride(0), dh.stride(0), BM=bm, BN=bn, num_warps=4)
    return dh
