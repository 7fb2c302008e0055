"""schedule_collectives: issue each all-to-all as early as its inputs allow, wait for it as late as possible.

A post_grad pass (``pipeline.PASSES``: ``ep_overlap``) over each forward and backward ATen graph.
AOTAutograd traces the expert-parallel movement (``kernels/ep_traceable.py``) into
``_c10d_functional.all_to_all_single`` (async: it returns at once) and ``wait_tensor`` (blocks
until the data arrived). Before::

    a2a_1 = all_to_all_single(send_1); x_1 = wait_tensor(a2a_1); ... gemm_0 ...; use(x_1)

After: ``a2a_1`` right after the last node it reads, ``wait_tensor`` right before the first node that
reads its result, so whatever independent work the graph holds between them (another chunk's expert
GEMMs) runs while the rows travel. Only reorders; every node keeps its inputs before it. Under
Inductor the scheduler may reorder again within the dependencies; in the aot_eager path this order
is the execution order.
"""
from __future__ import annotations

import torch.fx as fx

_COLLECTIVES = {"all_to_all_single"}
_WAITS = {"wait_tensor"}


def _name(node: fx.Node) -> str:
    target = node.target
    if node.op != "call_function" or getattr(target, "namespace", None) != "_c10d_functional":
        return ""
    return getattr(target, "_opname", "") or getattr(getattr(target, "_overloadpacket", None), "__name__", "")


def schedule_collectives(graph: fx.Graph) -> int:
    """Move every all-to-all up and every wait down; returns how many nodes moved."""
    moved = 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if _name(node) in _COLLECTIVES and node.all_input_nodes:
            last = max(node.all_input_nodes, key=order.__getitem__)
            if node.prev is not last:
                last.append(node)
                moved += 1
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in reversed(list(graph.nodes)):
        if _name(node) in _WAITS and node.users:
            first = min(node.users, key=order.__getitem__)
            if node.next is not first:
                first.prepend(node)
                moved += 1
    if moved:
        graph.lint()
    return moved
