"""bf16 expert rows summed into an fp32 output (fp32 routing weights times bf16 expert outputs, as
transformers' DeepSeek-V3 experts and Megatron-style fp32 routers do): the combine reads the rows in
bf16 and sums them in fp32 (``out_dtype``), instead of the graph making an fp32 copy of every row,
which the backward then kept ([T*K, H] fp32 per layer: +0.75 GiB at the step's peak on the
DeepSeek-V3-like model of examples/benchmark/model_step.py, 4 layers, above stock torch.compile's).

Each case compares outputs and every gradient with eager, and records what the combine was called
with: rows in bf16 and an fp32 output, so the copy coming back fails the test. The routing weights
still move into the SwiGLU (weights_in_swiglu), whose unweighted sum keeps the fp32 output.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import BF16_GRAD_REL, BF16_REL, check_compiled
from moe_compile import records
from moe_compile.kernels import registry, reference

BF16 = torch.bfloat16
# fp16 products rounded per row in eager, summed in fp32 by the rewrite (a bf16 accumulator adds its own
# rounding in eager's order): fp16 / bf16 rounding of the rows, 1.9e-4 measured with the fp64 accumulator
FP16_ROWS_REL = 1e-2


@pytest.fixture
def combine_calls(monkeypatch):
    """(op, rows dtype, out_dtype) of every combine the CPU runs while the test does (unpermute_sum is
    also the backward of the rows' gather)."""
    calls = []
    for op in ("unpermute_combine", "unpermute_sum"):
        def rec(y, *args, _op=op):
            calls.append((_op, y.dtype, args[-1]))
            return getattr(reference, _op)(y, *args)
        monkeypatch.setitem(registry._IMPLS, (op, "cpu"), rec)
    return calls


def _assert_bf16_rows_summed_in_fp32(calls):
    """The forward combine read bf16 rows into an fp32 output: the routing weights moved into the
    activation (weights_in_swiglu: an unweighted sum stays fp32), every other combine is the rows'
    gather's backward (bf16 in, bf16 out)."""
    assert ("unpermute_sum", BF16, torch.float32) in calls, calls
    assert set(calls) <= {("unpermute_sum", BF16, torch.float32), ("unpermute_sum", BF16, None)}, calls


class FP32RouterLoop(nn.Module):
    """bf16 ModuleList SwiGLU experts, an fp32 softmax router, an fp32 accumulator; the model casts
    the sum back to bf16 (``out.index_add_(0, tok, y * w)``: bf16 rows times fp32 weights)."""

    def __init__(self, h=16, i=12, e=4, k=2):
        super().__init__()
        self.k = k
        self.gate = nn.Linear(h, e, bias=False)
        self.w1 = nn.ModuleList(nn.Linear(h, i, bias=False) for _ in range(e))
        self.w3 = nn.ModuleList(nn.Linear(h, i, bias=False) for _ in range(e))
        self.w2 = nn.ModuleList(nn.Linear(i, h, bias=False) for _ in range(e))

    def forward(self, x):
        probs = F.linear(x.float(), self.gate.weight.float()).softmax(-1)
        w, ids = torch.topk(probs, self.k)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in range(len(self.w1)):
            tok, slot = torch.where(ids == e)
            xe = x[tok]
            y = self.w2[e](F.silu(self.w1[e](xe)) * self.w3[e](xe))
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out.to(x.dtype)


@pytest.mark.parametrize("tokens,inductor", [(0, False), (1, False), (13, False), (13, True)])
def test_fp32_weighted_loop_combines_bf16_rows(tokens, inductor, combine_calls):
    torch.manual_seed(0)
    m = FP32RouterLoop().to(BF16)
    m.gate.weight.data.normal_(0.0, 0.5)
    x = torch.randn(tokens, 16, dtype=BF16, requires_grad=True)
    check_compiled(m, [x], expect_rewritten=1, fresh_inputs=1 if tokens else 0, inductor=inductor)
    _assert_bf16_rows_summed_in_fp32(combine_calls)


def test_hf_deepseek_v3_bf16_combines_bf16_rows(combine_calls):
    """transformers' DeepSeek-V3 experts: ``proj_out * sample_weights`` with fp32 weights, summed
    over top-k in fp32, cast back to bf16."""
    pytest.importorskip("transformers")
    from test_hf_models import Logits, _ids, build

    check_compiled(Logits(build("deepseek_v3", dtype=BF16)), [_ids()], expect_rewritten=2, rel=BF16_REL,
                   grad_rel=BF16_GRAD_REL, fresh_inputs=0)
    _assert_bf16_rows_summed_in_fp32(combine_calls)


def test_out_dtype_op_matches_a_widened_copy():
    """The op with out_dtype equals the op on ``y.float()``, forward and backward (the row gradient
    rounded to bf16 once, as ``.float()``'s backward rounds it)."""
    torch.manual_seed(0)
    t, k, h, e = 9, 2, 8, 3
    ids = torch.randint(0, e, (t, k))
    ids[0, 0] = e   # a dropped pair
    perm, inv, offs = torch.ops.moe_compile.route_permute(ids, e)
    y = torch.randn(t * k, h, dtype=BF16)
    w = torch.rand(t, k)
    dout = torch.randn(t, h)
    for name, extra in (("unpermute_combine", (inv, None, offs)), ("unpermute_sum", (perm, inv, offs, k))):
        op = getattr(torch.ops.moe_compile, name)
        outs = []
        for wide in (True, False):
            yi = y.clone().requires_grad_()
            wi = w.clone().requires_grad_()
            args = tuple(wi if a is None else a for a in extra)
            got = op(yi, *args, out_dtype=torch.float32) if wide else op(yi.float(), *args)
            got.backward(dout)
            outs.append((got, yi.grad, wi.grad))
        (a, dya, dwa), (b, dyb, dwb) = outs
        assert a.dtype == b.dtype == torch.float32 and dya.dtype == BF16
        assert torch.equal(a, b) and torch.equal(dya, dyb), name
        assert (dwa is None) == (dwb is None) and (dwa is None or torch.equal(dwa, dwb)), name
    with pytest.raises(ValueError, match="unpermute_combine.*out_dtype"):
        torch.ops.moe_compile.unpermute_combine(y.float(), inv, w, offs, out_dtype=BF16)


class FP16RowsLoop(nn.Module):
    """fp16 experts with large outputs, an fp32 router scaled by 8 (a routed scaling factor) and an
    accumulator of ``acc`` dtype: a weighted row sum above fp16's 65504 stays finite in eager."""

    def __init__(self, acc: torch.dtype, h=8, e=4, k=2):
        super().__init__()
        self.k, self.acc = k, acc
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(e)).half()
        with torch.no_grad():
            for ex in self.experts:
                ex.weight.fill_(1000.0)

    def forward(self, x):
        w, ids = self.gate(x.float()).softmax(-1).topk(self.k, -1)
        w = w * 8.0
        out = torch.zeros(x.shape[0], x.shape[1], dtype=self.acc)
        for e in range(len(self.experts)):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, (self.experts[e](x[tok]) * w[tok, slot, None]).to(self.acc))
        return out


@pytest.mark.parametrize("acc,wide", [(torch.bfloat16, torch.float32), (torch.float64, torch.float64)],
                         ids=["bf16_acc", "fp64_acc"])
def test_fp16_rows_into_a_wider_accumulator_are_not_rounded_to_fp16(acc, wide, combine_calls):
    """The sum is not rounded to the rows' fp16 before the accumulator's dtype (it was: all inf, found
    by a review); out_dtype is promote(fp16, acc)."""
    torch.manual_seed(0)
    m = FP16RowsLoop(acc)
    x = (torch.rand(8, 8) * 2.0 + 1.0).half()
    with torch.no_grad():
        ref = m(x)
        torch._dynamo.reset()
        before = dict(records.counters)
        got = torch.compile(m, backend="moe", options={"moe.inductor": False})(x)
    assert records.counters[records.REWRITTEN] - before.get(records.REWRITTEN, 0) == 1
    assert torch.isfinite(ref).all() and ref.abs().max() > 65504
    assert torch.isfinite(got).all(), got
    assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() <= FP16_ROWS_REL
    assert {c[1:] for c in combine_calls} == {(torch.float16, wide)}, combine_calls
