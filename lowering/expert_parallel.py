"""Expert-parallel lowering: a region whose experts ``parallelize_experts`` sharded over a mesh.

Such a region's expert weights are ``moe_compile.ep_experts(local, E, group)`` markers (the global
[E, ...] shape for tracing; ``local`` is this rank's [E_local, ...] shard). ``lower_region``
(lowering/region.py) emits, per token chunk::

    x_all, local_ids, w_all = ep_traceable.gather_tokens(x, ids, w, E, group)   <- gather_tokens()
    perm, inv, offs = route_permute(local_ids, E_local)      (other ranks' experts: dropped)
    rows = permute_rows(x_all, perm, inv, offs, K)
    h = <expert function>, each linear -> grouped_mm(h, <view of local>, offs)   <- local_operand()
    partial = unpermute_combine(h, inv, w_all, offs)         [ep*T, H]: this rank's experts' share
    out = ep_traceable.scatter_tokens(partial, group)        <- scatter_tokens(): [T, H], summed over ranks

With a token bound (``parallelize_experts(..., max_tokens=N)``: the marker's 4th argument) x, ids and
weights are first padded to N rows (``pad_tokens()``; ids of padding rows go to no expert) and the
output is cut back to T rows (``unpad_tokens()``): ranks may then hold different T <= N.

The movement is written with functional collectives (kernels/ep_traceable.py: all-gathers of the
tokens, ids and weights, a reduce-scatter of the partial outputs, traced by AOTAutograd into
collectives + wait_tensor nodes, differentiated by it); the opaque ``moe_compile.ep_*`` ops of
kernels/ep.py move routed rows instead, outside a compiled graph (padded all-to-all).

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
    max_tokens: int = 0     # > 0: every rank's tokens padded to this many rows (parallelize_experts' max_tokens)


def layout(region: Region) -> EPLayout | None:
    """The region's expert-parallel group, or None if its experts are not sharded. Raises
    ``InvalidSetup`` when FSDP also shards the experts across ranks that hold other experts."""
    for st in region.experts.steps:
        if st.linear is not None:
            marker = ep_marker(region.experts.slots[st.linear[0]])
            if marker is not None:
                from moe_compile.ep_ddp import check_ddp_composition
                from moe_compile.parallel import check_fsdp_composition

                try:
                    check_fsdp_composition(marker.args[2])
                    check_ddp_composition(marker.args[2])
                except ValueError as exc:
                    raise InvalidSetup(str(exc)) from exc
                bound = marker.args[3] if len(marker.args) > 3 else marker.kwargs.get("max_tokens", 0)
                return EPLayout(group_name=marker.args[2], num_experts=marker.args[1], max_tokens=bound)
    _refuse_other_indexing(region)
    return None


def _marker_above(node, depth: int = 6):
    """The ep_experts marker ``node`` is computed from through its first arguments (views, indexing), or None."""
    while depth and isinstance(node, fx.Node) and node.op == "call_function":
        if is_ep_marker(node):
            return node
        node, depth = (node.args[0] if node.args else None), depth - 1
    return None


def _refuse_other_indexing(region: Region) -> None:
    """Raise (``InvalidSetup``) when an expert operand is read from a sharded weight (``ep_experts``
    marker) other than as ``W[e]`` for expert e: the expert-parallel lowering runs expert e on the rank
    holding row e of every sharded weight, so it takes only that indexing (``ep_marker``); any other
    (``W[E-1-e]``, ``W.select(0, e)``, ``W[e:e+1].squeeze(0)``) would otherwise leave the marker in the graph."""
    from moe_compile.passes.normalize import where_in_user_code

    for st in region.experts.steps:
        for slot in (st.linear[:2] if st.linear is not None else ()):
            for e, n in enumerate(region.experts.slots[slot] if slot is not None else ()):
                marker = _marker_above(n)
                if marker is None:
                    continue
                ops = []
                while n is not marker:
                    name, rest = getattr(n.target, "__name__", str(n.target)), ", ".join(map(str, n.args[1:]))
                    ops.append(f"[{rest}]" if name == "getitem" else f".{name}({rest})")
                    n = n.args[0]
                ops = ["W" + "".join(reversed(ops))]
                raise InvalidSetup(
                    f"expert_parallel: the MoE layer '{region.module or '<top>'}' at {region.where} reads expert "
                    f"{e}'s weight from the sharded [E={marker.args[1]}, ...] expert weight "
                    f"(parallelize_experts) at {where_in_user_code(region.experts.slots[slot][e]) or '?'} as "
                    f"{' of '.join(ops)}, not as W[{e}]: expert parallelism runs expert e on the rank that holds "
                    f"row e of the weight, so it takes expert e's weight only as W[e], indexed by the loop's "
                    f"expert number (views of W before the index, W.transpose(1, 2)[e], are fine; W[E-1-e], "
                    f"W.select(0, e), W[e:e+1].squeeze(0) are not). Fix: read it as W[e] (reorder the router's "
                    f"outputs, or the stacked weight once, instead of the index), or leave this model unsharded "
                    f"(the layer compiles without parallelize_experts)")


def local_experts(ep: EPLayout) -> int:
    from moe_compile.kernels.ep_transport import resolve_group

    return ep.num_experts // resolve_group(ep.group_name).size()


def gather_tokens(b, x: fx.Node, ids: fx.Node, w: fx.Node | None, ep: EPLayout):
    """Every rank's tokens, their ids mapped to this rank's experts and their weights (None stays
    None): ``kernels/ep_traceable.gather_tokens``, emitted as traceable code so that the compiler
    sees the collectives and the post_grad stage's ``ep_overlap`` pass schedules them."""
    out = b.fn(ep_traceable.gather_tokens, x, ids, w, ep.num_experts, ep.group_name, bool(ep.max_tokens))
    x_all, local_ids = (b.fn(operator.getitem, out, i) for i in range(2))
    return x_all, local_ids, (b.fn(operator.getitem, out, 2) if w is not None else None)


# a data-dependent T with max_tokens under Inductor on CUDA: refused (check_data_dependent_tokens)
DATA_DEPENDENT_TOKENS = (
    "expert_parallel: the MoE layer's token count is data-dependent inside the compiled graph (its tokens picked by "
    "a mask or nonzero, x[mask]) and parallelize_experts(..., max_tokens={n}) pads them, in a graph that goes to "
    "Inductor on CUDA: on 2 x H200 (torch 2.11) that combination gave rank 0 wrong outputs when it held exactly "
    "max_tokens tokens (AOTAutograd without Inductor gave the right ones), so it is refused. Fix: give the layer its "
    "tokens with their count as a tensor size (select them before the compiled call, or keep the padded batch and "
    "mask the loss), or compile with options={{\"moe.inductor\": False}}")


def check_data_dependent_tokens(region: Region, inductor: bool) -> None:
    """Refuse (``InvalidSetup``) an expert-parallel region with a token bound whose T is data-dependent
    (unbacked) when its graph goes to Inductor on CUDA (``DATA_DEPENDENT_TOKENS`` says why). The
    region's layout is read only for such a T."""
    if not inductor:
        return
    x = val(region.x)
    if x.device.type != "cuda" or not ep_traceable.data_dependent(x.shape[0]):
        return
    ep = layout(region)
    if ep is not None and ep.max_tokens:
        raise InvalidSetup(DATA_DEPENDENT_TOKENS.format(n=ep.max_tokens))


def pad_tokens(b, x: fx.Node, ids: fx.Node, w: fx.Node | None, ep: EPLayout):
    """x, ids, w padded to ``ep.max_tokens`` rows (kernels/ep_traceable.pad_tokens), after every rank's T
    is checked against the bound when the graph runs (``ep_tokens_fit`` on the all-gathered counts: all
    ranks raise together). A T known above the bound here (an int, or a backed symbolic T, whose
    comparison becomes a guard: crossing the bound recompiles) still compiles, padded to T rows: that
    graph raises at the check on every rank. Raising here instead, on this rank alone, left the other
    ranks waiting in their collectives until this process died."""
    t = val(x).shape[0]
    over = not ep_traceable.data_dependent(t) and bool(t > ep.max_tokens)   # (a backed T: a guard)
    out = b.fn(ep_traceable.pad_tokens, x, ids, w, ep.max_tokens, ep.num_experts, ep.group_name, over)
    return tuple(b.fn(operator.getitem, out, i) for i in range(2)) + \
        ((b.fn(operator.getitem, out, 2) if w is not None else None),)


def unpad_tokens(b, out: fx.Node, like: fx.Node) -> fx.Node:
    """The first T rows of ``out``, T = ``like``'s rows."""
    return b.fn(ep_traceable.unpad_tokens, out, like)


def scatter_tokens(b, partial: fx.Node, ep: EPLayout) -> fx.Node:
    """Each token's partial outputs summed over the ranks, on the token's own rank."""
    return b.fn(ep_traceable.scatter_tokens, partial, ep.group_name)


def describe(ep: EPLayout, received, chunks: int) -> str:
    """What explain() says about the region's expert parallelism (``received``: the receive buffer)."""
    import torch.distributed as dist

    from moe_compile.kernels.ep_transport import resolve_group

    size = dist.get_world_size(resolve_group(ep.group_name))
    if chunks > 1:
        overlap = f"overlap: collectives issued early and waited late (ep_overlap), {chunks} token chunks"
    else:
        overlap = ("one token chunk (moe.ep_overlap_chunks > 1 splits the tokens so collectives can run under "
                   "another chunk's GEMMs)")
    padded = (f"each rank's tokens padded to max_tokens={ep.max_tokens} rows (ranks may hold different counts), "
              if ep.max_tokens else "")
    return (f"expert parallel: ep={size} ranks, {ep.num_experts // size} of {ep.num_experts} experts per rank, "
            f"transport: tokens all-gathered, partial outputs reduce-scattered (functional collectives, "
            f"sync-free), {padded}receive capacity {received.shape[0]} rows per chunk (every rank's rows: dropless), "
            f"{overlap}")


def local_operand(b, node: fx.Node) -> fx.Node:
    """``node`` (a marker, or views of one) rebuilt on the marker's local shard."""
    if is_ep_marker(node):
        return node.args[0]
    src = local_operand(b, node.args[0])
    return b(node.op, node.target, (src, *node.args[1:]), dict(node.kwargs))
