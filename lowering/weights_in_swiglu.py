"""weights_into_swiglu: rewrite each ``passes.weights_in_swiglu.WeightsInSwiGLUMatch``.

Before::

    a = moe_compile.swiglu(h); y = <down>(a, ...); out = moe_compile.unpermute_combine(y, inv, w, offs[, out_dtype])

After::

    a = moe_compile.weighted_swiglu(h, w, perm, offs); y = <down>(a, ...)
    out = moe_compile.unpermute_sum(y, perm, inv, offs, K[, out_dtype])

The new nodes take the old ones' places (the activation at the activation, the sum at the
combine); ``meta["example_value"]`` is computed under the graph's fake mode; the graph is
linted and recompiled. Returns the new nodes, so that explain lists them with their region.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from moe_compile.kernels import ops as _ops  # noqa: F401  (registers the ops)
from moe_compile.passes.weights_in_swiglu import WeightsInSwiGLUMatch

from .graph_edit import GraphBuilder

OPS = torch.ops.moe_compile


def weights_into_swiglu(gm: fx.GraphModule, matches: list[WeightsInSwiGLUMatch]) -> list[tuple[fx.Node, ...]]:
    """Rewrite every match; returns (weighted_swiglu, unpermute_sum) of each, in the matches' order."""
    g = gm.graph
    added = []
    for m in matches:
        mode = GraphBuilder.fake_mode_of(m.swiglu, "weights_into_swiglu")
        h = m.swiglu.args[0]
        act = GraphBuilder(g, m.swiglu, mode, m.swiglu).fn(OPS.weighted_swiglu.default, h, m.weights, m.perm,
                                                           m.combine.args[3])
        m.swiglu.replace_all_uses_with(act)
        g.erase_node(m.swiglu)
        _, inv, _, offs = m.combine.args
        wide = {"out_dtype": m.out_dtype} if m.out_dtype is not None else {}
        total = GraphBuilder(g, m.combine, mode, m.combine).fn(OPS.unpermute_sum.default, m.down, m.perm, inv, offs,
                                                               m.top_k, **wide)
        m.combine.replace_all_uses_with(total)
        g.erase_node(m.combine)
        added.append((act, total))
    if matches:
        g.lint()   # the code is regenerated once, after the last pass (pipeline.run_dynamo_stage)
    return added
