"""Expert-parallel lowering: a region whose experts ``parallelize_experts`` sharded over a mesh.

Such a region's expert weights are ``moe_compile.ep_experts(local, E, group)`` markers (the global
[E, ...] shape for tracing; ``local`` is this rank's [E_local, ...] shard). ``lower_region`` calls
this module at three points, so the chain it emits becomes::

    perm, inv, offs = route_permute(ids, E)                   (global expert ids)
    xp = permute_rows(x, perm, inv, offs, K)
    plan, recv_offs = ep_plan(offs, E, group)                 <- dispatch()
    xr = ep_dispatch(xp, plan, group)                            rows of my local experts, [ep*N, H]
    h = <expert function>, each linear -> grouped_mm(h, <view of local>, recv_offs)   <- local_operand()
    y = ep_combine(h, plan, group)                            <- combine(): back in xp's order, [N, H]
    out = unpermute_combine(y, inv, w, offs)

``passes/legality.expert_parallel`` has checked that every expert weight and bias of the region is
such a marker, over one group, for the router's E.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from moe_compile.passes.region import Region, ep_marker, is_ep_marker

from .graph_edit import InvalidSetup

OPS = torch.ops.moe_compile


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


def dispatch(b, xp: fx.Node, offs: fx.Node, ep: EPLayout):
    """(rows of this rank's local experts, their group offsets, the plan for ``combine``)."""
    planned = b.fn(OPS.ep_plan.default, offs, ep.num_experts, ep.group_name)
    plan, recv_offs = (b.fn(operator.getitem, planned, i) for i in range(2))
    return b.fn(OPS.ep_dispatch.default, xp, plan, ep.group_name), recv_offs, plan


def describe(ep: EPLayout, received) -> str:
    """What explain() says about the region's expert parallelism (``received``: ep_dispatch's output)."""
    import torch.distributed as dist

    from moe_compile.kernels.ep_transport import resolve_group, select_transport

    group = resolve_group(ep.group_name)
    size = dist.get_world_size(group)
    transport = type(select_transport(group, received.device)).__name__
    return (f"expert parallel: ep={size} ranks, {ep.num_experts // size} of {ep.num_experts} experts per rank, "
            f"transport {transport}, receive capacity {received.shape[0]} rows (every rank's rows: dropless), "
            "overlap off")


def combine(b, h: fx.Node, plan: fx.Node, ep: EPLayout) -> fx.Node:
    return b.fn(OPS.ep_combine.default, h, plan, ep.group_name)


def local_operand(b, node: fx.Node) -> fx.Node:
    """``node`` (a marker, or views of one) rebuilt on the marker's local shard."""
    if is_ep_marker(node):
        return node.args[0]
    src = local_operand(b, node.args[0])
    return b(node.op, node.target, (src, *node.args[1:]), dict(node.kwargs))
