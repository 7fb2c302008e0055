"""ModuleList expert weights are re-homed into one buffer per linear after compiling
(lowering/rehome.py): same Parameter objects and values, evenly spaced views of one storage, and
training (with an optimizer created before compiling) matches eager step for step."""
from __future__ import annotations

import copy

import pytest
import torch

import moe_compile
from helpers import FP32_REL, assert_close_rel, make_input, make_model

STEPS = 3
LR = 0.05


def _storages(model):
    ws = [e.w1.weight for e in model.experts.experts]
    return ws, {w.untyped_storage().data_ptr() for w in ws}


@pytest.mark.parametrize("inductor", [False, True])
def test_rehomed_weights_train_like_eager(inductor):
    torch._dynamo.reset()
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    ref = copy.deepcopy(model)
    params_before = [id(p) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=LR)      # created before compiling, as users do
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": inductor})
    for step in range(STEPS):
        x = make_input((3, 5, 16), seed=step)
        out, out_ref = compiled(x), ref(x.detach().clone().requires_grad_())
        assert_close_rel(out.detach(), out_ref.detach(), FP32_REL, f"step {step}: output")
        out.square().mean().backward()
        out_ref.square().mean().backward()
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close_rel(p.detach(), q.detach(), FP32_REL, f"step {step}: {name} after the update")
    ws, storages = _storages(model)
    assert [id(p) for p in model.parameters()] == params_before, "Parameter objects must be kept"
    assert len(storages) == 1, "expert w1 weights were not re-homed into one buffer"
    # w1 and w3 (siblings: one grouped_mm_list_cat) side by side: [w1_0 | w3_0 | w1_1 | w3_1 ...]
    w3 = [e.w3.weight for e in model.experts.experts]
    n = ws[0].numel()
    assert [w.storage_offset() for w in ws] == [2 * i * n for i in range(len(ws))]
    assert [w.storage_offset() for w in w3] == [(2 * i + 1) * n for i in range(len(w3))]
    assert w3[0].untyped_storage().data_ptr() == ws[0].untyped_storage().data_ptr()


def test_rehome_can_be_disabled_and_is_reported():
    torch._dynamo.reset()
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    _, before = _storages(model)
    torch.compile(model, backend="moe", options={"moe.inductor": False, "moe.rehome_weights": False})(
        make_input((2, 4, 16)))
    assert _storages(model)[1] == before
    # explain() has no side effects: it leaves the weights where they are and says the compile moves them
    report = moe_compile.explain(model, make_input((2, 4, 16)))
    assert report.rewritten and any("one buffer per linear" in n for n in report.rewritten[0].notes), str(report)
    assert _storages(model)[1] == before
