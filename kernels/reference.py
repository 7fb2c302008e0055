"""Pure-torch reference implementations of every moe_compile op.

These are the ground truth the fused kernels are tested against, and the implementation used on
CPU (and on CUDA until a faster kernel is registered). They may synchronise with the host (they
loop over experts with Python ints); the custom ops that wrap them have static output shapes, so
the *graph* never sees a data-dependent size.

Legend (shape suffixes): T tokens, K top-k slots, N = T*K routed rows, E experts,
H/D model width, I/F expert width.

Worked example (T=3, K=2, E=4)::

    expert_ids = [[1, 3], [0, 1], [3, 1]]          flat = [1, 3, 0, 1, 3, 1]
    perm       = [2, 0, 3, 5, 1, 4]                 (stable sort of flat by expert)
    counts     = [1, 3, 0, 2]  ->  offsets = [1, 4, 4, 6]   (int32, cumulative ends)
    inv        = [1, 4, 0, 2, 5, 3]                 (inv[perm[p]] = p)

Row p of the permuted matrix holds token perm[p] // K; group e owns rows
[offsets[e-1], offsets[e]). Ids outside [0, E) sort last and fall outside every group: they are
"dropped" and contribute nothing (the hook expert parallelism will use).
"""
from __future__ import annotations

import torch


def route_permute(expert_ids: torch.Tensor, num_experts: int):
    """(perm [N] int64, inv [N] int64, offsets [E] int32) for expert_ids [T, K] (or [N])."""
    flat = expert_ids.reshape(-1).long()
    n = flat.numel()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    _, perm = torch.sort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n, device=flat.device)
    return perm, inv, offsets


def _bounds(offsets: torch.Tensor):
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def valid_rows(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Boolean [n]: row p lies inside some group (p < offsets[-1])."""
    total = offsets[-1].long() if offsets.numel() else torch.zeros((), dtype=torch.long, device=offsets.device)
    return torch.arange(n, device=offsets.device) < total


def _kept_pairs(inv: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Boolean [N]: pair q's row inv[q] lies inside some group. A dropped pair (an id no expert of the layer
    has) is never read in eager: its terms are selected away (``where``), not multiplied by 0, which would
    turn an inf or NaN weight, row or gradient into NaN in its token's row (review helper-104)."""
    return inv < (offsets[-1].long() if offsets.numel() else 0)


def permute_rows(x: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor, top_k: int) -> torch.Tensor:
    """xp[p] = x[perm[p] // top_k] for rows inside a group, 0 for dropped rows."""
    xp = x.index_select(0, perm // top_k)
    return torch.where(valid_rows(offsets, perm.numel()).unsqueeze(-1), xp, 0)   # not `* valid`: NaN * 0 is NaN


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None = None):
    """out[rows of group e] = x[rows] @ w[e] (+ bias[e]); x [M, K], w [E, K, N]; rows past the
    last group are 0. Accumulates in fp32."""
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=x.dtype, device=x.device)
    ct = torch.promote_types(x.dtype, torch.float32)
    for e, (s, t) in enumerate(_bounds(offsets)):
        if t > s:
            acc = x[s:t].to(ct) @ w[e].to(ct)
            if bias is not None:
                acc = acc + bias[e].to(ct)
            out[s:t] = acc.to(x.dtype)
    return out


def grouped_mm_list(x: torch.Tensor, ws: list[torch.Tensor], offsets: torch.Tensor,
                    biases: list[torch.Tensor]) -> torch.Tensor:
    """grouped_mm with per-expert weight tensors ws[e] [K, N] (e.g. ModuleList weights, viewed
    transposed): each expert's weight is read in place, never stacked into a copy."""
    out = torch.zeros(x.shape[0], ws[0].shape[-1], dtype=x.dtype, device=x.device)
    ct = torch.promote_types(x.dtype, torch.float32)
    for e, (s, t) in enumerate(_bounds(offsets)):
        if t > s:
            acc = x[s:t].to(ct) @ ws[e].to(ct)
            if biases:
                acc = acc + biases[e].to(ct)
            out[s:t] = acc.to(x.dtype)
    return out


def grouped_mm_cat(x: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[x @ wa[e] | x @ wb[e]] per group -> [M, Na + Nb]: two grouped_mm side by side (each column
    half rounded as its own product)."""
    return torch.cat([grouped_mm(x, wa, offsets), grouped_mm(x, wb, offsets)], dim=1)


def grouped_mm_cat_dx(dy: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dy[:, :Na] @ wa[e]^T + dy[:, Na:] @ wb[e]^T per group -> [M, K], one fp32 sum rounded once
    (wa, wb [E, K, N*] as grouped_mm_cat takes them)."""
    return grouped_mm(dy, torch.cat([wa, wb], dim=2).transpose(1, 2), offsets)


def grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, num_experts: int):
    """dw[e] = x[rows e].T @ dy[rows e] -> [E, K, N] (zeros for empty groups)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    dw = torch.zeros(num_experts, x.shape[1], dy.shape[1], dtype=ct, device=x.device)
    for e, (s, t) in enumerate(_bounds(offsets)):
        if t > s:
            dw[e] = x[s:t].to(ct).t() @ dy[s:t].to(ct)
    return dw


def grouped_mm_wgrad_lowp(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, num_experts: int):
    """grouped_mm_wgrad rounded once to x.dtype."""
    return grouped_mm_wgrad(x, dy, offsets, num_experts).to(x.dtype)


def grouped_bias_grad(dy: torch.Tensor, offsets: torch.Tensor, num_experts: int):
    """db[e] = sum of dy over the rows of group e -> [E, N] (fp32; fp64 for fp64)."""
    ct = torch.promote_types(dy.dtype, torch.float32)
    db = torch.zeros(num_experts, dy.shape[1], dtype=ct, device=dy.device)
    for e, (s, t) in enumerate(_bounds(offsets)):
        if t > s:
            db[e] = dy[s:t].to(ct).sum(0)
    return db


def unpermute_combine(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                      out_dtype: torch.dtype | None = None):
    """out[t] = sum_j weights[t, j] * y[inv[t*K + j]] over rows inside a group; fp32 accumulation,
    deterministic (a gather-reduce, no atomics). y [N, H], weights [T, K] -> out [T, H] (out_dtype,
    default y.dtype)."""
    t, k = weights.shape
    ct = torch.promote_types(out_dtype or y.dtype, torch.float32)  # fp64 for fp64
    keep = _kept_pairs(inv, offsets)
    rows = y.to(ct).index_select(0, inv)  # [N, H]
    rows = torch.where(keep.unsqueeze(-1), rows * weights.to(ct).reshape(-1, 1), 0)
    return rows.view(t, k, y.shape[1]).sum(1).to(out_dtype or y.dtype)  # T may be 0


def unpermute_combine_backward(dout, y, inv, weights, offsets):
    """Gradients of unpermute_combine: (dy [N, H], dweights [T, K])."""
    t, k = weights.shape
    ct = torch.promote_types(dout.dtype, torch.float32)  # fp64 for fp64
    keep = _kept_pairs(inv, offsets)
    dout_rows = dout.to(ct).repeat_interleave(k, dim=0)  # [N, H], row q = token q // K
    dy = torch.zeros(y.shape, dtype=ct, device=y.device)
    dy.index_copy_(0, inv, torch.where(keep.unsqueeze(-1), dout_rows * weights.to(ct).reshape(-1, 1), 0))
    dw = torch.where(keep, (dout_rows * y.to(ct).index_select(0, inv)).sum(-1), 0)
    return dy.to(y.dtype), dw.view(t, k).to(weights.dtype)


def _scale_dtype(*tensors) -> torch.dtype:
    """The dtype permute_scale multiplies in: the operands' promoted dtype, at least fp32."""
    ct = torch.float32
    for t in tensors:
        ct = torch.promote_types(ct, t.dtype)
    return ct


def permute_scale(x, perm, offsets, weights, out_dtype):
    """xp[p] = (x[perm[p] // K] * weights.flat[perm[p]]).to(out_dtype), 0 for dropped rows."""
    ct = _scale_dtype(x, weights)
    rows = x.to(ct).index_select(0, perm // weights.shape[1]) * _row_weights(weights, perm, offsets, ct)
    return torch.where(valid_rows(offsets, perm.numel()).unsqueeze(-1), rows, 0).to(out_dtype)


def permute_scale_backward(dxp, x, inv, weights, offsets):
    """Gradients of permute_scale: (dx [T, H], dweights [T, K]), fp32 sums (fp64 for fp64)."""
    t, k = weights.shape
    ct = _scale_dtype(dxp, x, weights)
    keep = _kept_pairs(inv, offsets)
    g = dxp.to(ct).index_select(0, inv)   # [N, H], row q = pair q (token q // K)
    dx = torch.where(keep.unsqueeze(-1), g * weights.to(ct).reshape(-1, 1), 0).view(t, k, x.shape[1]).sum(1)
    dw = torch.where(keep, (g * x.to(ct).repeat_interleave(k, dim=0)).sum(-1), 0)
    return dx.to(x.dtype), dw.view(t, k).to(weights.dtype)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """a = silu(h[:, :N]) * h[:, N:] for h [M, 2N], computed in fp32 (fp64 for fp64), rounded once."""
    n = h.shape[-1] // 2
    ct = torch.promote_types(h.dtype, torch.float32)
    g, u = h[:, :n].to(ct), h[:, n:].to(ct)
    return (torch.nn.functional.silu(g) * u).to(h.dtype)


def swiglu_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """dh [M, 2N] for a = swiglu(h): [da * u * silu'(g) | da * silu(g)], silu'(g) = s + g s (1 - s)."""
    n = h.shape[-1] // 2
    ct = torch.promote_types(h.dtype, torch.float32)
    g, u, d = h[:, :n].to(ct), h[:, n:].to(ct), da.to(ct)
    s = torch.sigmoid(g)
    return torch.cat([d * u * (s + g * s * (1 - s)), d * g * s], dim=1).to(h.dtype)


def unpermute_sum(y: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor, top_k: int,
                  out_dtype: torch.dtype | None = None):
    """out[t] = sum_j y[inv[t*K + j]] over rows inside a group: unpermute_combine with weight 1."""
    ones = torch.ones(perm.numel() // top_k, top_k, dtype=torch.float32, device=y.device)
    return unpermute_combine(y, inv, ones, offsets, out_dtype)


def _row_weights(weights: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor, ct: torch.dtype):
    """[M, 1]: the routing weight of each permuted row (its pair perm[p]), 0 for dropped rows."""
    w = weights.reshape(-1).to(ct).index_select(0, perm)
    return torch.where(valid_rows(offsets, perm.numel()), w, 0).unsqueeze(-1)


def weighted_swiglu(h: torch.Tensor, weights: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor):
    """a[p] = weights.flat[perm[p]] * silu(h[p, :N]) * h[p, N:] (0 for dropped rows), fp32 math,
    rounded once: a row's routing weight applied before the down projection instead of after it."""
    n = h.shape[-1] // 2
    ct = torch.promote_types(h.dtype, torch.float32)
    g, u = h[:, :n].to(ct), h[:, n:].to(ct)
    a = torch.nn.functional.silu(g) * u * _row_weights(weights, perm, offsets, ct)
    return torch.where(valid_rows(offsets, perm.numel()).unsqueeze(-1), a, 0).to(h.dtype)   # h of a dropped row unread


def weighted_swiglu_backward(h, weights, perm, offsets, da):
    """(dh [M, 2N], dweights like weights) for a = weighted_swiglu(h, weights, perm, offsets):
    dh = swiglu_backward(h, w_row * da); dweights.flat[perm[p]] = <da[p], silu(g) * u> (0 if dropped)."""
    n = h.shape[-1] // 2
    ct = torch.promote_types(h.dtype, torch.float32)
    g, u, d = h[:, :n].to(ct), h[:, n:].to(ct), da.to(ct)
    valid = valid_rows(offsets, perm.numel())
    dw_rows = torch.where(valid, (d * torch.nn.functional.silu(g) * u).sum(-1), 0)
    dw = torch.zeros(weights.numel(), dtype=ct, device=h.device).index_copy_(0, perm, dw_rows)
    dh = torch.where(valid.unsqueeze(-1), swiglu_backward(h, _row_weights(weights, perm, offsets, ct) * d), 0)
    return dh, dw.view(weights.shape).to(weights.dtype)


def router_topk(scores: torch.Tensor, k: int):
    """(values, indices) of torch.topk(scores, k, dim=-1): on CPU exactly what eager computes."""
    values, indices = torch.topk(scores, k, dim=-1)
    return values, indices
