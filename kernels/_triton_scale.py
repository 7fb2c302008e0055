"""Triton kernels of ``permute_scale``: the gather times each row's weight (imported only by ``cuda.py``).

The forward is ``_triton_moe``'s gather kernel with its weight load on (``HAS_W``); the backward reads
the row gradients once per token: dx[t] = sum_j w[t, j] * dxp[inv[t*K + j]] and dw[t, j] =
<dxp[inv[t*K + j]], x[t]> (fp32, j in order; 0 for dropped pairs), no [T*K, H] copy of the rows kept.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import lean
from ._triton_moe import _permute_rows_kernel


@lean
@triton.jit
def _scale_bwd_kernel(dxp_ptr, x_ptr, inv_ptr, w_ptr, offs_ptr, dx_ptr, dw_ptr, T, H, E, sgm, sxm,
                      TOP_K: tl.constexpr, K_P2: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """permute_scale's backward, BT tokens per program, over H in BH columns: dx[t] = sum_j w[t, j] *
    dxp[inv[t*K + j]] and dw[t, j] = <dxp[inv[t*K + j]], x[t]> (fp32, j in order; 0 for dropped pairs).
    dxp is read once."""
    total = tl.load(offs_ptr + E - 1)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    slots = tl.arange(0, K_P2)
    dw = tl.zeros((BT, K_P2), dtype=tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        cmask = cols < H
        xv = tl.load(x_ptr + t64[:, None] * sxm + cols[None, :], mask=tmask[:, None] & cmask[None, :],
                     other=0.0).to(tl.float32)
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            p = tl.load(inv_ptr + t * TOP_K + j, mask=tmask, other=0)
            keep = tmask & (p < total)
            g = tl.load(dxp_ptr + p.to(tl.int64)[:, None] * sgm + cols[None, :], mask=keep[:, None] & cmask[None, :],
                        other=0.0).to(tl.float32)
            wj = tl.load(w_ptr + t * TOP_K + j, mask=keep, other=0.0).to(tl.float32)
            acc += wj[:, None] * g
            # a dropped pair's dw is 0 even where x is inf / NaN (its g is 0: inf * 0 = NaN otherwise)
            dw += tl.where((slots[None, :] == j) & keep[:, None], tl.sum(g * xv, axis=1)[:, None], 0.0)
        tl.store(dx_ptr + t64[:, None] * H + cols[None, :], acc.to(dx_ptr.dtype.element_ty),
                 mask=tmask[:, None] & cmask[None, :])
    tl.store(dw_ptr + t64[:, None] * TOP_K + slots[None, :], dw.to(dw_ptr.dtype.element_ty),
             mask=tmask[:, None] & (slots[None, :] < TOP_K))


def permute_scale(x: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """_triton_moe's gather with each row times its pair's weight (fp32 product, rounded once)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    perm, offsets, weights = perm.contiguous(), offsets.contiguous(), weights.contiguous()
    nr, h = perm.numel(), x.shape[1]
    xp = torch.empty(nr, h, dtype=out_dtype, device=x.device)
    if xp.numel() == 0:
        return xp
    bh = min(triton.next_power_of_2(h), 256 if x.element_size() <= 2 else 512)
    br = max(1, 4096 // bh)
    _permute_rows_kernel[(triton.cdiv(nr, br), triton.cdiv(h, bh))](
        x, perm, offsets, xp, weights, nr, h, offsets.numel(), x.stride(0), TOP_K=weights.shape[1], HAS_W=True,
        BR=br, BH=bh, num_warps=4)
    return xp


def permute_scale_backward(dxp, x, inv, weights, offsets):
    dxp = dxp if dxp.stride(1) == 1 else dxp.contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    inv, weights, offsets = inv.contiguous(), weights.contiguous(), offsets.contiguous()
    (t, k), h = weights.shape, x.shape[1]
    dx = torch.empty(t, h, dtype=x.dtype, device=x.device)
    dw = torch.empty(t, k, dtype=weights.dtype, device=x.device)
    if t == 0:
        return dx, dw
    if h == 0:
        return dx, dw.zero_()
    bh = min(triton.next_power_of_2(h), 256)
    bt = 8
    _scale_bwd_kernel[(triton.cdiv(t, bt),)](
        dxp, x, inv, weights, offsets, dx, dw, t, h, offsets.numel(), dxp.stride(0), x.stride(0),
        TOP_K=k, K_P2=triton.next_power_of_2(k), BT=bt, BH=bh, num_warps=4)
    return dx, dw
