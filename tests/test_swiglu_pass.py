"""The SwiGLU fusion pass (passes/swiglu.py + lowering/swiglu.py): silu(g) * u on a rewritten
grouped GEMM output becomes moe_compile.swiglu, outputs and every gradient still match eager, and
nothing else is touched (other activations, interleaved gate/up, SwiGLU outside MoE regions)."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from helpers import check_compiled, make_input, make_model
from moe_compile import report
from moe_compile.passes.swiglu import find_swiglu


def _ops(model, x, dtype=torch.float32, **options):
    with report.recording() as graphs:
        check_compiled(model, [x], expect_rewritten=1, options=options or None, fresh_inputs=1)
    recs = [r for g in graphs for r in g if r.status == "rewritten"]
    assert len(recs) == 1
    return recs[0].ops


@pytest.mark.parametrize("weights_moved", [True, False], ids=["weighted", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spelling,expert", [("index_add", "swiglu"), ("where_setitem", "stacked_chunk")])
def test_swiglu_fused(spelling, expert, dtype, weights_moved):
    """The fused op; with the weights_in_swiglu pass (default) it is the weighted one."""
    # bf16 with forced-empty experts is left out: the router bias gradient is then a sum of few
    # cancelling bf16 terms, outside BF16_GRAD_REL with or without this pass
    routing = "empty" if dtype == torch.float32 else "random"
    m = make_model(dtype, h=16, i=12, e=5, k=2, spelling=spelling, expert=expert, routing=routing)
    options = {} if weights_moved else {"moe.disable": ("weights_in_swiglu",)}
    ops = _ops(m, make_input((9, 16), dtype), **options)
    assert ("weighted_swiglu" if weights_moved else "swiglu") in ops, ops


def test_swiglu_disabled_and_other_activations_untouched():
    m = make_model(h=16, i=12, e=4, k=2, spelling="index_add")
    ops = _ops(m, make_input((9, 16)), **{"moe.disable": ("swiglu",)})
    assert "swiglu" not in ops and "weighted_swiglu" not in ops, ops
    for expert in ("gelu_seq", "stacked_interleave", "gptoss"):  # no [g | u] halves + silu
        m = make_model(h=16, i=12, e=4, k=2, spelling="index_add", expert=expert)
        assert "swiglu" not in _ops(m, make_input((9, 16))), expert


def test_swiglu_on_a_plain_linear_is_not_matched():
    """find_swiglu looks at moe_compile grouped GEMM outputs only (the shared expert's SwiGLU inside a
    compiled MoE model: test_finders.test_swiglu_fused_on_rewritten_experts_only)."""
    def f(x, w):
        h = x @ w
        return F.silu(h[:, :4]) * h[:, 4:]

    assert find_swiglu(fx.symbolic_trace(f)) == []
