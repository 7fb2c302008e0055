"""torch.autocast around a MoE layer whose expert weights are fp32 (mixed precision, what Hugging Face
Trainer's bf16=True does): the expert products run in bf16 in eager, and the grouped GEMMs that would
replace them are custom ops, which autocast passes through, so a rewrite would compute them in fp32
(other values than eager's, and far slower on a GPU). Until the rewrite reproduces autocast's casts the
region is refused (``autocast_gemm``, passes/legality.py), logged with the fix, and compiled as
written: outputs and every gradient as eager under autocast. With the weights already in the compute
dtype autocast changes nothing and the region is rewritten."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from helpers import BF16_GRAD_REL, BF16_REL, assert_close_rel, make_input, make_model
from moe_compile import records

# refused regions compile as written: with moe.inductor=False (AOTAutograd, eager kernels) the same
# kernels run in the same order as eager, so outputs and gradients agree to the last bit in practice;
# the bound is loose on purpose (a refusal must not be mistaken for a rewrite by a tight value check:
# the assertion on the records does that)
AS_WRITTEN_REL = 1e-6


def _step(fn, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(x)
    out.float().square().sum().backward()
    return out.detach()


@pytest.mark.parametrize("expert", ["swiglu", "stacked_chunk"])
def test_fp32_weights_under_autocast_are_refused_and_run_as_written(expert, caplog):
    torch._dynamo.reset()
    model = make_model(spelling="index_add", expert=expert, e=4, k=2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    with records.recording() as graphs, caplog.at_level(logging.WARNING, logger="moe_compile"):
        for step in range(2):
            x = make_input((3, 5, 16), seed=step)
            x_ref = x.detach().clone().requires_grad_()
            got, want = _step(compiled, x), _step(ref, x_ref)
            assert got.dtype == want.dtype
            assert_close_rel(got, want, AS_WRITTEN_REL, f"step {step}: output")
            assert_close_rel(x.grad, x_ref.grad, AS_WRITTEN_REL, f"step {step}: input gradient")
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert p.grad.dtype == q.grad.dtype == torch.float32
                assert_close_rel(p.grad, q.grad, AS_WRITTEN_REL, f"step {step}: grad of {name}")
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
    recs = [r for g in graphs for r in g]
    assert [(r.status, r.code) for r in recs] == [(records.REFUSED, "autocast_gemm")], recs
    assert "bfloat16 on float32 operands" in recs[0].reason and "model.to(torch.bfloat16)" in recs[0].fix
    assert sum("autocast_gemm" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_bf16_weights_under_autocast_are_rewritten():
    """Weights already bf16: autocast casts nothing, the region is rewritten and matches eager."""
    torch._dynamo.reset()
    model = make_model(torch.bfloat16, spelling="index_add", expert="swiglu", e=4, k=2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    with records.recording() as graphs:
        x = make_input((3, 5, 16), torch.bfloat16)
        x_ref = x.detach().clone().requires_grad_()
        got, want = _step(compiled, x), _step(ref, x_ref)
    assert [r.status for g in graphs for r in g] == [records.REWRITTEN]
    assert_close_rel(got, want, BF16_REL, "output")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_rel(p.grad, q.grad, BF16_GRAD_REL, f"grad of {name}")
