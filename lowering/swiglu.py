"""fuse_swiglu: replace each ``passes.swiglu.SwiGLUMatch`` with one moe_compile.swiglu op.

Before: ``a = silu(h[:, :N]) * h[:, N:]`` on a grouped GEMM output h [M, 2N].
After:  ``a = moe_compile.swiglu(h)`` (fp32 math, one rounding; its backward reads h and da once).
The slices and silu are erased when nothing else reads them; ``meta["example_value"]`` of the new
node is computed under the graph's fake mode; the graph is linted and recompiled.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from moe_compile.kernels import ops as _ops  # noqa: F401  (registers moe_compile::swiglu)
from moe_compile.passes.swiglu import SwiGLUMatch

from .graph_edit import GraphBuilder, eliminate_dead_code


def fuse_swiglu(gm: fx.GraphModule, matches: list[SwiGLUMatch]) -> int:
    """Rewrite every match; returns how many were fused."""
    g = gm.graph
    for m in matches:
        mode = GraphBuilder.fake_mode_of(m.h, "fuse_swiglu")
        node = GraphBuilder(g, m.mul.prev, mode, m.mul).fn(torch.ops.moe_compile.swiglu.default, m.h)
        m.mul.replace_all_uses_with(node)
        g.erase_node(m.mul)
    if matches:
        eliminate_dead_code(g)
        g.lint()   # the code is regenerated once, after the last pass (pipeline.run_dynamo_stage)
    return len(matches)
