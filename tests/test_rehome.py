"""ModuleList expert weights are re-homed into one buffer per linear after compiling
(lowering/rehome.py): same Parameter objects and values, evenly spaced views of one storage, and
training (with an optimizer created before compiling) matches eager step for step."""
from __future__ import annotations

import copy

import pytest
import torch

import moe_compile
from helpers import FP32_REL, assert_close_rel, make_input, make_model

# four SGD steps of fp32 training, compiled vs eager: each step's gradients differ by ~1e-7 (FP32_REL's
# summation order) and the weights carry it into the next step; 10x margin. Stale expert weights
# (a step behind) differ by ~1e-3.
STEPS_REL = 10 * FP32_REL

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


# ------------------------------------------------------------------------------------------ FSDP2
def body_fsdp2_steps(rank, world_size, compile_blocks):
    """FSDP2 gathers each block's parameters into storage it owns and refills on every all-gather:
    re-homing those parameters would leave the experts reading the first step's weights."""
    from torch.distributed.fsdp import fully_shard

    from test_blocks import LoopLM

    eager = LoopLM(layers=2)
    model = copy.deepcopy(eager)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    if compile_blocks:
        moe_compile.compile_blocks(model, options={"moe.inductor": False})
        fn = model
    else:
        fn = torch.compile(model, backend="moe", options={"moe.inductor": False})
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, model)]
    g = torch.Generator().manual_seed(0)
    before = moe_compile.counters["rewritten"]
    for step in range(4):
        x = torch.randn(12, 16, generator=g)
        outs = []
        for f, opt in zip((eager, fn), opts):
            y = f(x)
            (y * y).mean().backward()
            opt.step()
            opt.zero_grad()
            outs.append(y.detach())
        assert_close_rel(outs[1], outs[0], STEPS_REL, f"FSDP2, step {step}: output")
    assert moe_compile.counters["rewritten"] > before, "the MoE layers were not rewritten"


@pytest.mark.parametrize("compile_blocks", [False, True])
def test_fsdp2_parameters_are_not_rehomed(compile_blocks):
    from dist_utils import run_distributed

    run_distributed(body_fsdp2_steps, 1, compile_blocks)


@pytest.mark.parametrize("case", ["experts_tied_through_data", "user_alias_updated_in_place"])
def test_weights_sharing_their_storage_are_not_rehomed(case):
    """Moving ``.data`` into the buffer would cut a storage tie: two experts tied through ``.data`` came
    apart after the first optimizer step (0.16 relative by step 2), and a user's ``detach()`` alias
    updated in place no longer reached the compiled model (0.32). Those weights stay where they are
    (read in place), and three SGD steps track eager's."""
    torch._dynamo.reset()
    eager = make_model(spelling="index_add", k=2, e=4)
    model = copy.deepcopy(eager)
    for m in (eager, model):
        ex = m.experts.experts
        if case == "experts_tied_through_data":
            ex[1].w1.weight.data = ex[0].w1.weight.data
        else:
            m.alias = ex[0].w1.weight.detach()
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    for step in range(3):
        x = make_input((2, 5, 16), seed=step)
        ref, out = eager(x), compiled(x)
        assert_close_rel(out.detach(), ref.detach(), STEPS_REL, f"{case}: step {step}")
        ref.square().sum().backward()
        out.square().sum().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if case == "user_alias_updated_in_place":
            with torch.no_grad():
                eager.alias.mul_(0.5)
                model.alias.mul_(0.5)
    ws = [e.w1.weight for e in model.experts.experts]
    assert len({w.untyped_storage().data_ptr() for w in ws}) > 1, "the weights were re-homed"


def test_a_bucket_view_is_shared_storage():
    """ZeroRedundancyOptimizer(parameters_as_bucket_view=True) makes each Parameter a view of its
    bucket and broadcasts the buckets: moving such a weight lost the owner rank's updates on the other
    rank (0.30 relative by step 2, 2 gloo ranks)."""
    from moe_compile.lowering.rehome import _shared_storage

    own = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
    assert not _shared_storage(own)
    bucket = torch.zeros(40)
    views = [torch.nn.Parameter(torch.empty(4, 4)) for _ in range(2)]
    for i, p in enumerate(views):
        p.data = bucket[4 + 16 * i: 4 + 16 * (i + 1)].view(4, 4)
    assert _shared_storage(views[:1]) and _shared_storage(views[1:])
