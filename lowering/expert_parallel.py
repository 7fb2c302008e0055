"""Expert-parallel lowering: a region whose experts ``parallelize_experts`` sharded over a mesh.

Such a region's expert weights are ``moe_compile.ep_experts(local, E, group)`` markers (the global
[E, ...] shape for tracing; ``local`` is this rank's [E_local, ...] shard). ``lower_region`` calls
this module at three points, so the chain it emits becomes::

    perm, inv, offs = route_permute(ids, E)                   (global expert ids)
    xp = permute_rows(x, perm, inv, offs, K)
    plan, recv_offs = ep_traceable.plan(offs, E, group, N)    <- dispatch()
    xr = ep_traceable.dispatch(xp, plan, group)                  rows of my local experts, [ep*N, H]
    h = <expert function>, each linear -> grouped_mm(h, <view of local>, recv_offs)   <- local_operand()
    y = ep_traceable.combine(h, plan, group)                  <- combine(): back in xp's order, [N, H]
    out = unpermute_combine(y, inv, w, offs)

The movement is written with functional collectives (kernels/ep_traceable.py: an all-gather of the
rows and a reduce-scatter of the results, traced by AOTAutograd into collectives + wait_tensor nodes,
differentiated by it); the opaque ``moe_compile.ep_*`` ops of kernels/ep.py do the same movement
outside a compiled graph (padded all-to-all).

``passes/legality.expert_parallel`` has checked that every expert weight and bias of the region is
such a marker, over one group, for the router's E.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from moe_compile.kernels import ep_traceable
from moe_compile.passes.normalize import val
from moe_compile.passes.region import Region, ep_marker, is_ep_marker

from .graph_edit import InvalidSetup



@dataclass(frozen=True)
class EPLayout:
    group_name: str
    num_experts: int


def layout(region: Region) -> EPLayout | None:
    """The region's expert-parallel group, or None if its experts are not sharded. Raises
    ``InvalidSetup`` when FSDP also shards the experts across ranks that hold other experts."""
    for st in region.experts.steps:
        if st.linear is not None:
            marker = ep_marker(region.experts.slots[st.linear[0]])
            if marker is not None:
                from moe_compile.parallel import check_fsdp_composition

                try:
                    check_fsdp_composition(marker.args[2])
                except ValueError as exc:
                    raise InvalidSetup(str(exc)) from exc
                return EPLayout(group_name=marker.args[2], num_experts=marker.args[1])
    return None


@dataclass(frozen=True)
class InFlight:
    """One direction of an exchange started but not received: the collective's result and the layout."""
    sent: fx.Node
    layout: fx.Node


def dispatch(b, xp: fx.Node, offs: fx.Node, ep: EPLayout):
    """Start sending rows to the ranks that own their experts: (InFlight, group offsets of the rows
    this rank will receive, the plan). ``receive`` finishes it. Emitted as traceable code
    (``kernels/ep_traceable.py``): the compiler sees the collectives and the post_grad stage's
    ``ep_overlap`` pass schedules them."""
    n = val(xp).shape[0]
    planned = b.fn(ep_traceable.plan, offs, ep.num_experts, ep.group_name, n)
    plan, recv_offs = (b.fn(operator.getitem, planned, i) for i in range(2))
    lay = b.fn(ep_traceable.layout, plan, n)
    return InFlight(b.fn(ep_traceable.send_rows, xp, lay, ep.group_name), lay), recv_offs, plan


def receive(b, flight: InFlight) -> fx.Node:
    """The rows of this rank's experts, expert-major [ep*N, H]."""
    return b.fn(ep_traceable.receive_rows, flight.sent, flight.layout)


def send_back(b, h: fx.Node, flight: InFlight, ep: EPLayout) -> InFlight:
    return InFlight(b.fn(ep_traceable.send_back, h, flight.layout, ep.group_name), flight.layout)


def receive_back(b, flight: InFlight) -> fx.Node:
    """The expert outputs back in this rank's row order [N, H2]."""
    return b.fn(ep_traceable.receive_back, flight.sent, flight.layout)


def describe(ep: EPLayout, received, chunks: int) -> str:
    """What explain() says about the region's expert parallelism (``received``: the receive buffer)."""
    import torch.distributed as dist

    from moe_compile.kernels.ep_transport import resolve_group

    size = dist.get_world_size(resolve_group(ep.group_name))
    if chunks > 1:
        overlap = f"overlap: collectives issued early and waited late (ep_overlap), {chunks} token chunks"
    else:
        overlap = ("one token chunk, no overlap (moe.ep_overlap_chunks > 1 splits the tokens so collectives "
                   "can run under another chunk's GEMMs)")
    return (f"expert parallel: ep={size} ranks, {ep.num_experts // size} of {ep.num_experts} experts per rank, "
            f"transport all-gather / reduce-scatter (functional collectives, sync-free), receive capacity "
            f"{received.shape[0]} rows per chunk (every rank's rows: dropless), {overlap}")


def local_operand(b, node: fx.Node) -> fx.Node:
    """``node`` (a marker, or views of one) rebuilt on the marker's local shard."""
    if is_ep_marker(node):
        return node.args[0]
    src = local_operand(b, node.args[0])
    return b(node.op, node.target, (src, *node.args[1:]), dict(node.kwargs))
