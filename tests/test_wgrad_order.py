"""lowering/wgrad_order.py: each expert weight-gradient GEMM runs as soon as its inputs exist, never
above a node with side effects; values and gradients unchanged; Inductor only."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

import moe_compile.kernels.ops  # noqa: F401  (registers every moe_compile op)
from moe_compile.lowering import wgrad_order
from moe_compile.lowering.wgrad_order import hoist_weight_gradients

from helpers import check_compiled, make_input, make_model

aten = torch.ops.aten
WGRAD = torch.ops.moe_compile.grouped_mm_wgrad.default


def _graph(barrier=None, computed_input=False, wgrad_user=None):
    """x, dy, offs -> [dy = the first output of var_mean(dy)]; a = mm(x^T, x); [barrier];
    b = mm(dy^T, dy); dw = wgrad(x, dy, offs); out (a, b, dw or wgrad_user(dw))."""
    g = fx.Graph()
    x, dy, offs = g.placeholder("x"), g.placeholder("dy"), g.placeholder("offs")
    if computed_input:
        pair = g.call_function(aten.var_mean.correction, (dy,), {"dim": [0], "keepdim": True})
        dy = g.call_function(aten.add.Tensor, (dy, g.call_function(operator.getitem, (pair, 0))))
    a = g.call_function(aten.mm.default, (g.call_function(aten.t.default, (x,)), x))
    if barrier is not None:
        barrier(g, a)
    b = g.call_function(aten.mm.default, (g.call_function(aten.t.default, (dy,)), dy))
    dw = g.call_function(WGRAD, (x, dy, offs, 2))
    g.output((a, b, dw if wgrad_user is None else wgrad_user(g, dw)))
    return g, dw, dy


def _order(g):
    return [n.name for n in g.nodes]


def test_weight_gradient_moves_up_to_its_inputs():
    g, dw, _ = _graph()
    assert hoist_weight_gradients(g) == 1
    names = _order(g)
    assert names.index(dw.name) == names.index("offs") + 1, names


def test_weight_gradient_stops_right_below_a_computed_input():
    g, dw, dy = _graph(computed_input=True)
    assert hoist_weight_gradients(g) == 1
    assert dw.prev is dy, _order(g)


def _auto_functionalized(g, a):
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    return g.call_function(auto_functionalized, (aten.add_.Tensor,), {"self": a, "other": a})


BARRIERS = {
    "mutation": lambda g, a: g.call_function(aten.add_.Tensor, (a, 1.0)),
    "copy_": lambda g, a: g.call_function(aten.copy_.default, (a, a)),
    "random": lambda g, a: g.call_function(aten.rand.default, ([2, 2],), {"device": "cpu"}),
    "host sync": lambda g, a: g.call_function(aten._local_scalar_dense.default, (a,)),
    "collective wait": lambda g, a: g.call_function(torch.ops._c10d_functional.wait_tensor.default, (a,)),
    "higher-order op": _auto_functionalized,
    "effect token sink": lambda g, a: g.call_function(torch.ops.prims._sink_tokens.default, ([a],)),
    "expert-parallel op": lambda g, a: g.call_function(torch.ops.moe_compile.ep_plan.default, (a, 2, 2)),
    "Python callable": lambda g, a: g.call_function(print, (a,)),
    "method call": lambda g, a: g.call_method("add_", (a, 1.0)),
}


@pytest.mark.parametrize("barrier", list(BARRIERS))
def test_weight_gradient_never_crosses_a_side_effect(barrier):
    g, dw, _ = _graph(BARRIERS[barrier])
    stop = [n for n in g.nodes if n.op in ("call_function", "call_method")
            and n.target not in (aten.mm.default, aten.t.default, WGRAD)]
    assert len(stop) == 1
    hoist_weight_gradients(g)
    assert dw.prev is stop[0], _order(g)


def test_weight_gradient_feeding_a_copy_stays():
    """Its value feeds more than the outputs (a layout copy): computing it earlier would keep its
    buffer alive longer, so it stays; through views to the output it moves."""
    g, dw, _ = _graph(wgrad_user=lambda g, dw: g.call_function(aten.clone.default, (dw,)))
    assert hoist_weight_gradients(g) == 0
    g, dw, _ = _graph(wgrad_user=lambda g, dw: g.call_function(aten.permute.default, (dw, [0, 2, 1])))
    assert hoist_weight_gradients(g) == 1


def test_already_early_weight_gradient_stays():
    g, _, _ = _graph()
    hoist_weight_gradients(g)
    assert hoist_weight_gradients(g) == 0


@pytest.mark.parametrize("inductor", [True, False])
def test_backward_weight_gradients_hoisted_and_gradients_match(monkeypatch, no_compile_cache, inductor):
    """Under Inductor the pass runs on the backward graph of a rewritten layer (at least one weight
    gradient moves); in the aot_eager path (no memory-aware reordering to check it) it does not run;
    with it disabled nothing moves. Output and every gradient match eager each time."""
    moved = []
    real = wgrad_order.hoist_weight_gradients
    monkeypatch.setattr(wgrad_order, "hoist_weight_gradients", lambda graph: moved.append(real(graph)) or moved[-1])
    model = make_model()
    x = make_input((2, 12, 16))
    check_compiled(model, (x,), expect_rewritten=1, inductor=inductor)
    assert (sum(moved) >= 1) if inductor else moved == [], moved
    moved.clear()
    check_compiled(model, (x,), expect_rewritten=1, inductor=inductor, options={"moe.disable": ("wgrad_early",)})
    assert moved == []
