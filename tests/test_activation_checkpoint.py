"""torch.utils.checkpoint around a module compiled with backend="moe" (how transformers' gradient
checkpointing wraps each decoder layer, and how ``compile_blocks`` models train with it): outputs and
every gradient match eager over several steps, reentrant and non-reentrant, and the region is rewritten.

Non-reentrant checkpointing counts the tensors its saved-tensor hooks see in the forward and again when
it recomputes the forward in the backward; the backend compiles inside the first forward, so its passes'
evaluations on fake values must not reach those hooks (moe_compile/backend.py,
``moe_backend`` defers them as AOTAutograd's tracing does): they did, and the first step raised CheckpointError."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint as checkpoint

from helpers import (BF16_GRAD_REL, BF16_REL, FP32_REL, HF_FP32_REL, assert_close_rel, check_compiled, make_input,
                     make_model, tiny_qwen3_moe)
from moe_compile import records

# a few SGD steps of fp32 training (each step's gradients differ by ~1e-7, carried into the next
# step's weights): 10x FP32_REL, as tests/test_expert_stack.py
STEPS_REL = 10 * FP32_REL
LR = 0.05


@pytest.mark.parametrize("reentrant,inductor", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("expert", ["swiglu", "stacked_chunk"])
def test_checkpointed_compiled_module_trains_like_eager(reentrant, inductor, expert):
    torch._dynamo.reset()
    model = make_model(spelling="index_add", expert=expert, e=4, k=2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": inductor})
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    with records.recording() as graphs:
        for step in range(3):
            x = make_input((3, 5, 16), seed=step)
            x_ref = x.detach().clone().requires_grad_()
            out = checkpoint.checkpoint(compiled, x, use_reentrant=reentrant)
            out_ref = checkpoint.checkpoint(ref, x_ref, use_reentrant=reentrant)
            assert_close_rel(out.detach(), out_ref.detach(), STEPS_REL, f"step {step}: output")
            out.square().sum().backward()
            out_ref.square().sum().backward()
            assert_close_rel(x.grad, x_ref.grad, STEPS_REL, f"step {step}: input gradient")
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert_close_rel(p.grad, q.grad, STEPS_REL, f"step {step}: grad of {name}")
            opt.step()
            opt_ref.step()
            opt.zero_grad(set_to_none=True)
            opt_ref.zero_grad(set_to_none=True)
    rewritten = [r for g in graphs for r in g if r.status == records.REWRITTEN]
    assert rewritten, "the MoE region was not rewritten"


class _Checkpointed(torch.nn.Module):
    """torch.utils.checkpoint inside the compiled module: Dynamo traces the region as a
    ``tag_activation_checkpoint`` subgraph, the MoE layer inside it."""

    def __init__(self, inner, reentrant):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        return checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant) * 2.0


@pytest.mark.parametrize("reentrant,inductor", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("expert", ["swiglu", "stacked_chunk"])
def test_moe_inside_a_checkpoint_region_is_rewritten(reentrant, inductor, expert):
    """The passes run on the checkpoint body as on a graph of their own (passes/checkpoint_bodies.py):
    rewritten (one region, the body's ops in its record), outputs and every gradient as eager."""
    model = _Checkpointed(make_model(spelling="index_add", expert=expert, e=4, k=2), reentrant)
    with records.recording() as graphs:
        check_compiled(model, (make_input((3, 5, 16)),), expect_rewritten=1, inductor=inductor, fresh_inputs=2)
    (rec,) = [r for g in graphs for r in g]
    assert rec.status == records.REWRITTEN and "route_permute" in rec.ops, rec


# ----------------------------------------------------------------------------- Hugging Face model
@pytest.mark.parametrize("how", ["whole", "blocks"])
def test_hf_gradient_checkpointing_is_rewritten(how):
    """transformers' gradient checkpointing (each decoder layer in torch.utils.checkpoint) with a
    whole-model compile or ``compile_blocks``: every MoE layer rewritten, the loss and every gradient
    as eager's. Before the passes ran on checkpoint bodies nothing was rewritten ("no MoE layer was
    found")."""
    pytest.importorskip("transformers")
    import moe_compile

    torch._dynamo.reset()
    eager = tiny_qwen3_moe(2)
    model = copy.deepcopy(eager)
    model.gradient_checkpointing_enable()
    opts = {"moe.inductor": False}
    with records.recording() as graphs:
        if how == "whole":
            run = torch.compile(model, backend="moe", options=opts)
        else:
            moe_compile.compile_blocks(model, options=opts)
            run = model
        ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        out = run(input_ids=ids, labels=ids).loss
        out.backward()
    want = eager(input_ids=ids, labels=ids).loss
    want.backward()
    rewritten = [r for g in graphs for r in g if r.status == records.REWRITTEN]
    # compile_blocks: one graph serves both layers, its records published once per layer at its path
    assert sorted(r.module for r in rewritten) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], \
        [(r.status, r.module, r.code) for g in graphs for r in g]
    assert_close_rel(out.detach(), want.detach(), HF_FP32_REL, "loss")
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close_rel(p.grad, q.grad, HF_FP32_REL, f"gradient of {n}")


def test_modulelist_experts_inside_a_checkpoint_region_are_rehomed():
    """After compiling, the ModuleList expert weights the checkpoint body reads are moved into one
    buffer per linear pair (as outside checkpoints: lowering/rehome.py), so the grouped GEMMs read one
    3-D tensor; same Parameter objects, and training still matches eager (the test above)."""
    inner = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    model = _Checkpointed(inner, reentrant=False)
    ids = [id(p) for p in model.parameters()]
    torch._dynamo.reset()
    torch.compile(model, backend="moe", options={"moe.inductor": False})(make_input((3, 5, 16))).sum().backward()
    experts = inner.experts.experts
    for name in ("w1", "w2"):
        storages = {getattr(e, name).weight.untyped_storage().data_ptr() for e in experts}
        assert len(storages) == 1, f"{name}: the experts' weights are not in one buffer"
    assert [id(p) for p in model.parameters()] == ids


@pytest.mark.parametrize("inductor", [False, True])
def test_checkpoint_and_autocast_together(inductor, gemm_dtypes):
    """Gradient checkpointing and bf16 autocast over fp32 weights together (Hugging Face Trainer's usual
    setup): the rewrite inside the checkpoint body casts as autocast does (tests/test_autocast.py), the
    recompute in the backward too; every grouped GEMM in bf16, the outputs and every gradient as
    eager's within the bf16 bounds."""
    torch._dynamo.reset()
    inner = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    ref = copy.deepcopy(inner)
    compiled = torch.compile(_Checkpointed(inner, reentrant=False), backend="moe", options={"moe.inductor": inductor})
    with records.recording() as graphs:
        x = make_input((3, 5, 16))
        x_ref = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = compiled(x), _Checkpointed(ref, reentrant=False)(x_ref)
        got.float().square().sum().backward()
        want.float().square().sum().backward()
    assert [r.status for g in graphs for r in g] == [records.REWRITTEN]
    assert gemm_dtypes and all(d == (torch.bfloat16, torch.bfloat16) for d in gemm_dtypes), gemm_dtypes
    assert_close_rel(got.detach(), want.detach(), BF16_REL, "output")
    for (n, p), q in zip(inner.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        assert_close_rel(p.grad, q.grad, BF16_GRAD_REL, f"gradient of {n}")


@pytest.mark.parametrize("around", [True, False])
def test_cudagraphs_off_only_for_graphs_compiled_inside_a_checkpoint(around, monkeypatch, caplog):
    """CUDA graphs around a graph that a non-reentrant checkpoint recomputes fail in torch
    (pytorch/pytorch#154306, stock torch.compile too; moe_compile/checkpoint_cudagraphs.py): such a
    graph is compiled without them, with one warning naming the fix; a graph compiled outside a
    checkpoint keeps them. (CPU: Inductor skips CUDA graphs for CPU tensors itself; what is checked
    is the flag the backend hands to Inductor, and that training still matches eager.)"""
    import logging

    import torch._inductor.compile_fx as compile_fx_mod

    seen = []
    real = compile_fx_mod.compile_fx

    def spy(gm, inputs, config_patches=None, **kw):
        if config_patches is not None:   # the backend's call (compile_fx calls itself again without patches)
            seen.append(config_patches.get("triton.cudagraphs"))
        return real(gm, inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(compile_fx_mod, "compile_fx", spy)
    torch._dynamo.reset()
    model = make_model(spelling="index_add", e=4, k=2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", options={"triton.cudagraphs": True})
    with caplog.at_level(logging.WARNING, logger="moe_compile"), records.recording() as graphs:
        for step in range(2):
            x = make_input((3, 5, 16), seed=step)
            x_ref = x.detach().clone().requires_grad_()
            out = checkpoint.checkpoint(compiled, x, use_reentrant=False) if around else compiled(x)
            out_ref = ref(x_ref)
            assert_close_rel(out.detach(), out_ref.detach(), STEPS_REL, f"step {step}: output")
            out.square().sum().backward()
            out_ref.square().sum().backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert_close_rel(p.grad, q.grad, STEPS_REL, f"step {step}: grad of {name}")
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
    assert any(r.status == records.REWRITTEN for g in graphs for r in g), "the MoE region was not rewritten"
    assert seen == [not around], seen
    warned = [r for r in caplog.records if "pytorch/pytorch#154306" in r.getMessage()]
    assert len(warned) == (1 if around else 0), [r.getMessage() for r in warned]
