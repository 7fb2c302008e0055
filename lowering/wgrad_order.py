"""hoist_weight_gradients: run each expert weight-gradient GEMM as soon as its inputs exist.

A post_grad pass (``pipeline.PASSES``: ``wgrad_early``) over each ATen graph Inductor compiles that
holds ``moe_compile::grouped_mm_wgrad`` / ``grouped_mm_wgrad_lowp`` nodes (the backward graphs of
rewritten regions). A weight gradient whose result is returned from the graph as it is (or through
views) stays alive to the end of the graph wherever it is computed, while its inputs (the routed
rows x_p or the SwiGLU output h, and an output gradient, each with T*k rows) can be freed once it
has run. The order AOTAutograd and Inductor's memory-aware reordering arrive at runs both weight
gradients last, after the input gradient dx is complete, so x_p and dgu are still alive when the
largest weight gradient is allocated. Before (one Qwen3-30B-A3B layer, top-8 of 8192 tokens; MiB
allocated in the step and alive at its peak: 1664.6, stock torch.compile 1635.6)::

    dy_p, dw_r = combine_bwd(dy, y_p, ...)       dy_p 256
    dh   = grouped_mm(dy_p, w_down)
    dgu  = swiglu_bwd(gu, dh)                   dgu 192
    dx_p = grouped_mm(dgu, w_up)                dx_p 256 (freed after the next line)
    dx   = unpermute_sum(dx_p) + router         dx 32, a graph output
    dw_down = grouped_mm_wgrad(h, dy_p)         384
    dw_up   = grouped_mm_wgrad(x_p, dgu)        768  <- peak: dx, dw_down, x_p, dgu alive

After (1635.3: x_p is freed before the dgrad allocates dx_p; dx comes last)::

    dy_p, dw_r = combine_bwd(dy, y_p, ...)
    dw_down = grouped_mm_wgrad(h, dy_p)         h freed
    dh   = grouped_mm(dy_p, w_down)
    dgu  = swiglu_bwd(gu, dh)
    dw_up   = grouped_mm_wgrad(x_p, dgu)        x_p freed
    dx_p = grouped_mm(dgu, w_up)
    dx   = unpermute_sum(dx_p) + router

Only moves nodes, so every value is unchanged: a weight gradient moves above plain ATen / prims /
moe_compile ops only, never above a node with side effects (a mutation, a random op, a host sync, a
collective or an expert-parallel op, an assert, a higher-order op or any other Python callable). A
weight gradient whose result feeds anything but the graph's outputs (e.g. a layout copy) stays. The
GPU work is the same, in another order. Inductor only: its ``reorder_for_peak_memory`` compares the
given order's estimated peak with its own heuristics' and keeps the lowest, which checks the move
graph by graph; the aot_eager path (``moe.inductor=False``) runs graphs in their given order with
no such check, so the pass is not run there.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from moe_compile.passes.normalize import canon, op_namespace

WEIGHT_GRADIENTS = ("moe_compile::grouped_mm_wgrad", "moe_compile::grouped_mm_wgrad_lowp")


# ops with no mutable argument that still must keep their place: host syncs (a GEMM moved above one
# would be waited for), asserts, expert-parallel ops (collectives inside)
_PINNED = {"_local_scalar_dense", "nonzero", "_assert_async", "_assert_scalar", "_assert_tensor_metadata",
           "_print", "record_stream"}


def _crossable(node: fx.Node) -> bool:
    """A node a weight gradient may move above: a pure op (no mutation, no randomness, no host
    sync, no collective or other side effect)."""
    if node.op != "call_function":
        return node.op == "get_attr"
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False  # higher-order ops, Python callables: unknown effects
    namespace = op_namespace(target)
    if namespace not in ("aten", "prims", "moe_compile"):
        return False  # collectives and waits (_c10d_functional), stream ops, other libraries' ops
    name = target._overloadpacket.__name__
    if name in _PINNED or (namespace == "moe_compile" and name.startswith("ep_")):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not node.is_impure()


# views the graph may apply to a weight gradient on its way to the outputs (no new buffer)
_VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "squeeze", "unsqueeze", "alias",
          "expand", "as_strided"}


def _only_returned(node: fx.Node) -> bool:
    """The node's value reaches nothing but the graph's outputs, itself or through views: it is
    alive to the end of the graph wherever it is computed, so computing it earlier costs nothing."""
    for user in node.users:
        if user.op == "output":
            continue
        target = user.target
        if not (isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"
                and target._overloadpacket.__name__ in _VIEWS and _only_returned(user)):
            return False
    return True


def hoist_weight_gradients(graph: fx.Graph) -> int:
    """Move every weight-gradient node whose value is only returned up to just after the last node
    it reads, stopping below the nearest node it may not cross; returns how many moved."""
    moved = 0
    for node in [n for n in graph.nodes if (canon(n) or "") in WEIGHT_GRADIENTS and _only_returned(n)]:
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
