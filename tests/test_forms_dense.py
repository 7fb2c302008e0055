"""Dense expert forms of issue 12: routing weights that scale the expert INPUT (Llama 4), and retrieval
experts (Doge's product-key embedding experts).

    h = x.repeat(E, 1) * sigmoid(full(-inf).scatter_(1, ids, s)).transpose(0, 1).reshape(-1, 1)
    out = bmm-experts(h.view(E, T, H)).view(-1, H).reshape(E, T, H).sum(0)

is rewritten to routed compute that weights each pair's permuted input row before the expert and
combines with weight 1 (expert(x * w) != w * expert(x) for a nonlinear expert); it is exact only when
the expert maps the zero rows of unselected pairs to zero, so an expert with a bias or an activation
with f(0) != 0 is refused (``dense_input_nonzero``). Retrieval experts are refused with
``retrieval_experts`` (one vector per expert: nothing to group).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphs import check_all, dynamo_graph
from helpers import BF16_GRAD_REL, BF16_REL, HF_FP32_REL, check_compiled, make_input
from moe_compile.passes.legality import Accepted, Refusal

FP32, BF16 = torch.float32, torch.bfloat16


class InputWeightedMoE(nn.Module):
    """Llama 4's MoE written out: every token through every expert, the router scores scaling the input."""

    def __init__(self, h=16, i=12, e=4, k=2, act="silu", shift=False):
        super().__init__()
        self.h, self.e, self.k, self.act = h, e, k, act
        self.router = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.randn(e, h, 2 * i) / math.sqrt(h))
        self.down = nn.Parameter(torch.randn(e, i, h) / math.sqrt(i))
        self.shift = shift

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, self.h)
        logits = self.router(x)
        top, ids = torch.topk(logits, self.k, dim=1)
        scores = torch.sigmoid(torch.full_like(logits, float("-inf")).scatter_(1, ids, top).float()).to(x.dtype)
        h = x.repeat(self.e, 1) * scores.transpose(0, 1).reshape(-1, 1)
        h = torch.bmm(h.view(self.e, -1, self.h), self.gate_up)
        if self.shift:  # expert(0) != 0
            h = h + 0.5
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) if self.act == "silu" else torch.sigmoid(gate)
        y = torch.bmm(up * a, self.down).view(-1, self.h)
        return y.reshape(self.e, -1, self.h).sum(dim=0).view(shape)


def _model(dtype=FP32, **kw):
    torch.manual_seed(0)
    return InputWeightedMoE(**kw).to(dtype)


def _verdict(model, x):
    (v,) = check_all(dynamo_graph(("fn", model, (x,)))[0])
    return v


def test_input_weighted_dense_found():
    v = _verdict(_model(), torch.randn(9, 16))
    assert isinstance(v, Accepted), v
    r = v.region.router
    assert r.scale_input and r.per_expert and (r.top_k, r.num_experts) == (2, 4)
    assert v.region.form.startswith("dense/")


@pytest.mark.parametrize("kw", [{"shift": True}, {"act": "sigmoid"}], ids=["shift", "sigmoid-gate"])
def test_input_weighted_dense_nonzero_expert_refused(kw):
    """expert(0) != 0: the unselected pairs contribute, a routed rewrite would drop them."""
    v = _verdict(_model(**kw), torch.randn(9, 16))
    assert isinstance(v, Refusal) and v.code == "dense_input_nonzero" and v.fix, v


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_input_weighted_dense_matches_eager(dtype):
    check_compiled(_model(dtype), [make_input((2, 7, 16), dtype)], expect_rewritten=1)


def test_input_weighted_dense_inductor():
    check_compiled(_model(), [make_input((2, 7, 16))], expect_rewritten=1, inductor=True)


def test_input_weighted_refused_runs_as_written():
    check_compiled(_model(shift=True), [make_input((2, 7, 16))], expect_rewritten=0, expect_refused=1)


# ------------------------------------------------------------------ Hugging Face models
transformers = pytest.importorskip("transformers")
from test_forms_hf_eager import _ids, build  # noqa: E402
from test_hf_models import Logits  # noqa: E402


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_llama4_rewritten_matches_eager(dtype):
    low = dtype == BF16
    check_compiled(Logits(build("llama4", dtype=dtype)), [_ids()], expect_rewritten=1,
                   rel=BF16_REL if low else HF_FP32_REL, grad_rel=BF16_GRAD_REL if low else HF_FP32_REL,
                   fresh_inputs=0)


def test_doge_retrieval_experts_refused():
    model = build("doge")
    moe = next(m for m in model.modules() if type(m).__name__ == "DogeCDMoE")
    v = _verdict(moe, torch.randn(2, 8, moe.hidden_size))
    assert isinstance(v, Refusal) and v.code == "retrieval_experts" and "nothing to fix" in v.fix, v
    assert (v.num_experts, v.top_k) == (moe.num_experts, moe.top_k)


def test_doge_refused_not_silent_end_to_end():
    """The whole model (forward: its compiled backward fails with stock aot_eager too, a torch issue):
    one refused record for its MoE layer, logits as eager."""
    from moe_compile import report

    model = build("doge")
    torch._dynamo.reset()
    compiled = torch.compile(Logits(copy.deepcopy(model)), backend="moe", options={"moe.inductor": False})
    with torch.no_grad(), report.recording() as graphs:
        got, ref = compiled(_ids()), Logits(model)(_ids())
    records = [r for g in graphs for r in g]
    assert [(r.status, r.code) for r in records] == [("refused", "retrieval_experts")], records
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


class BroadcastInputDense(nn.Module):
    """The dense form (every token through every expert, a routing matrix, sum over the experts) whose
    expanded input is a [T, 1] column broadcast to [E, T, H]: the rewrite's rows would be [T, 1]. It
    failed in the lowering (a compile error the backend reported) before the form checked the width."""

    def __init__(self, h=8, i=6, e=4, k=2):
        super().__init__()
        self.e, self.h, self.k = e, h, k
        self.router = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.randn(e, h, 2 * i) / math.sqrt(h))
        self.down = nn.Parameter(torch.randn(e, i, h) / math.sqrt(i))

    def forward(self, x):
        t = x.shape[0]
        w, ids = self.router(x).softmax(-1).topk(self.k, -1)
        r = torch.zeros(t, self.e).scatter(1, ids, w)
        col = x.mean(-1, keepdim=True)                       # [T, 1]
        h = torch.bmm(col.unsqueeze(0).expand(self.e, t, self.h), self.gate_up)
        g, u = h.chunk(2, dim=-1)
        return (torch.bmm(F.silu(g) * u, self.down) * r.t().unsqueeze(-1)).sum(0)


def test_dense_input_broadcast_from_one_column_is_not_taken_for_the_tokens():
    from moe_compile import report

    torch.manual_seed(0)
    with report.recording() as graphs:
        check_compiled(BroadcastInputDense(), [make_input((10, 8))], expect_rewritten=0, expect_refused=1)
    codes = [r.code for g in graphs for r in g]
    assert codes and not {"compile_error", "lowering_error", "matcher_error"} & set(codes), codes
