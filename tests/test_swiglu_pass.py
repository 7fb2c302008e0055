"""The SwiGLU fusion pass (passes/swiglu.py + lowering/swiglu.py): silu(g) * u on a rewritten
grouped GEMM output becomes moe_compile.swiglu, outputs and every gradient still match eager, and
nothing else is touched (other activations, interleaved gate/up, SwiGLU outside MoE regions)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from helpers import FP32_REL, check_compiled, make_input, make_model
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


class _ActLoop(torch.nn.Module):
    """A loop MoE layer on stacked weights (gate_up [E, 2I, H], down [E, H, I]) whose activation is
    ``act(h)`` on h = rows @ gate_up[e].T; ``down_dtype``: the down weights' dtype (the rows cast to it
    first); ``wscale``: scales the top-k weights."""

    def __init__(self, act, h=16, i=12, e=5, k=2, down_dtype=None, wscale=1.0):
        super().__init__()
        self.act, self.e, self.k, self.wscale = act, e, k, wscale
        self.router = torch.nn.Linear(h, e)
        self.gate_up = torch.nn.Parameter(torch.randn(e, 2 * i, h) / h ** 0.5)
        self.down = torch.nn.Parameter((torch.randn(e, h, i) / i ** 0.5).to(down_dtype or torch.float32))

    def forward(self, x):
        w, ids = torch.topk(F.softmax(self.router(x), -1, dtype=torch.float32), self.k, -1)
        w = w * self.wscale
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            a = self.act(F.linear(x[tok], self.gate_up[e]))
            y = F.linear(a.to(self.down.dtype), self.down[e])
            out.index_add_(0, tok, (y * w[tok, slot, None]).to(x.dtype))
        return out


def _in_place_product(h):
    g, u = h.chunk(2, dim=-1)
    s = F.silu(g)
    s *= u
    return s


def _in_place_product_seen_by_a_view(h):
    g, u = h.chunk(2, dim=-1)
    s = F.silu(g)
    s0 = s[:, :6]     # a view taken before the write: it sees the product
    s *= u
    return s + torch.cat([s0, s0], -1)


def _in_place_product_into_the_up_half(h):
    g, u = h[:, :12], h[:, 12:]
    u *= F.silu(g)    # writes h: its up half is the product now
    return u + h[:, 12:] * 0.5


def test_in_place_product_read_by_nothing_else_is_fused():
    """``s = silu(g); s *= u`` is the product when nothing else reads s."""
    torch.manual_seed(0)
    ops = _ops(_ActLoop(_in_place_product), make_input((9, 16)))
    assert "weighted_swiglu" in ops, ops


def test_in_place_product_seen_through_a_view_is_not_fused():
    """``s *= u`` writes s, and a view of s taken before the write sees the product: the fused op (a
    new tensor) was put in place of the write, the view kept silu(g) (output 2.3 off, every gradient
    0.5-5 off, reported rewritten; review helper-61). Now the layer is rewritten without the fusion."""
    torch.manual_seed(0)
    ops = _ops(_ActLoop(_in_place_product_seen_by_a_view), make_input((9, 16)))
    assert "swiglu" not in ops and "weighted_swiglu" not in ops, ops


def test_in_place_product_into_the_gemm_output_is_not_fused():
    """``u *= silu(g)`` with u a view of h writes h (no_grad only: eager's backward refuses it): the
    fused op left h unwritten, so a later read of its up half saw u (output 1.2-1.8 off)."""
    torch.manual_seed(0)
    model = _ActLoop(_in_place_product_into_the_up_half)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend="moe", options={"moe.inductor": False})
    for t in (9, 1, 0):
        x = make_input((t, 16))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=FP32_REL, atol=FP32_REL)


# an fp16 down projection: the rows are rounded to fp16 once on either side; moving the weights (1e-6)
# into the fp32 activation before that cast was 6e-2 - 1.2e-1 off (underflow), inf at large weights
FP16_DOWN_REL = 1e-3


@pytest.mark.parametrize("wscale,grads", [(1e-6, True), (300.0, False)])
def test_weights_stay_out_of_an_activation_cast_to_fp16(wscale, grads):
    """The fp32 activation cast to fp16 before an fp16 down projection: the weights must not be
    applied before that cast (fp16's range; the check looked at the activation's dtype only). At
    large weights the output only: the fp16 down weights' gradient overflows in eager too."""
    torch.manual_seed(0)
    model = _ActLoop(lambda h: F.silu(h[:, :12]) * h[:, 12:], down_dtype=torch.float16, wscale=wscale)
    x = make_input((9, 16)) * (30.0 if wscale > 1 else 1.0)
    with report.recording() as graphs:
        check_compiled(model, [x], expect_rewritten=1, rel=FP16_DOWN_REL, grad_rel=FP16_DOWN_REL, fresh_inputs=1,
                       grads=grads)
    ops = [r.ops for g in graphs for r in g if r.status == "rewritten"][0]
    assert "swiglu" in ops and "weighted_swiglu" not in ops, ops
