"""Expert-parallel movement as traceable torch code, so the compiler sees (and schedules) the collectives.

The same movement as ``ep.ep_plan`` / ``ep_dispatch`` / ``ep_combine`` (static shapes, counts on the
device, no host sync), written with functional collectives (``torch.distributed._functional_collectives``)
instead of opaque custom ops. The expert-parallel lowering emits these functions; AOTAutograd traces
them into row gathers and ``_c10d_functional`` collectives + ``wait_tensor`` nodes and differentiates
them, and the post_grad stage's ``ep_overlap`` pass (``lowering/overlap.py``) orders them so that a
chunk's collective runs under another chunk's expert GEMMs.

    plan(offsets[E] i32, E, group, N) -> plan[3, ep, E_local] i64, recv_offsets[E_local] i32
    dispatch(xp[N, H], plan, group) -> [ep*N, H]     combine(y[ep*N, H2], plan, group) -> [N, H2]
    (each in two halves: send_rows / receive_rows and send_back / receive_back around a layout, so
    a lowering can put other work between a collective and the gather that needs its result)

Dispatch all-gathers every rank's rows and keeps those of its own experts (one gather, expert-major);
combine puts each result row back where it was taken from, zeros elsewhere, and reduce-scatters: the
sum over ranks of a row is the one owner's value (x + 0 is exact). The all-gather is the backward of
the reduce-scatter and the other way round. On the wire this is what an equal-split all-to-all padded
to the worst case sends (N rows to every peer), minus its pack gather on the way out and its unpack
gather on the way back: two row gathers per layer and direction instead of four.

The gathers are an op of their own (``ep_rows.gather_rows``, whose gradient is the inverse gather):
opaque to Inductor, so it cannot fuse them across a wait and undo the schedule.

Every rank must route the same N rows: ``plan`` exchanges N with the counts and asserts it on the
device (no host sync, no extra collective).
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as fc

from . import ep_rows
from .ep_rows import GatherLayout
from .ep_transport import resolve_group


def _ep(group_name: str) -> int:
    return resolve_group(group_name).size()


def plan(offsets: torch.Tensor, num_experts: int, group_name: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exchange's counts, one tiny all-to-all; ``rows``: this rank's N. plan [3, ep, E_local] i64:
    plan[0][r, j] rows this rank sends to rank r's expert j, plan[1][s, j] rows rank s sends to my
    expert j, plan[2][s, j] where those rows start in rank s's xp."""
    ep = _ep(group_name)
    e_local = num_experts // ep
    ends = offsets.long()
    starts = torch.nn.functional.pad(ends[:-1], (1, 0))
    send = torch.cat([(ends - starts).view(ep, e_local), starts.view(ep, e_local), ends.new_full((ep, 1), rows)], dim=1)
    recv = fc.all_to_all_single(send, None, None, group_name)
    torch._assert_async((recv[:, -1] == rows).all(), "moe_compile expert parallelism: every rank must route the "
                        "same number of rows N = tokens * top_k (pad the batch to a common size)")
    counts = recv[:, :e_local]
    return torch.stack([send[:, :e_local], counts, recv[:, e_local:2 * e_local]]), counts.sum(0).cumsum(0).to(torch.int32)


def layout(plan: torch.Tensor, n: int) -> GatherLayout:
    """The two gathers of one exchange, computed once for both directions (traced: Inductor fuses the
    index arithmetic; only the opaque gathers read the collectives' results, so no fused kernel can
    straddle a wait)."""
    return ep_rows.gather_layout(plan, n)


def send_rows(xp: torch.Tensor, lay: GatherLayout, group_name: str) -> torch.Tensor:
    """Start the all-gather of every rank's [N, H] rows (async until used): [ep*N, H], rank s's at s*N."""
    return fc.all_gather_tensor_autograd(xp.contiguous(), 0, group_name)


def receive_rows(gathered: torch.Tensor, lay: GatherLayout) -> torch.Tensor:
    """Every rank's rows -> [ep*N, H] rows of this rank's experts, expert-major (zeros past the end)."""
    return ep_rows.gather_rows(gathered, lay.mine_ok, lay.mine_src, lay.back_ok, lay.back_src)


def send_back(y: torch.Tensor, lay: GatherLayout, group_name: str) -> torch.Tensor:
    """Expert-major rows back to where ``receive_rows`` took them from (zeros elsewhere) and start the
    reduce-scatter (async): rank s gets the sum over ranks of chunk s, i.e. each of its rows from the one
    rank that owns its expert, in its own row order [N, H2]."""
    return fc.reduce_scatter_tensor_autograd(
        ep_rows.gather_rows(y, lay.back_ok, lay.back_src, lay.mine_ok, lay.mine_src), "sum", 0, group_name)


def receive_back(returned: torch.Tensor, lay: GatherLayout) -> torch.Tensor:
    """The reduce-scatter's result is already [N, H2] in xp's row order (rows not sent: zero)."""
    return returned


def dispatch(xp: torch.Tensor, plan: torch.Tensor, group_name: str) -> torch.Tensor:
    """[N, H] rows sorted by global expert -> [ep*N, H] rows of this rank's experts, expert-major."""
    if xp.shape[0] == 0:
        return xp.new_zeros(0, xp.shape[1])
    lay = layout(plan, xp.shape[0])
    return receive_rows(send_rows(xp, lay, group_name), lay)


def combine(y: torch.Tensor, plan: torch.Tensor, group_name: str) -> torch.Tensor:
    """[ep*N, H2] expert-major rows -> [N, H2] back in xp's row order (dispatch's adjoint)."""
    n = y.shape[0] // _ep(group_name)
    if n == 0:
        return y.new_zeros(0, y.shape[1])
    lay = layout(plan, n)
    return receive_back(send_back(y, lay, group_name), lay)
