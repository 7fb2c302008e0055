"""Expert-parallel movement as traceable torch code, so the compiler sees (and schedules) the collectives.

The same movement as ``ep.ep_plan`` / ``ep_dispatch`` / ``ep_combine`` with the ``PaddedAllToAll``
transport (``ep_transport.padded_layout``: fixed-size chunks per peer, device-side gathers, no host
sync), written with functional collectives (``torch.distributed._functional_collectives``) instead of
opaque custom ops. The expert-parallel lowering emits these functions; AOTAutograd traces them into
row gathers and ``_c10d_functional.all_to_all_single`` + ``wait_tensor`` nodes and differentiates
them (the backward of an equal-split all-to-all is an all-to-all), and the post_grad stage's
``ep_overlap`` pass (``lowering/overlap.py``) orders them so that a chunk's all-to-all runs under
another chunk's expert GEMMs.

    plan(offsets[E] i32, E, group, N) -> plan[2, ep, E_local] i64, recv_offsets[E_local] i32
    dispatch(xp[N, H], plan, group) -> [ep*N, H]     combine(y[ep*N, H2], plan, group) -> [N, H2]
    (each in two halves: send_rows / receive_rows and send_back / receive_back around a layout, so
    a lowering can put other work between an all-to-all and the gather that needs its result)

The layout maps and the gathers are ops of their own (``ep_rows``: ``ep_layout``, ``gather_rows``,
whose gradient is the inverse gather): opaque to Inductor, so it cannot fuse them across a wait and
undo the schedule.

Every rank must route the same N rows: ``plan`` exchanges N with the counts and asserts it on the
device (no host sync, no extra collective).
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as fc

from . import ep_rows
from .ep_transport import PaddedLayout, resolve_group


def _ep(group_name: str) -> int:
    return resolve_group(group_name).size()


def plan(offsets: torch.Tensor, num_experts: int, group_name: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of rows per (peer, local expert), sent and received; ``rows``: this rank's N."""
    ep = _ep(group_name)
    ends = offsets.long()
    counts = ends - torch.nn.functional.pad(ends[:-1], (1, 0))
    send = torch.cat([counts.view(ep, num_experts // ep), counts.new_full((ep, 1), rows)], dim=1)
    recv = fc.all_to_all_single(send, None, None, group_name)
    torch._assert_async((recv[:, -1] == rows).all(), "moe_compile expert parallelism: every rank must route the "
                        "same number of rows N = tokens * top_k (pad the batch to a common size)")
    send, recv = send[:, :-1], recv[:, :-1]
    return torch.stack([send, recv]), recv.sum(0).cumsum(0).to(torch.int32)


def layout(plan: torch.Tensor, n: int):
    """The gathers of one exchange (``ep_transport.PaddedLayout``), computed once for both directions."""
    return PaddedLayout(*ep_rows.ep_layout(plan, n))


def send_rows(xp: torch.Tensor, lay, group_name: str) -> torch.Tensor:
    """Pack [N, H] rows into one [N, H] chunk per peer and start the all-to-all (async until used)."""
    return fc.all_to_all_single_autograd(ep_rows.gather_rows(xp, lay.pack_ok, lay.pack_src, lay.unpack_ok, lay.unpack_src),
                                         None, None, group_name)


def receive_rows(received: torch.Tensor, lay) -> torch.Tensor:
    """The received per-peer chunks -> [ep*N, H] rows of this rank's experts, expert-major."""
    return ep_rows.gather_rows(received, lay.out_ok, lay.src, lay.recv_ok, lay.dest)


def send_back(y: torch.Tensor, lay, group_name: str) -> torch.Tensor:
    """Expert-major rows back into per-peer chunks, all-to-all to where they came from (async)."""
    return fc.all_to_all_single_autograd(ep_rows.gather_rows(y, lay.recv_ok, lay.dest, lay.out_ok, lay.src),
                                         None, None, group_name)


def receive_back(returned: torch.Tensor, lay) -> torch.Tensor:
    """The returned chunks -> [N, H2] in xp's row order (rows that were not sent: zero)."""
    return ep_rows.gather_rows(returned, lay.unpack_ok, lay.unpack_src, lay.pack_ok, lay.pack_src)


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
