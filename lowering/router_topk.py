"""use_router_topk: replace each ``passes.router_topk.TopkMatch`` with moe_compile.router_topk.

Before: ``vals, ids = topk(scores, k, dim=-1)`` read as ``[0]`` / ``[1]`` / ``.values`` / ``.indices``.
After:  ``r = moe_compile.router_topk(scores, k)``; ``r[0]`` / ``r[1]`` (a ``.values`` / ``.indices``
        user becomes the matching ``getitem``), its entries sorted: the order asked for, or, for a
        ``sorted=False`` call (matched only where no reader can see the order), one torch may
        return too. ``meta["example_value"]`` of new nodes is computed under the graph's fake mode;
        the graph is linted and recompiled.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from moe_compile.kernels import ops as _ops  # noqa: F401  (registers moe_compile::router_topk)
from moe_compile.passes.normalize import canon
from moe_compile.passes.router_topk import TopkMatch

from .graph_edit import GraphBuilder, eliminate_dead_code


def use_router_topk(gm: fx.GraphModule, matches: list[TopkMatch]) -> list[fx.Node]:
    """Rewrite every match; returns the new router_topk node of each, in the matches' order."""
    g = gm.graph
    added = []
    for m in matches:
        b = GraphBuilder(g, m.node, GraphBuilder.fake_mode_of(m.scores, "use_router_topk"), m.node)
        new = b.fn(torch.ops.moe_compile.router_topk.default, m.scores, m.k)
        for user in list(m.node.users):
            if canon(user) == "getattr":
                idx = 0 if user.args[1] == "values" else 1
                item = GraphBuilder(g, new, b.mode, user).fn(operator.getitem, new, idx)
                user.replace_all_uses_with(item)
                g.erase_node(user)
            else:
                user.replace_input_with(m.node, new)
        g.erase_node(m.node)
        added.append(new)
    if matches:
        eliminate_dead_code(g)
        g.lint()   # the code is regenerated once, after the last pass (pipeline.run_dynamo_stage)
    return added
