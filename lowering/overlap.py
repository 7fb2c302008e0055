"""schedule_collectives: issue every collective as early as possible, wait for each as late as possible.

A post_grad pass (``pipeline.PASSES``: ``ep_overlap``) over each forward and backward ATen graph.
AOTAutograd traces the expert-parallel movement (``kernels/ep_traceable.py``) into
``_c10d_functional`` collectives (the tokens' ``all_gather_into_tensor`` and the partial outputs'
``reduce_scatter_tensor``; ``replicate_experts``' gradient ``all_reduce``: async, they return at once; NCCL runs the collectives of a group one
after another, in issue order, on its own stream) and ``wait_tensor`` (the compute stream waits there
until the data arrived).

The graph is re-listed by a list scheduler; among the nodes whose inputs are all placed it takes:

  1. a collective, or a node some collective still to be issued reads (directly or not): the work
     that gates the next send (the tokens' check and cast; after a wait, the expert GEMMs and the
     combine whose output goes back);
  2. else any other node but a wait (work no collective needs: a shared expert, weight gradients);
  3. else the wait of the collective issued first (NCCL finishes them in that order).

Nodes with other side effects (in-place writes, random number draws, prints) are barriers: they keep
their place relative to every other node. Graphs without a rewritten MoE region (no moe_compile op)
are left as they are. Forward of two token chunks, before (the lowering's order, one chunk after the
other)::

    gather0 wait0 gemm0 scatter0 wait; gather1 wait1 gemm1 scatter1 wait; cat

After::

    gather0 gather1; wait0 gemm0 scatter0; wait1 gemm1 scatter1; wait wait cat

so gather1 runs under gemm0 and scatter0 under gemm1. Only reorders; every node keeps its inputs
before it. Inductor keeps this order: what reads a collective's result is an opaque op (permute_rows,
route_permute, the combine) or a small index map no earlier kernel shares a read with, and its
peak-memory reordering, which moved every wait up to its collective, is off for these graphs
(``backend.inductor_defaults``).
"""
from __future__ import annotations

import heapq

import torch
import torch.fx as fx

_COLLECTIVES = {"all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"}
_WAITS = {"wait_tensor"}
_ORDERED_FREELY = {"_assert_async"}   # side effects that only need their inputs (a device-side check)


def _name(node: fx.Node) -> str:
    target = node.target
    if node.op != "call_function" or getattr(target, "namespace", None) != "_c10d_functional":
        return ""
    return getattr(target, "_opname", "") or getattr(getattr(target, "_overloadpacket", None), "__name__", "")


def _moe_op(node: fx.Node) -> bool:
    """An op of a rewritten MoE region (``moe_compile`` or its runtime twins, ``moe_compile_rt``)."""
    return node.op == "call_function" and getattr(node.target, "namespace", None) in ("moe_compile", "moe_compile_rt")


def _is_barrier(node: fx.Node) -> bool:
    if node.op != "call_function" or _name(node):
        return False
    target = node.target
    schema = getattr(target, "_schema", None)
    if getattr(target, "_opname", None) in _ORDERED_FREELY:
        return False
    if schema is not None and schema.is_mutable:
        return True
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
        return True
    return node.is_impure()


def _dependencies(nodes: list[fx.Node]) -> dict[fx.Node, set[fx.Node]]:
    """Each node's inputs, plus the barrier order: a barrier follows every node before it, and every
    node after it follows it (kept linear: each node depends on the last barrier, each barrier on the
    nodes since the one before)."""
    deps = {n: set(n.all_input_nodes) for n in nodes}
    last_barrier, since = None, []
    for n in nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op == "output" or _is_barrier(n):
            deps[n].update(since)
            if last_barrier is not None:
                deps[n].add(last_barrier)
            last_barrier, since = n, []
        else:
            if last_barrier is not None:
                deps[n].add(last_barrier)
            since.append(n)
    return deps


def schedule_collectives(graph: fx.Graph) -> int:
    """Re-list the graph as the module docstring says; returns how many nodes changed position."""
    nodes = list(graph.nodes)
    collectives = [n for n in nodes if _name(n) in _COLLECTIVES]
    if not collectives or not any(_moe_op(n) for n in nodes):
        return 0   # other code's collectives (e.g. a traced FSDP) keep the order they were given
    pos = {n: i for i, n in enumerate(nodes)}
    gates = set()  # every node some collective reads, directly or not
    stack = list(collectives)
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in gates:
                gates.add(a)
                stack.append(a)
    deps = _dependencies(nodes)
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    missing = {n: len(ds) for n, ds in deps.items()}
    issued: dict[fx.Node, int] = {}

    def key(n: fx.Node) -> tuple:
        if n.op in ("placeholder", "get_attr"):
            return (0, pos[n])
        if n.op == "output":
            return (5, pos[n])
        kind = _name(n)
        if kind in _WAITS:
            started = [issued[a] for a in n.all_input_nodes if a in issued]
            return (4, min(started, default=len(nodes)), pos[n])
        if kind in _COLLECTIVES or (n in gates and not kind):
            return (1, pos[n])
        return (2, pos[n])

    ready = [(key(n), pos[n], n) for n in nodes if missing[n] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        if _name(n) in _COLLECTIVES:
            issued[n] = len(issued)
        for u in users[n]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(ready, (key(u), pos[u], u))
    if len(order) != len(nodes):  # only a cycle leaves nodes unplaced, and a valid graph has none
        raise AssertionError(f"ep_overlap: scheduled {len(order)} of {len(nodes)} nodes")
    moved = sum(1 for i, n in enumerate(order) if nodes[i] is not n)
    if moved:
        out = graph.output_node()
        for n in order:
            if n is not out:
                out.prepend(n)
        graph.lint()
    return moved
