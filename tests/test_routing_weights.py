"""Routing weights whose gradient is not the plain one: the rewrite must keep it exactly.

Regression for the PhiMoE stop-ship: transformers' PhiMoE router (a sampling router whose weights
come out of a custom autograd Function, ``PhimoeMultiplier``) trained with a router gradient off by
a relative 20-190 under backend="moe". Root cause: the lowering's dead-code elimination
(``fx.Graph.eliminate_dead_code``) also walks the subgraphs of higher-order ops with torch's default
impurity rule, and erased the in-place ``scatter_add_`` from the Function's backward body, which the
working copy of the graph shared with Dynamo's original. The class: values that are equal in the
forward but differ in the gradient (custom autograd Functions, straight-through estimators, detach
tricks, sampling routers); every case compares every gradient with eager and asserts the rewrite
fired.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_compile.pipeline as pipeline
from helpers import HF_FP32_REL, SwiGLU, check_compiled
from moe_compile.config import MoEConfig


class TripleGrad(torch.autograd.Function):
    """Identity forward; backward 3 * grad built with an in-place op on an intermediate (as
    PhimoeMultiplier's ``scatter_add_``): Dynamo traces it into an autograd_function_apply whose
    backward body holds a method call ``add_`` that has no users."""

    @staticmethod
    def forward(ctx, w):
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        g = grad * 2
        g.add_(grad)
        return g


class WeightTrickMoE(nn.Module):
    """Per-expert loop (where + index_add_) with SwiGLU ModuleList experts; ``trick`` changes how
    the routing weights are made, never their forward value's role:

    autograd_fn: TripleGrad.apply(w)                  (custom backward, in-place op inside)
    straight_through: ones in the forward, d/dw = 1    (w - w.detach() + 1)
    detach: w.detach()                                 (no gradient reaches the router through w)
    st_round: w + (w.round(decimals=1) - w).detach()   (forward rounded, gradient of w)
    gumbel: ids sampled with Gumbel noise (a sampling router; needs the same RNG on both sides)
    """

    def __init__(self, trick: str, h=16, i=12, e=4, k=2):
        super().__init__()
        self.trick, self.e, self.k = trick, e, k
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList([SwiGLU(h, i) for _ in range(e)])

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        if self.trick == "gumbel":
            noise = -torch.empty_like(probs).exponential_().log()
            ids = torch.topk(probs.log() + noise, self.k, dim=-1).indices
            w = probs.gather(-1, ids)
        else:
            w, ids = torch.topk(probs, self.k, dim=-1)
        if self.trick == "autograd_fn":
            w = TripleGrad.apply(w)
        elif self.trick == "straight_through":
            w = w - w.detach() + 1.0
        elif self.trick == "detach":
            w = w.detach()
        elif self.trick == "st_round":
            w = w + (w.round(decimals=1) - w).detach()
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


TRICKS = ("autograd_fn", "straight_through", "detach", "st_round", "gumbel")


@pytest.mark.parametrize("trick", TRICKS)
def test_weight_tricks_keep_their_gradient(trick):
    torch.manual_seed(0)
    model = WeightTrickMoE(trick)
    x = torch.randn(10, 16, requires_grad=True)
    check_compiled(model, [x], expect_rewritten=1, seed=7 if trick == "gumbel" else None)


@pytest.mark.parametrize("trick", ["autograd_fn", "gumbel"])
def test_weight_tricks_under_inductor(trick):
    """The same through Inductor (its random ops draw eager's numbers with fallback_random)."""
    torch.manual_seed(0)
    model = WeightTrickMoE(trick)
    x = torch.randn(10, 16, requires_grad=True)
    with torch._inductor.config.patch(fallback_random=True):
        check_compiled(model, [x], expect_rewritten=1, inductor=True, fresh_inputs=0,
                       seed=7 if trick == "gumbel" else None)


def _dynamo_graph(model, *args):
    """Dynamo's graph of ``model(*args)`` and its example inputs, as a backend receives them."""
    got = {}

    def grab(gm, example_inputs):
        got["gm"], got["inputs"] = gm, example_inputs
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch.compile(model, backend=grab)(*args)
    return got["gm"], got["inputs"]


def _code_of_every_graph(gm: torch.fx.GraphModule) -> dict[str, str]:
    return {name: m.code for name, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)}


def test_passes_never_touch_dynamos_graph_or_its_subgraphs():
    """The dynamo stage works on a copy: Dynamo's graph and every subgraph it holds (here the custom
    autograd Function's forward and backward bodies) come out unchanged, while the copy is
    rewritten and keeps the backward body's in-place op."""
    torch.manual_seed(0)
    gm, inputs = _dynamo_graph(WeightTrickMoE("autograd_fn"), torch.randn(10, 16))
    before = _code_of_every_graph(gm)
    assert any("add_" in code for name, code in before.items() if "bwd" in name), before.keys()
    new, records = pipeline.run_dynamo_stage(gm, inputs, MoEConfig(inductor=False))
    assert [r.status for r in records] == ["rewritten"], records
    assert _code_of_every_graph(gm) == before
    after = _code_of_every_graph(new)
    assert all(after[name] == code for name, code in before.items() if name), "a subgraph was changed"
    assert after[""] != before[""]


# ---------------------------------------------------------------------------------- Hugging Face
transformers = pytest.importorskip("transformers")

class _Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).logits


def _phimoe(layers=1):
    cfg = transformers.PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=64, use_cache=False,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.PhimoeForCausalLM._from_config(cfg).float().train()


@pytest.mark.parametrize("inductor", [False, True], ids=["aot_eager", "inductor"])
def test_hf_phimoe_train_mode_router_gradient(inductor):
    """Sampling router (Gumbel + Heun's third-order multiplier in a custom autograd Function), train
    mode: logits and every gradient match eager, the layer is rewritten."""
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch._inductor.config.patch(fallback_random=True):
        check_compiled(_Logits(_phimoe()), [ids], expect_rewritten=1, rel=HF_FP32_REL, grad_rel=HF_FP32_REL,
                       fresh_inputs=0, inductor=inductor, seed=4321)


def test_hf_phimoe_experts_that_ran_eagerly_are_listed():
    """PhiMoE routes in its module's ``sparsemixer`` function, not in a class: explain()'s probe for experts
    that ran eagerly (``passes/moe_source.routes``) took its 3-D experts for no experts, and a layer run
    eagerly (gradient checkpointing with transformers' router-logit recorders: review helper-84) was listed
    nowhere: 0 rewritten, 0 refused. Listed now, with the recorders named."""
    import moe_compile

    torch._dynamo.reset()
    model = _phimoe(layers=2)
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    compiled(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
    report = moe_compile.explain(compiled, input_ids=ids, labels=ids, output_router_logits=True)
    assert [(r.module, r.code) for r in report.regions] == [
        (f"model.layers.{i}.mlp.experts", "router_logits_recorder") for i in range(2)], report
