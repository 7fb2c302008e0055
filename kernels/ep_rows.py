"""The expert-parallel movement's index maps, and its row gathers as an op the compiler cannot fuse across.

Legend as in ``ep_transport`` (ep ranks, E_local experts per rank, N routed rows per rank).

    gather_layout(plan[3, ep, E_local] i64, n) -> GatherLayout (traced torch: Inductor fuses it)
    gather_rows(t[M, H], ok[R] bool, idx[R] i64, inv_ok[M] bool, inv_idx[M] i64) -> [R, H]
        out[r] = t[idx[r]] where ok[r], else 0 (a select: inf/nan in unused rows of t stay out)
        gradient: gather_rows(g, inv_ok, inv_idx, ok, idx)

``gather_rows``'s gradient is exact because every map of the movement is a bijection between t's rows
where ``inv_ok`` and the output rows where ``ok`` (``idx[inv_idx[i]] == i`` there); t's other rows
feed nothing and get zero. ATen's own gradient of the gather is an ``index_add`` (an atomic scatter:
~1 ms per call at Qwen3's widths on an H200).

Why an op rather than traced ATen (as before): Inductor fused the traced gathers with the layout
arithmetic computed before the send (the receive gather and its index maps, one kernel), and its
scheduler put that kernel, and the wait it needs, where its earliest part stood: right after the send.
No compute then ran under any all-to-all (2 x H200, Qwen3-30B-A3B layer: exposed communication = all
communication, 2 token chunks slower than 1). Only opaque gathers read a collective's result now, so no
fused kernel straddles a wait, and they stay where ``lowering/overlap.py`` puts them. The index maps
stay traced (an opaque op for them cost ~0.3 ms of host time per layer-step in eager index ops).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .common import check
from .registry import implementation


class GatherLayout(NamedTuple):
    """The exchange's two row maps over [ep*N] rows, each the other's inverse on its valid rows.

    mine_src/mine_ok: expert-major row p of this rank's experts is all-gathered row mine_src[p]
    (rank s's xp row i at s*N + i) where mine_ok[p] (p < the rows received), else zero.
    back_src/back_ok: all-gathered row r is expert-major row back_src[r] where back_ok[r] (r is a row
    of one of this rank's experts), else not this rank's.

    Worked example (ep=2, E_local=2, N=3; this is rank 0; plan from ep_traceable.plan)::

        rank 0 xp: a(e0) b(e1) c(e2)      rank 1 xp: d(e1) e(e1) f(e3)      gathered: a b c d e f
        plan[1] (received counts) = [[1, 1], [0, 2]], plan[2] (their starts) = [[0, 1], [0, 0]]
        expert-major: e0: a; e1: b, d, e  ->  mine_src = [0, 1, 3, 4, -, -], mine_ok = [1, 1, 1, 1, 0, 0]
        back_src = [0, 1, -, 2, 3, -], back_ok = [1, 1, 0, 1, 1, 0]
    """
    mine_src: torch.Tensor
    mine_ok: torch.Tensor
    back_src: torch.Tensor
    back_ok: torch.Tensor


def gather_layout(plan: torch.Tensor, n: int) -> GatherLayout:
    """``GatherLayout`` from the plan: static shapes, device-side arithmetic, deterministic."""
    recv, starts = plan[1], plan[2]                       # [ep, E_local]: rows from rank s for my expert j
    ep, e_local = recv.shape
    rows = ep * n
    p = torch.arange(rows, device=plan.device)
    block_ends = recv.t().reshape(-1).cumsum(0)            # blocks (j, s), expert-major then source
    block = torch.searchsorted(block_ends, p, right=True)  # [ep*N] in [0, E_local*ep]
    mine_ok = block < e_local * ep
    block = block.clamp(max=e_local * ep - 1)
    j, s = block // ep, block % ep
    first = block_ends[block] - recv[s, j]
    mine_src = torch.where(mine_ok, s * n + starts[s, j] + p - first, 0)
    # the inverse, by a scatter with distinct targets: invalid p write past the end (dropped with it)
    back = torch.full((2 * rows,), -1, dtype=torch.int64, device=plan.device)
    back.scatter_(0, torch.where(mine_ok, mine_src, rows + p), p)
    back = back[:rows]
    return GatherLayout(mine_src, mine_ok, back.clamp(min=0), back >= 0)


def _check_gather(t, ok, idx, inv_ok, inv_idx):
    check(t.dim() == 2, "gather_rows", f"t must be 2-D [rows, H], got {tuple(t.shape)}")
    check(ok.shape == idx.shape and ok.dim() == 1, "gather_rows",
          f"ok and idx must be 1-D of one length, got {tuple(ok.shape)} and {tuple(idx.shape)}")
    check(inv_ok.shape == inv_idx.shape == (t.shape[0],), "gather_rows",
          f"inv_ok / inv_idx must have t's {t.shape[0]} rows, got {tuple(inv_ok.shape)} / {tuple(inv_idx.shape)}")


@torch.library.custom_op("moe_compile::gather_rows", mutates_args=())
def gather_rows(t: torch.Tensor, ok: torch.Tensor, idx: torch.Tensor, inv_ok: torch.Tensor,
                inv_idx: torch.Tensor) -> torch.Tensor:
    _check_gather(t, ok, idx, inv_ok, inv_idx)
    return implementation("gather_rows", t)(t, ok, idx)


@gather_rows.register_fake
def _(t, ok, idx, inv_ok, inv_idx):
    _check_gather(t, ok, idx, inv_ok, inv_idx)
    return t.new_empty(idx.shape[0], t.shape[1])


def _gather_setup(ctx, inputs, output):
    _, ok, idx, inv_ok, inv_idx = inputs
    ctx.save_for_backward(ok, idx, inv_ok, inv_idx)


def _gather_bwd(ctx, grad):
    ok, idx, inv_ok, inv_idx = ctx.saved_tensors
    return gather_rows(grad.contiguous(), inv_ok, inv_idx, ok, idx), None, None, None, None


gather_rows.register_autograd(_gather_bwd, setup_context=_gather_setup)
