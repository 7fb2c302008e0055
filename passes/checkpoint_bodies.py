"""checkpoint_bodies: the graphs of ``torch.utils.checkpoint`` regions inside a Dynamo graph.

Dynamo traces ``torch.utils.checkpoint.checkpoint(fn, *args)`` (reentrant or not) into one
higher-order op whose first argument is a subgraph holding ``fn``'s body; transformers' activation
checkpointing puts every decoder layer, MoE block included, in one::

    wrap_body_0 = self.wrap_body_0
    out = torch.ops.higher_order.tag_activation_checkpoint(wrap_body_0, x, w_router, w1_0, ..., use_reentrant=False)

    class wrap_body_0:   # placeholder i <- operand i of the call
        def forward(self, x, w_router, w1_0, ...): ... router, per-expert loop ...

The dynamo stage runs its passes on each body as on a graph of its own (moe_compile/pipeline.py);
AOTAutograd inlines the body with recompute tags, so the ops a rewrite puts there are recomputed in
the backward like the code they replace. Finds only: returns ``CheckpointBody`` records (the body,
the example values of its placeholders: the caller's real inputs where an operand is one of its
placeholders, else the operand's fake value; the placeholders the caller feeds a router's indices),
edits nothing.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .normalize import canon, val

HOPS = ("tag_activation_checkpoint",)


@dataclasses.dataclass(frozen=True)
class CheckpointBody:
    name: str                  # the subgraph's attribute on the outer GraphModule
    body: fx.GraphModule
    example_inputs: tuple      # one per placeholder of ``body``
    routed_inputs: frozenset = frozenset()   # its placeholders given a router's indices by the caller (the
    # router outside the checkpoint: passes/unrouted.py lists the expert loop they select for)


def checkpoint_bodies(gm: fx.GraphModule, example_inputs, routed: frozenset = frozenset()) -> list[CheckpointBody]:
    """One record per distinct checkpoint body called from ``gm``'s graph, then the bodies nested in
    each (a checkpoint inside a checkpointed function), outermost first. ``routed``: ``gm``'s own
    placeholders that carry a router's indices (``gm`` a body itself)."""
    out = []
    for b in _bodies(gm, example_inputs, routed):
        out += [b, *checkpoint_bodies(b.body, b.example_inputs, b.routed_inputs)]
    return out


# the calls whose indices output (``[1]``) picks experts, and the ones that return indices themselves
_ROUTERS = {"topk", "max", "min", "sort"}
_ARG_ROUTERS = {"argmax", "argmin", "argsort"}


def _topk_indices(a, routed: frozenset, limit: int = 16) -> bool:
    """The caller's operand ``a`` is computed from a router's indices (a top-k's, max's, sort's ``[1]``,
    an argmax) through integer ops (views, casts, slices, ``ids + 0``, ``where(keep, ids, -1)``), or from
    a placeholder of the caller that carries them (``routed``)."""
    seen, stack = set(), [a]
    while stack and len(seen) < limit:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        op = canon(n) or ""
        if n in routed or op in _ARG_ROUTERS or (op == "getitem" and n.args[1:2] == (1,)
                                                  and canon(n.args[0]) in _ROUTERS):
            return True
        v = val(n)
        if n.op in ("call_function", "call_method") and isinstance(v, torch.Tensor) and not v.is_floating_point() \
                and v.dtype != torch.bool:
            stack.extend(n.all_input_nodes)
    return False


def _bodies(gm: fx.GraphModule, example_inputs, routed: frozenset) -> list[CheckpointBody]:
    outer = dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))
    out, seen = [], set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or canon(node) not in HOPS or not node.args:
            continue
        sub = node.args[0]
        if not isinstance(sub, fx.Node) or sub.op != "get_attr" or sub.target in seen:
            continue
        body = getattr(gm, sub.target, None)
        operands = node.args[1:]
        if not isinstance(body, fx.GraphModule) or len(body.graph.find_nodes(op="placeholder")) != len(operands):
            continue
        seen.add(sub.target)
        values = tuple(outer[a] if a in outer else a.meta.get("example_value") if isinstance(a, fx.Node) else a
                       for a in operands)
        holders = body.graph.find_nodes(op="placeholder")
        ids = frozenset(h for h, a in zip(holders, operands) if _topk_indices(a, routed))
        out.append(CheckpointBody(sub.target, body, values, ids))
    return out
