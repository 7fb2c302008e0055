"""backend="moe" end to end on CUDA: the plain-loop layers compiled with Inductor and the CUDA
kernels, outputs and every gradient against eager, the rewrite counted, and ModuleList expert
weights re-homed so the grouped GEMMs read them as one strided 3-D operand. Skipped without a GPU.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from helpers import check_compiled, make_input, make_model  # noqa: E402
from moe_compile.kernels import ops  # noqa: E402

# bf16 layers through Inductor + the CUDA kernels vs bf16 eager: same reasons as helpers.BF16_REL /
# BF16_GRAD_REL (fp32 accumulation and one rounding vs eager's per-expert roundings), used as is.


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("routing,k", [("random", 2), ("empty", 2), ("hot", 2), ("random", 1)])
@pytest.mark.parametrize("spelling", ["where_setitem", "index_add"])
def test_loop_layer_cuda(spelling, routing, k, dtype):
    # H, I multiples of 8 (CUTLASS alignment for bf16) and odd token count (not a tile multiple)
    model = make_model(dtype, h=64, i=48, e=8, k=k, spelling=spelling, routing=routing).cuda()
    x = make_input((37, 64), dtype).cuda().detach().requires_grad_()
    check_compiled(model, [x], expect_rewritten=1, inductor=True, fresh_inputs=2)


def test_loop_weights_rehomed_cuda():
    """After compiling, w1|w3 of all experts are side by side in one buffer and w2 in another:
    the ops see zero-copy stacked views (one grouped GEMM each, no per-step copy)."""
    model = make_model(torch.bfloat16, h=64, i=48, e=8, k=2).cuda()
    x = make_input((40, 64), torch.bfloat16).cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe")
    compiled(x).sum().backward()
    ex = model.experts.experts
    w1, w3, w2 = [e.w1.weight for e in ex], [e.w3.weight for e in ex], [e.w2.weight for e in ex]
    assert ops.pair_view(w1, w3, transposed=True) is not None
    assert ops.strided_stack(w2) is not None
    assert all(w.grad is not None and w.grad.shape == w.shape and w.grad.stride() == w.stride() for w in w1 + w2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loop_layer_cuda_graphs(dtype, monkeypatch):
    """The same layer under Inductor's CUDA graphs (what mode="reduce-overhead" turns on): replays
    on fresh inputs must match eager, so nothing the kernels launch may depend on host state that a
    replay does not refresh (the TMA descriptors are built from the static buffers at capture)."""
    from moe_compile.kernels import _triton_tma

    tma_calls = []
    real = _triton_tma.grouped_mm
    monkeypatch.setattr(_triton_tma, "grouped_mm", lambda *a: tma_calls.append(1) or real(*a))
    model = make_model(dtype, h=64, i=48, e=8, k=2).cuda()
    x = make_input((37, 64), dtype).cuda().detach().requires_grad_()
    check_compiled(model, [x], expect_rewritten=1, inductor=True, fresh_inputs=3,
                   options={"triton.cudagraphs": True})
    sm90 = torch.cuda.get_device_capability()[0] == 9
    # bf16 on Hopper goes through the TMA grouped GEMM (a silent fallback would fail here)
    assert bool(tma_calls) == (sm90 and dtype == torch.bfloat16), len(tma_calls)


@pytest.mark.parametrize("cudagraphs,set_to_none", [(False, True), (False, False), (True, True)])
def test_stacked_experts_train_cuda(cudagraphs, set_to_none):
    """ModuleList experts enter the graph as one stacked input per buffer (one autograd leaf whose
    gradient is handed to the Parameters), with and without CUDA graphs: three SGD steps match eager
    in every output and gradient, and the gradients came from the hand-over. (CUDA graphs with
    ``zero_grad(set_to_none=False)``: gradients kept across steps live in the graphs' memory pool;
    stock torch.compile raises "accessing tensor output of CUDAGraphs that has been overwritten"
    there too, on torch 2.11, so that case is not ours to test.)"""
    import copy

    from moe_compile import records
    from test_expert_stack import _handed_over, _stacked, _train

    model = make_model(torch.float32, h=64, i=48, e=8, k=2, spelling="index_add").cuda()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe", options={"triton.cudagraphs": cudagraphs})
    with records.recording() as graphs:
        _train(model, ref, compiled, steps=3, set_to_none=set_to_none, shape=(4, 9, 64))
    assert _stacked(graphs)
    assert _handed_over(model) or not set_to_none


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inside,reentrant", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("expert", ["swiglu", "stacked_chunk"])
def test_activation_checkpoint_cuda(expert, inside, reentrant, dtype, monkeypatch):
    """torch.utils.checkpoint inside the compiled module (the rewrite runs in the checkpoint body and
    the backward recomputes its ops) or around it, Inductor and the CUDA kernels: outputs and every
    gradient as eager, the region rewritten, and bf16 on Hopper through the TMA grouped GEMM (for
    ModuleList experts too: the body's weights are re-homed into one buffer)."""
    import torch.utils.checkpoint as checkpoint

    from moe_compile.kernels import _triton_tma

    tma_calls = []
    real = _triton_tma.grouped_mm
    monkeypatch.setattr(_triton_tma, "grouped_mm", lambda *a: tma_calls.append(1) or real(*a))

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint.checkpoint(self.inner, x, use_reentrant=reentrant) * 2.0

    inner = make_model(dtype, h=64, i=48, e=8, k=2, spelling="index_add", expert=expert).cuda()
    x = make_input((37, 64), dtype).cuda().detach().requires_grad_()
    if inside:
        check_compiled(Checkpointed(inner), [x], expect_rewritten=1, inductor=True, fresh_inputs=2)
    else:   # around: the compiled module is the checkpointed function
        import copy

        from helpers import BF16_GRAD_REL, BF16_REL, FP32_REL, assert_close_rel

        torch._dynamo.reset()
        ref = copy.deepcopy(inner)
        compiled = torch.compile(inner, backend="moe")
        low = dtype == torch.bfloat16
        for step in range(2):
            xs = make_input((37, 64), dtype, seed=step).cuda().detach().requires_grad_()
            xr = xs.detach().clone().requires_grad_()
            out = checkpoint.checkpoint(compiled, xs, use_reentrant=reentrant)
            want = checkpoint.checkpoint(ref, xr, use_reentrant=reentrant)
            assert_close_rel(out.detach(), want.detach(), BF16_REL if low else FP32_REL, f"step {step}: output")
            out.float().square().sum().backward()
            want.float().square().sum().backward()
            for (n, p), q in zip(inner.named_parameters(), ref.parameters()):
                assert_close_rel(p.grad, q.grad, BF16_GRAD_REL if low else FP32_REL, f"step {step}: grad of {n}")
            inner.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
    sm90 = torch.cuda.get_device_capability()[0] == 9
    assert bool(tma_calls) == (sm90 and dtype == torch.bfloat16), len(tma_calls)


@pytest.mark.parametrize("expert", ["swiglu", "stacked_chunk", "gptoss"])
def test_autocast_fp32_weights_cuda(expert, monkeypatch):
    """torch.autocast(bf16) over fp32 expert weights on CUDA, Inductor: rewritten with autocast's casts
    (the stacked or 3-D weights cast once), the grouped GEMMs in bf16 (the TMA kernel on Hopper), the
    outputs and every fp32 gradient as eager's under autocast; GPT-OSS's ``x @ W[e] + b[e]`` with each
    row's fp32 bias added after the bf16 GEMM (lowering/region.py, ``_add_group_bias``)."""
    import copy

    from helpers import BF16_GRAD_REL, BF16_REL, assert_close_rel
    from moe_compile import records
    from moe_compile.kernels import _triton_tma

    tma_calls = []
    real = _triton_tma.grouped_mm
    monkeypatch.setattr(_triton_tma, "grouped_mm", lambda *a: tma_calls.append(a[0].dtype) or real(*a))
    model = make_model(torch.float32, h=64, i=48, e=8, k=2, spelling="index_add", expert=expert).cuda()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe")
    with records.recording() as graphs:
        for step in range(2):
            x = make_input((37, 64), seed=step).cuda().detach().requires_grad_()
            xr = x.detach().clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out, want = compiled(x), ref(xr)
            out.float().square().sum().backward()
            want.float().square().sum().backward()
            assert out.dtype == want.dtype
            assert_close_rel(out.detach(), want.detach(), BF16_REL, f"step {step}: output")
            assert_close_rel(x.grad, xr.grad, BF16_GRAD_REL, f"step {step}: input gradient")
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                assert p.grad.dtype == torch.float32
                assert_close_rel(p.grad, q.grad, BF16_GRAD_REL, f"step {step}: grad of {n}")
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
    assert [r.status for g in graphs for r in g] == [records.REWRITTEN]
    if torch.cuda.get_device_capability()[0] == 9:
        assert tma_calls and set(tma_calls) == {torch.bfloat16}, tma_calls


def test_cuda_graphs_with_checkpointed_compiled_layers_cuda(caplog):
    """transformers' gradient checkpointing (non-reentrant) with per-layer compiles and CUDA graphs:
    torch 2.11 raises "graph recording observed an input tensor deallocate ..." on the first step
    when the backward recomputes a CUDA-graphed graph called inside a checkpoint (pytorch/pytorch
    #154306; stock torch.compile too, measured on an H200 with one to four layers). The backend
    compiles those graphs without CUDA graphs and warns once: three steps run, each layer is
    rewritten, and every gradient matches eager. transformers >= 5.2x checkpoints the layer's
    ``forward`` (inside the compiled call: Dynamo traces the checkpoint, CUDA graphs stay on, no
    warning); earlier versions checkpoint ``__call__``, around the compiled call."""
    import copy
    import logging

    import moe_compile
    from transformers.modeling_layers import GradientCheckpointingLayer
    from helpers import HF_FP32_REL, assert_close_rel, tiny_qwen3_moe
    from moe_compile import records

    torch._dynamo.reset()
    model = tiny_qwen3_moe(2).cuda()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    moe_compile.compile_blocks(model, options={"triton.cudagraphs": True})
    gen = torch.Generator(device="cuda").manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="moe_compile"), records.recording() as graphs:
        for step in range(3):
            ids = torch.randint(0, 64, (2, 16), device="cuda", generator=gen)
            torch.compiler.cudagraph_mark_step_begin()
            loss = model(input_ids=ids, labels=ids).loss
            want = ref(input_ids=ids, labels=ids).loss
            loss.backward()
            want.backward()
            assert_close_rel(loss.detach(), want.detach(), HF_FP32_REL, f"step {step}: loss")
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                assert_close_rel(p.grad, q.grad, HF_FP32_REL, f"step {step}: grad of {n}")
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
    assert any(r.status == records.REWRITTEN for g in graphs for r in g), "no MoE region was rewritten"
    around = "__call__" in vars(GradientCheckpointingLayer)   # the checkpoint wraps the compiled call
    assert sum("pytorch/pytorch#154306" in r.getMessage() for r in caplog.records) == int(around)


@pytest.mark.parametrize("router", ["sorted_first_slot_weight", "sorted_first_slot_top1"])
def test_sorted_topk_read_by_position_with_ties_cuda(router, monkeypatch):
    """Experts 0 and 1 tied on every token and a sorted topk whose first entry is read (``w[..., :1]``,
    ``ids[:, :1]``): torch.topk's CUDA kernel orders tied entries its own way (1, 0 on an H200, where
    the router_topk op's kernel gives 0, 1), so the call stays torch.topk and the compiled layer
    matches eager. Forced to swap it, the layer no longer matches where the two orders differ."""
    import test_router_topk as rt
    from moe_compile.passes import router_topk as router_topk_pass

    def build():
        return rt._tied_first_experts(rt._with_router(rt._ROUTERS[router])).cuda()

    x = make_input((2, 5, 16)).cuda()
    check_compiled(build(), [x], expect_rewritten=1, inductor=True, fresh_inputs=1)
    model = build()
    with torch.no_grad():
        scores = torch.softmax(model.router.proj(x.reshape(-1, 16)), -1)
    if torch.equal(torch.topk(scores, 2)[1], ops.router_topk(scores, 2)[1]):
        pytest.skip("torch.topk and the op order these ties alike on this GPU")
    monkeypatch.setattr(router_topk_pass, "_readers_see_no_order", lambda *a: True)
    with pytest.raises(AssertionError, match="output|grad"):
        check_compiled(build(), [x], expect_rewritten=1, inductor=True, fresh_inputs=0)


@pytest.mark.parametrize("cudagraphs", [False, True])
@pytest.mark.parametrize("tokens", [1, 37, 300])
@pytest.mark.parametrize("i", [128, 2880])
@pytest.mark.parametrize("layer", ["TitanLayer", "TitanV2Layer"])
def test_torchtitan_layer_cuda(layer, i, tokens, cudagraphs, monkeypatch):
    """examples/benchmark/moe_layer.py's torchtitan layers (bf16 weights, w1 / w3 separate [E, I, H]
    Parameters), Inductor and the CUDA kernels, against eager: outputs and every gradient; on Hopper the
    w1 / w3 pair runs as grouped_mm_halves forward and one grouped_mm_cat_dx launch backward (a silent
    fallback fails). I 2880: GPT-OSS-20B's width, which no 128- or 256-column tile divides."""
    import os

    from moe_compile.kernels import _triton_tma

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "examples", "benchmark"))
    import moe_layer

    calls = []
    for name in ("grouped_mm_halves", "grouped_mm_cat_dx"):
        real = getattr(_triton_tma, name)
        monkeypatch.setattr(_triton_tma, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    torch.manual_seed(23)
    h, e, k = 64, 4, 2
    model = getattr(moe_layer, layer)(h, i, e, k).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    model = model.bfloat16()
    x = make_input((tokens, h), torch.bfloat16).cuda().detach().requires_grad_()
    check_compiled(model, [x], expect_rewritten=1, inductor=True, fresh_inputs=1,
                   options={"triton.cudagraphs": True} if cudagraphs else None)
    if torch.cuda.get_device_capability()[0] == 9:
        assert "grouped_mm_halves" in calls and "grouped_mm_cat_dx" in calls, calls


def _qwen3_block(h, i, e, k):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k,
                         norm_topk_prob=True, experts_implementation="grouped_mm")
    cfg._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return block


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("form", ["index_add", "where_setitem", "hf_qwen3"])
def test_training_step_is_bitwise_reproducible_cuda(form, deterministic):
    """A rewritten layer's training step gives the same bits on every run: output, input gradient and every
    parameter gradient (the kernels have no atomics and no split-K; the combine is a gather-reduce in a fixed
    order, where eager's index_add_ / scatter_add_ backward add in whatever order the atomics land: stock
    Inductor's Qwen3 block differed by up to 0.02 between two runs on an H200). Under
    torch.use_deterministic_algorithms(True) nothing the rewrite emits may raise. Sizes where many rows land
    on each output row and each expert (1024 tokens, top-4 of 16)."""
    from moe_compile import records

    torch.manual_seed(0)
    h, i, e, k, t = 256, 128, 16, 4, 1024
    if form == "hf_qwen3":
        model = _qwen3_block(h, i, e, k).cuda().bfloat16()

        def fn(x):   # HF blocks take [B, S, H]; some transformers versions also return the router logits
            out = model(x[None])
            return (out[0] if isinstance(out, tuple) else out)[0]
    else:
        model = make_model(torch.bfloat16, h=h, i=i, e=e, k=k, spelling=form).cuda()
        fn = model
    x0 = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="moe")
    before = records.counters["rewritten"]
    runs = []
    with torch.backends.cudnn.flags(deterministic=deterministic):
        torch.use_deterministic_algorithms(deterministic)
        try:
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                x = x0.clone().requires_grad_(True)
                y = compiled(x)
                y.backward(dy)
                runs.append([y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
        finally:
            torch.use_deterministic_algorithms(False)
    assert records.counters["rewritten"] - before == 1
    names = ["output", "x.grad"] + [n for n, _ in model.named_parameters()]
    for run in runs[1:]:
        for name, a, b in zip(names, runs[0], run):
            assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())


def _step_syncs(compiled, x) -> RuntimeError | None:
    """The error torch's sync debug mode raises in a training step after two warm-up steps, or None."""
    for _ in range(2):   # compile, warm up
        compiled(x).float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        compiled(x).float().sum().backward()
        return None
    except RuntimeError as exc:
        return exc
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("offsets, disable", [("bincount", ()), ("histc", ()), ("histc", ("static_counts",))])
def test_bincount_read_by_a_loss_does_not_sync_cuda(offsets, disable):
    """A load-balancing loss on bincount counts beside a rewritten sorted layer: the static_counts pass gives them
    a static length, so the compiled step makes the host wait nowhere (torch's sync debug mode raises on a
    synchronizing op: bincount sizes its output on the host, the case with the pass disabled) and the values and
    gradients are eager's."""
    from test_static_counts import H, SortedWithAux

    torch.manual_seed(0)
    model = SortedWithAux(offsets).to(torch.bfloat16).cuda()
    x = make_input((3, 37, H), torch.bfloat16).cuda().detach().requires_grad_()   # (a CPU leaf's grad: a copy back)
    check_compiled(model, [x], expect_rewritten=1, inductor=True, fresh_inputs=1, options={"moe.disable": disable})
    synced = _step_syncs(torch.compile(model, backend="moe", options={"moe.disable": disable}), x)
    assert (synced is not None) == bool(disable), f"host sync: {synced}"


@pytest.mark.parametrize("how, disable", [("list", ()), ("scalar", ()), ("list", ("static_counts",))])
def test_row_counts_read_by_a_loss_do_not_sync_cuda(how, disable):
    """Each expert's len(tok) kept for a load-balancing loss beside a rewritten loop: torch.tensor of those sizes
    becomes count_nonzero of the masks, so the compiled step makes the host wait nowhere (the loop's torch.where,
    a nonzero, stayed for the sizes: the case with the pass disabled) and the values and gradients are eager's."""
    from test_static_counts import LoopWithLenCounts

    torch.manual_seed(0)
    model = LoopWithLenCounts(how).cuda()
    x = make_input((37, 16)).cuda().detach().requires_grad_()
    check_compiled(model, [x], expect_rewritten=1, inductor=True, fresh_inputs=1, options={"moe.disable": disable})
    synced = _step_syncs(torch.compile(model, backend="moe", options={"moe.disable": disable}), x)
    assert (synced is not None) == bool(disable), f"host sync: {synced}"
