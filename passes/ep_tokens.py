"""ep_tokens: an expert-parallel MoE layer whose tokens are the same on several of its ep ranks (finds only).

Graph before and after: unchanged. Expert parallelism sends every rank's tokens to the ranks that hold
their experts and sums, in each expert's gradient, the tokens of every ep rank (the dispatch's backward).
That is right when each rank holds its own tokens (data parallel, or a sequence split), and wrong when
tensor parallelism over the same ranks hands each of them the same activations: every token then reaches
its experts once per such rank, and the expert gradients count it as often (2x on 2 ranks, silently;
review helper-118). The router's and the dense layers' gradients stay right, so nothing else shows it.

Where the graph says so: DTensor placements. Tensor parallelism (``parallelize_module``) turns the
activations it reads or writes into DTensors and back (``from_local`` / ``to_local``); its Replicate
placement over a mesh dimension says the local tensors on that dimension's ranks are equal. The finder
walks from the layer's tokens to the nearest DTensors on every path, up (the tensors they were made
local from) and down (the DTensors made of them or of values computed from them: the next layer's
input), and reports a Replicate placement over a mesh dimension whose ranks share more than this rank
with the ep group. A sequence split (SequenceParallel, a ``Shard(1)`` input made local) is the nearest
DTensor there and passes; so does tensor parallelism over a mesh dimension orthogonal to ep. Plain
tensors with no DTensor in reach say nothing: data parallel, or tensor parallelism in another graph (a
graph break, a compiled submodule, an activation-checkpointed MoE layer), which
``moe_compile.ep_info.tensor_parallel_over`` finds on the model's Parameters (``ep_tokens_unproven``).
"""
from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass

import torch.fx as fx

from .normalize import attribute_path, module_path, val, where_in_user_code

_LIMIT = 20000   # nodes walked each way: a layer's neighbourhood, not a whole deep model twice


@dataclass(frozen=True)
class ReplicatedTokens:
    where: str              # the module that makes or reads the replicated DTensor ('module attn.wo'), else its file:line
    placement: str          # e.g. "Replicate() over mesh dim 'tp' (ranks [0, 1])"
    shared: tuple[int, ...]  # the ep ranks that see the same tokens


def replicated_over_ep(x: fx.Node, ep_ranks: set[int]) -> tuple[ReplicatedTokens | None, bool]:
    """(the nearest DTensor up or down from the tokens ``x`` replicated over more than one rank of
    ``ep_ranks``, or None; whether any DTensor activation was reached: without one the graph cannot tell,
    and ``moe_compile.ep_info.tensor_parallel_over`` decides)."""
    if not _holds_dtensors(x.graph):   # the common case (no tensor parallelism here): one scan per graph
        return None, False
    seen = False
    for node in _nearest_dtensors(x):
        seen = True
        found = _replicated(val(node), ep_ranks)
        if found is not None:
            where = f"module '{module_path(node)}'" if module_path(node) else where_in_user_code(node)
            return ReplicatedTokens(where or "", *found), True
    return None, seen


def _is_dtensor(v) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:   # torch without distributed
        return False
    return isinstance(v, DTensor)


_HOLDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _holds_dtensors(graph: fx.Graph) -> bool:
    """A DTensor activation in ``graph`` (Parameters that are DTensors, e.g. ``fsdp_ignored_params``'
    experts, say nothing of the tokens)."""
    if graph not in _HOLDS:
        _HOLDS[graph] = any(_is_dtensor(val(n)) and not _parameter(n) for n in graph.nodes)
    return _HOLDS[graph]


def _parameter(n: fx.Node) -> bool:
    return n.op == "get_attr" or (n.op == "placeholder" and bool(attribute_path(n)))


def _nearest_dtensors(x: fx.Node):
    """DTensor-valued nodes first reached from ``x`` walking inputs (up) and users (down) through
    plain values; the walk stops at each DTensor."""
    for step in (lambda n: n.all_input_nodes, lambda n: n.users):
        seen, todo, walked = {x}, deque([x]), 0   # breadth first: the nearest first, within the limit
        while todo and walked < _LIMIT:
            n = todo.popleft()
            walked += 1
            for m in step(n):
                if m in seen or _parameter(m):
                    continue
                seen.add(m)
                if _is_dtensor(val(m)):
                    yield m
                elif m.op != "output":
                    todo.append(m)


def _replicated(dt, ep_ranks: set[int]):
    """(placement text, shared ep ranks) for a Replicate placement of ``dt`` over a mesh dimension
    sharing more than one rank with ``ep_ranks``, or None (also where the mesh cannot be read)."""
    import torch.distributed as dist

    try:
        mesh, placements = dt.device_mesh, dt.placements
        names = mesh.mesh_dim_names or ()
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():
                continue
            ranks = set(dist.get_process_group_ranks(mesh.get_group(dim)))
            shared = ranks & ep_ranks
            if len(shared) > 1:
                name = f"'{names[dim]}'" if dim < len(names) else str(dim)
                return f"{placement!r} over mesh dim {name} (ranks {sorted(ranks)})", tuple(sorted(shared))
    except (AttributeError, RuntimeError, ValueError):   # a mesh this torch lays out otherwise: no finding
        return None
    return None
