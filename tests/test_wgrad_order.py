"""lowering/wgrad_order.py: each expert weight-gradient GEMM runs as soon as its inputs exist, never
above a node with side effects; values and gradients unchanged."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import moe_compile.kernels.ops  # noqa: F401  (registers every moe_compile op)
from moe_compile.lowering import wgrad_order
from moe_compile.lowering.wgrad_order import hoist_weight_gradients

from helpers import check_compiled, make_input, make_model

aten = torch.ops.aten
WGRAD = torch.ops.moe_compile.grouped_mm_wgrad.default


def _graph(barrier=None):
    """x, dy, offs -> a = mm(x^T, x); [barrier]; b = mm(dy^T, dy); dw = wgrad(x, dy, offs); out."""
    g = fx.Graph()
    x, dy, offs = g.placeholder("x"), g.placeholder("dy"), g.placeholder("offs")
    a = g.call_function(aten.mm.default, (g.call_function(aten.t.default, (x,)), x))
    if barrier is not None:
        barrier(g, a)
    b = g.call_function(aten.mm.default, (g.call_function(aten.t.default, (dy,)), dy))
    dw = g.call_function(WGRAD, (x, dy, offs, 2))
    g.output((a, b, dw))
    return g, dw


def _order(g):
    return [n.name for n in g.nodes]


def test_weight_gradient_moves_up_to_its_inputs():
    g, dw = _graph()
    assert hoist_weight_gradients(g) == 1
    names = _order(g)
    assert names.index(dw.name) == names.index("offs") + 1, names


@pytest.mark.parametrize("barrier", [
    lambda g, a: g.call_function(aten.add_.Tensor, (a, 1.0)),                     # a mutation
    lambda g, a: g.call_function(aten.rand.default, ([2, 2],), {"device": "cpu"}),  # random numbers
    lambda g, a: g.call_function(print, (a,)),                                    # unknown Python callable
])
def test_weight_gradient_never_crosses_a_side_effect(barrier):
    g, dw = _graph(barrier)
    stop = [n for n in g.nodes if n.op == "call_function" and n.target not in (aten.mm.default, aten.t.default, WGRAD)]
    assert len(stop) == 1
    hoist_weight_gradients(g)
    assert dw.prev is stop[0], _order(g)


def test_already_early_weight_gradient_stays():
    g, dw = _graph()
    hoist_weight_gradients(g)
    assert hoist_weight_gradients(g) == 0


def test_backward_weight_gradients_hoisted_and_gradients_match(monkeypatch):
    """The pass runs on the backward graph of a rewritten layer (at least one weight gradient moves)
    and the compiled layer still matches eager in its output and every gradient; with the pass
    disabled nothing moves."""
    moved = []
    real = wgrad_order.hoist_weight_gradients
    monkeypatch.setattr(wgrad_order, "hoist_weight_gradients", lambda graph: moved.append(real(graph)) or moved[-1])
    model = make_model()
    x = make_input((2, 12, 16))
    check_compiled(model, (x,), expect_rewritten=1, inductor=True)
    assert sum(moved) >= 1, moved
    moved.clear()
    check_compiled(model, (x,), expect_rewritten=1, inductor=True, options={"moe.disable": ("wgrad_early",)})
    assert moved == []
