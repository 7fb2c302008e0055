"""hoist_weight_gradients: run each expert weight-gradient GEMM as soon as its inputs exist.

A post_grad pass (``pipeline.PASSES``: ``wgrad_early``) over each ATen graph holding
``moe_compile::grouped_mm_wgrad`` / ``grouped_mm_wgrad_lowp`` nodes (the backward graphs of
rewritten regions). A weight gradient's output is a graph output, alive to the end of the graph
wherever it is computed, while its inputs (the routed rows x_p or the SwiGLU output h, and an
output gradient, each with T*k rows) are freed once it has run. The order AOTAutograd and
Inductor's memory-aware reordering arrive at runs both weight gradients last, after the input
gradient dx is complete, so x_p and dgu are still alive when the largest weight gradient is
allocated. Before (one Qwen3-30B-A3B layer, top-8 of 8192 tokens; MiB of step-allocated memory
alive at the peak: 1664, stock torch.compile 1636)::

    dy_p, dw_r = combine_bwd(dy, y_p, ...)       dy_p 256
    dh   = grouped_mm(dy_p, w_down)
    dgu  = swiglu_bwd(gu, dh)                   dgu 192
    dx_p = grouped_mm(dgu, w_up)                dx_p 256 (freed after the next line)
    dx   = unpermute_combine(dx_p) + router     dx 32, a graph output
    dw_down = grouped_mm_wgrad(h, dy_p)         384
    dw_up   = grouped_mm_wgrad(x_p, dgu)        768  <- peak: dx, dw_down, x_p, dgu alive

After (peak 1632: x_p is freed before dgrad allocates dx_p; dx comes last)::

    dy_p, dw_r = combine_bwd(dy, y_p, ...)
    dw_down = grouped_mm_wgrad(h, dy_p)         h freed
    dh   = grouped_mm(dy_p, w_down)
    dgu  = swiglu_bwd(gu, dh)
    dw_up   = grouped_mm_wgrad(x_p, dgu)        x_p freed
    dx_p = grouped_mm(dgu, w_up)
    dx   = unpermute_combine(dx_p) + router

Only moves nodes, and a weight gradient never moves above a node with side effects (a mutation, a
random op, a collective or anything that is not a plain ATen / moe_compile op), so every value is
unchanged. The GPU work is the same, in another order. Inductor still chooses its own order where
its estimate of that order's peak is lower (``reorder_for_peak_memory`` compares the given order
with its heuristics').
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from moe_compile.passes.normalize import canon

WEIGHT_GRADIENTS = ("moe_compile::grouped_mm_wgrad", "moe_compile::grouped_mm_wgrad_lowp")


def _crossable(node: fx.Node) -> bool:
    """A node a weight gradient may move above: a pure op (no mutation, no randomness, no
    collective or other side effect)."""
    if node.op != "call_function":
        return node.op == "get_attr"
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False  # higher-order ops, Python callables: unknown effects
    if target.namespace not in ("aten", "prims", "moe_compile"):
        return False  # collectives (_c10d_functional), other libraries' ops
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return True


def hoist_weight_gradients(graph: fx.Graph) -> int:
    """Move every weight-gradient node up to just after the last node it reads, stopping below
    the nearest node it may not cross; returns how many moved."""
    moved = 0
    for node in [n for n in graph.nodes if (canon(n) or "") in WEIGHT_GRADIENTS]:
        inputs = set(node.all_input_nodes)
        stop = node.prev
        # walk up until an input of the node or a node it may not cross
        while stop.op != "root" and stop not in inputs and _crossable(stop):
            stop = stop.prev
        if stop is not node.prev:
            stop.append(node)
            moved += 1
    if moved:
        graph.lint()
    return moved
