"""moe_compile.compiled_backward: the backward of a rewritten ModuleList layer through compiled
autograd gives every gradient eager gives, and compiled autograd really ran."""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters as dynamo_counters

import moe_compile
from helpers import FP32_REL, ZERO_NORM, assert_close_rel, make_input, make_model


@pytest.mark.parametrize("routing,k", [("random", 2), ("empty", 2), ("hot", 1)])
def test_compiled_backward_matches_eager(routing, k):
    torch._dynamo.reset()
    eager = make_model(h=16, i=12, e=4, k=k, spelling="index_add", expert="swiglu", routing=routing)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    rewritten0 = moe_compile.counters["rewritten"]
    captures0 = dynamo_counters["compiled_autograd"]["captures"]
    for seed in (0, 1):  # the second step reuses the compiled backward
        x = make_input((2, 9, 16), seed=seed)
        x_ref = x.detach().clone().requires_grad_()
        eager.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        cot = torch.randn(2, 9, 16)
        ref = eager(x_ref)
        (ref * cot).sum().backward()
        out = compiled(x)
        with moe_compile.compiled_backward(options={"moe.inductor": False}):
            (out * cot).sum().backward()
        assert_close_rel(out.detach(), ref.detach(), FP32_REL, f"step {seed}: output")
        assert_close_rel(x.grad, x_ref.grad, FP32_REL, f"step {seed}: input grad")
        for (name, p), (_, p_ref) in zip(model.named_parameters(), eager.named_parameters()):
            assert p.grad is not None or p_ref.grad is None or p_ref.grad.norm() < ZERO_NORM, name
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            want = p_ref.grad if p_ref.grad is not None else torch.zeros_like(p_ref)
            assert_close_rel(got, want, FP32_REL, f"step {seed}: grad of {name}")
    assert moe_compile.counters["rewritten"] - rewritten0 == 1
    assert dynamo_counters["compiled_autograd"]["captures"] - captures0 >= 1, "compiled autograd did not run"


def test_compiled_backward_reports_missing_torch_api(monkeypatch):
    from torch._dynamo import compiled_autograd

    monkeypatch.delattr(compiled_autograd, "_enable")
    with pytest.raises(RuntimeError, match="compiled_backward: .*compiled_autograd = True"):
        with moe_compile.compiled_backward():
            pass
