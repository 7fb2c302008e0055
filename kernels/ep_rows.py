"""The expert-parallel movement's index maps and row gathers, as ops the compiler cannot fuse across.

Legend as in ``ep_transport`` (ep ranks, E_local experts per rank, N routed rows per rank).

    ep_layout(plan[2, ep, E_local] i64, n) -> ep_transport.PaddedLayout's eight tensors, in its order
    gather_rows(t[M, H], ok[R] bool, idx[R] i64, inv_ok[M] bool, inv_idx[M] i64) -> [R, H]
        out[r] = t[idx[r]] where ok[r], else 0 (a select: inf/nan in unused rows of t stay out)
        gradient: gather_rows(g, inv_ok, inv_idx, ok, idx)

``gather_rows``'s gradient is exact because every map of the movement is a bijection between t's rows
where ``inv_ok`` and the output rows where ``ok`` (``idx[inv_idx[i]] == i`` there); t's other rows
feed nothing and get zero. ATen's own gradient of the gather is an ``index_add`` (an atomic scatter:
~1 ms per call at Qwen3's widths on an H200).

Why ops rather than traced ATen (as before): Inductor fused the traced gathers and index arithmetic
across the all-to-all's wait (the receive gather with the layout maps computed before the send, one
kernel), and its scheduler put that kernel, and the wait it needs, where its earliest part stood:
right after the send. No compute then ran under any all-to-all (2 x H200, Qwen3-30B-A3B layer:
exposed communication = all communication, 2 token chunks slower than 1). As opaque ops they stay
where ``lowering/overlap.py`` puts them.
"""
from __future__ import annotations

import torch

from .common import check
from .ep_transport import padded_layout
from .registry import implementation


@torch.library.custom_op("moe_compile::ep_layout", mutates_args=())
def ep_layout(plan: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check(plan.dim() == 3 and plan.shape[0] == 2 and plan.dtype == torch.int64, "ep_layout",
          f"plan must be int64 [2, ep, E_local] (ep_traceable.plan), got {plan.dtype} {tuple(plan.shape)}")
    return tuple(t.contiguous() for t in padded_layout(plan, n))


@ep_layout.register_fake
def _(plan, n):
    rows = plan.shape[1] * n

    def idx(m):
        return plan.new_empty(m, dtype=torch.int64)

    def ok(m):
        return plan.new_empty(m, dtype=torch.bool)

    return idx(rows), ok(rows), idx(n), ok(n), idx(rows), ok(rows), idx(rows), ok(rows)


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
