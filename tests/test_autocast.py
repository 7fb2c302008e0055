"""torch.autocast around a MoE layer whose expert weights are fp32 (mixed precision, what Hugging Face
Trainer's bf16=True does): the expert products run in bf16 in eager. The grouped GEMMs that replace
them are custom ops, which autocast passes through, so the lowering casts their operands as autocast
would (``Step.dtype``, lowering/region.py) and the stacking casts the stacked weights once
(lowering/expert_stack.py). Before that, the rewrite computed the experts in fp32: other values than
eager's and, on a GPU, fp32 GEMMs. A bias added after the product is added after the bf16 GEMM in
the dtype torch promotes the sum to (lowering/region.py, ``_add_group_bias``)."""
from __future__ import annotations

import copy

import pytest
import torch

from helpers import BF16_GRAD_REL, BF16_REL, assert_close_rel, make_input, make_model
from moe_compile import records

# compiled vs eager, both computing the experts in bf16 under autocast: the rounding points differ
# (one rounding per fused op vs per eager op, fp32 accumulation either way), so values agree to a few
# bf16 ulps; the bf16 bounds of the other tests (helpers.BF16_REL / BF16_GRAD_REL) apply as they are


def _step(fn, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(x)
    out.float().square().sum().backward()
    return out.detach()


def _hf_step(eager, autocast=True):
    """A copy of the transformers model ``eager`` compiled (``moe.inductor=False``) and ``eager`` itself,
    one batch each under CPU autocast (or not): (the copy, its loss, eager's loss, the region records);
    the gradients are in both models."""
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with records.recording() as graphs:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = compiled(input_ids=ids, labels=ids).loss
        got.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = eager(input_ids=ids, labels=ids).loss
    want.backward()
    return model, got.detach(), want.detach(), [r for g in graphs for r in g]


@pytest.mark.parametrize("expert", ["swiglu", "stacked_chunk", "gelu_seq", "gptoss"])
@pytest.mark.parametrize("inductor", [False, True])
def test_fp32_weights_under_autocast_compute_in_bf16(expert, inductor, gemm_dtypes):
    """Rewritten (bias-free ModuleList weights stacked, their stack cast once; nn.Linear biases cast
    with the weights, as autocast casts F.linear's), every grouped GEMM in bf16, the outputs and every
    gradient (fp32, as the Parameters) as eager's under autocast, over two steps. GPT-OSS's
    ``x @ W[e] + b[e]``: the bf16 product plus the fp32 bias is an fp32 sum (torch's promotion); the
    rewrite runs the grouped GEMM in bf16 without its bias epilogue (which would add before rounding
    and return bf16) and adds each row's expert bias after it in fp32."""
    torch._dynamo.reset()
    model = make_model(spelling="index_add", expert=expert, e=4, k=2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": inductor})
    with records.recording() as graphs:
        for step in range(2):
            x = make_input((3, 5, 16), seed=step)
            x_ref = x.detach().clone().requires_grad_()
            got, want = _step(compiled, x), _step(ref, x_ref)
            assert got.dtype == want.dtype == torch.float32
            assert_close_rel(got, want, BF16_REL, f"step {step}: output")
            assert_close_rel(x.grad, x_ref.grad, BF16_GRAD_REL, f"step {step}: input gradient")
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert p.grad.dtype == q.grad.dtype == torch.float32
                assert_close_rel(p.grad, q.grad, BF16_GRAD_REL, f"step {step}: grad of {name}")
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
    recs = [r for g in graphs for r in g]
    assert [r.status for r in recs] == [records.REWRITTEN], [(r.status, r.code, r.reason) for r in recs]
    if expert == "swiglu":
        assert any("stacked input" in n for n in recs[0].notes), recs[0].notes
    assert gemm_dtypes and all(d == (torch.bfloat16, torch.bfloat16) for d in gemm_dtypes), gemm_dtypes


def test_hf_gpt_oss_batched_experts_under_autocast(gemm_dtypes):
    """transformers' GPT-OSS with ``batched_mm`` experts under autocast over fp32 weights: torch.bmm
    runs in bf16 and ``out.add_(bias)`` adds the fp32 bias in fp32 and rounds the sum back to bf16 (in
    place). Rewritten, its grouped GEMMs in bf16, the loss and every gradient as eager's."""
    transformers = pytest.importorskip("transformers")
    from helpers import BF16_REL as LOSS_REL

    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64,
                                    use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    eager = transformers.GptOssForCausalLM._from_config(cfg).train()
    with torch.no_grad():
        for n, p in eager.named_parameters():
            if n.endswith(("router.weight", "bias")):
                p.normal_(0.0, 0.5)   # routing away from ties; biases that matter
    eager.set_experts_implementation("batched_mm")
    model, got, want, recs = _hf_step(eager)
    assert len(recs) == 2 and all(r.status == records.REWRITTEN for r in recs), recs
    assert gemm_dtypes and all(d == (torch.bfloat16, torch.bfloat16) for d in gemm_dtypes), gemm_dtypes
    assert_close_rel(got, want, LOSS_REL, "loss")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close_rel(p.grad, q.grad, BF16_GRAD_REL, f"grad of {name}")


def test_bf16_weights_under_autocast_cast_nothing(gemm_dtypes):
    """Weights already bf16: autocast casts nothing, the rewrite adds no cast and matches eager."""
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
    assert gemm_dtypes and all(d == (torch.bfloat16, torch.bfloat16) for d in gemm_dtypes), gemm_dtypes


def test_hf_eager_experts_under_autocast_are_not_substituted(monkeypatch):
    """transformers' eager experts (F.linear per expert: bf16 under autocast) are traced as their
    declared grouped implementation only without autocast (moe_compile/hf_experts.py): that one's
    torch._grouped_mm runs in the weights' dtype, other values than the eager loop's. Under autocast the
    loop is traced as written, its graph break reported (break_expert_hit_hf), and it runs as eager."""
    pytest.importorskip("transformers")
    from helpers import HF_FP32_REL, tiny_qwen3_moe
    from moe_compile import skipped_frames

    # the frame Dynamo gives up on here is recorded process-wide for explain(); keep it to this test
    monkeypatch.setattr(skipped_frames, "_skipped", {})
    eager = tiny_qwen3_moe(2)
    eager.set_experts_implementation("eager")
    _, got, want, recs = _hf_step(eager)
    assert recs and all((r.status, r.code) == (records.REFUSED, "break_expert_hit_hf") for r in recs), recs
    assert_close_rel(got, want, HF_FP32_REL, "loss")


@pytest.mark.parametrize("impl,autocast", [("grouped_mm", True), ("batched_mm", True), ("grouped_mm", False)])
def test_hf_grouped_experts_under_autocast_stay_fp32_with_a_note(impl, autocast):
    """transformers' 3-D experts under autocast over fp32 weights: ``grouped_mm`` calls
    torch._grouped_mm (under torch.compile its fp32 fallback), which autocast passes through, so its
    expert GEMMs compute in fp32 in eager; the rewrite computes them in fp32 too (the values and
    every gradient as eager's) and its record says so, with how to get bf16 GEMMs (the step took
    2.2x the nn.Linear loop's under autocast on a Qwen3-shaped model, docs/benchmarks.md).
    ``batched_mm`` (torch.bmm, which autocast casts) and runs without autocast get no such note."""
    pytest.importorskip("transformers")
    from helpers import tiny_qwen3_moe

    eager = tiny_qwen3_moe(2)
    eager.set_experts_implementation(impl)
    model, got, want, recs = _hf_step(eager, autocast)
    assert len(recs) == 2 and all(r.status == records.REWRITTEN for r in recs), recs
    noted = [any("compute in float32, as in eager" in n and "torch.autocast" in n for n in r.notes) for r in recs]
    assert noted == [impl == "grouped_mm" and autocast] * 2, [r.notes for r in recs]
    # the attention and router products run in bf16 under autocast in both: the bf16 bounds apply
    assert_close_rel(got, want, BF16_REL, "loss")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close_rel(p.grad, q.grad, BF16_GRAD_REL, f"grad of {name}")


class _FP32RouterBF16Input(torch.nn.Module):
    """A router in fp32 for stability on a bf16 input, experts left in fp32: outside autocast eager
    raises at the first expert linear (bf16 rows, fp32 weight)."""

    def __init__(self, where, h=16, e=4):
        super().__init__()
        torch.manual_seed(0)
        self.where, self.e = where, e
        self.gate = torch.nn.Linear(h, e, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(h, 32), torch.nn.SiLU(),
                                                               torch.nn.Linear(32, h)) for _ in range(e))

    def _moe(self, x):
        w, ids = self.gate(x.float()).softmax(-1).topk(2, -1)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, (w[tok, slot, None] * self.experts[e](x[tok])).to(x.dtype))
        return out

    def forward(self, x):
        if self.where == "inside":   # autocast entered inside the compiled code: the graph holds it
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self._moe(x)
        if self.where == "disabled_inside":   # autocast off around the experts, inside an enabled one
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with torch.autocast("cpu", enabled=False):
                    return self._moe(x)
        if self.where == "other_device":   # autocast for CUDA does nothing to CPU tensors
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return self._moe(x)
        return self._moe(x)


@pytest.mark.parametrize("where", ["none", "disabled_inside", "other_device", "around", "inside"])
def test_mixed_dtype_experts_raise_as_eager_outside_autocast(where):
    """Was rewritten outside autocast: the lowering cast the bf16 rows and fp32 weights to one dtype and
    returned a result where eager raises. Now refused (mixed_dtypes) and compiled as written, which
    raises eager's error; so is autocast entered in the graph but disabled around the experts, or for
    another device (the first version took any autocast context as on). Under autocast for the device,
    around the call or inside it, still rewritten."""
    model = _FP32RouterBF16Input(where)
    x = make_input((12, 16), torch.bfloat16, requires_grad=False)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend="moe", options={"moe.inductor": False})
    before = dict(records.counters)
    if where in ("none", "disabled_inside", "other_device"):
        with pytest.raises(RuntimeError, match="same dtype"):
            model(x)
        with pytest.raises(RuntimeError, match="same dtype"):
            compiled(x)
        assert records.counters[records.REFUSED] - before.get(records.REFUSED, 0) == 1
        return
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "around"):
        want, got = model(x), compiled(x)
    assert_close_rel(got.float(), want.float(), BF16_REL, "output")
    assert records.counters[records.REWRITTEN] - before.get(records.REWRITTEN, 0) == 1


class _Expert(torch.nn.Module):
    """A bias-free SwiGLU expert; ``autocast``: "w1" | "w3" runs that linear alone under CPU bf16 autocast."""

    def __init__(self, autocast, h=16, i=24):
        super().__init__()
        self.autocast = autocast
        self.w1, self.w3 = torch.nn.Linear(h, i, bias=False), torch.nn.Linear(h, i, bias=False)
        self.w2 = torch.nn.Linear(i, h, bias=False)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast == "w1"):
            a = self.w1(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast == "w3"):
            b = self.w3(x)
        return self.w2(torch.nn.functional.silu(a) * b)


class _PartlyAutocastMoE(torch.nn.Module):
    def __init__(self, autocast, k, e=4, h=16):
        super().__init__()
        self.k = k
        self.gate = torch.nn.Linear(h, e, bias=False)
        self.experts = torch.nn.ModuleList(_Expert(autocast) for _ in range(e))

    def forward(self, x):
        w, ids = torch.topk(torch.softmax(self.gate(x), -1), self.k, -1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, (w[tok, slot, None] * expert(x[tok])).to(out.dtype))
        return out


# one linear of the pair in bf16 (autocast around it alone), the other in fp32, on both sides: the fp32
# summation order differs, which flips the bf16 rounding of a few elements (up to 2e-4 seen); the pair
# fused into one fp32 GEMM was 3e-3 - 7e-3 off
PARTLY_AUTOCAST_REL = 1e-3


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("autocast", ["w1", "w3"])
def test_gate_and_up_run_in_two_dtypes_are_not_paired(autocast, k, gemm_dtypes):
    """w1 and w3 of one input are paired into one GEMM (grouped_mm_list_cat) when they run in one dtype.
    With autocast around one of them only, the pair ran both in fp32 (review helper-64): the output
    3e-3 off eager, every gradient 3e-3 - 7e-3, reported rewritten. Now each runs in its own dtype."""
    torch.manual_seed(0)
    eager = _PartlyAutocastMoE(autocast, k)
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    with records.recording() as graphs:
        for t in (64, 7, 0):
            x = make_input((t, 16), seed=t)
            x_ref = x.detach().clone().requires_grad_()
            got, want = compiled(x), eager(x_ref)
            got.square().sum().backward()
            want.square().sum().backward()
            assert_close_rel(got, want, PARTLY_AUTOCAST_REL, f"T={t}: output")
            assert_close_rel(x.grad, x_ref.grad, PARTLY_AUTOCAST_REL, f"T={t}: input gradient")
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                assert_close_rel(p.grad, q.grad, PARTLY_AUTOCAST_REL, f"T={t}: grad of {name}")
            model.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
    recs = [r for g in graphs for r in g]   # one graph per size seen (recompiles)
    assert recs and all(r.status == records.REWRITTEN for r in recs), [(r.status, r.code, r.reason) for r in recs]
    assert (torch.bfloat16, torch.bfloat16) in gemm_dtypes and (torch.float32, torch.float32) in gemm_dtypes, gemm_dtypes
