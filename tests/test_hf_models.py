"""Tiny Hugging Face MoE models (transformers 5) through backend="moe".

Default experts implementation ("grouped_mm": sort, grouped GEMM, inverse permutation, sum over
top-k): compiled logits and every parameter gradient match eager, and explain() shows every MoE
layer rewritten. The "eager" implementation (a loop over the data-dependent list of hit experts) is rewritten through
the model's own grouped implementation (tests/test_forms_hf_eager.py proves them equal).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import moe_compile
from moe_compile import report
from helpers import BF16_GRAD_REL, BF16_REL, HF_FP32_REL, _run, assert_close_rel, check_compiled

transformers = pytest.importorskip("transformers")

# shared tiny sizes: hidden 32, 2 layers, seq 8
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SPECS = {  # name -> (config class, causal LM class, MoE overrides)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8,
                       decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",      # shared expert + sigmoid shared gate
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",  # sigmoid + bias, group-limited, scaled
                    dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4,
                         topk_group=2, first_k_dense_replace=0, n_shared_experts=1, kv_lora_rank=16,
                         q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                         routed_scaling_factor=2.5, num_key_value_heads=4)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",           # clamped SwiGLU, biases, interleaved gate/up
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
                     head_dim=8)),
}
LAYERS = {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}



def build(name: str, impl: str | None = None, dtype=torch.float32, layers: int = 2) -> nn.Module:
    cfg_name, lm_name, kw = SPECS[name]
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **kw, "num_hidden_layers": layers})
    torch.manual_seed(0)
    kwargs = {} if impl is None else {"experts_implementation": impl}
    model = getattr(transformers, lm_name)._from_config(cfg, **kwargs)
    with torch.no_grad():  # some inits zero the router: all scores would tie
        for n, p in model.named_parameters():
            if p.ndim == 2 and n.endswith(("gate.weight", "router.weight")) and not p.abs().sum():
                p.normal_(0.0, 0.5)
            if p.ndim >= 2 and "experts" in n and not p.abs().sum():
                p.normal_(0.0, 0.2)
            if "experts" in n and n.endswith("bias") and not p.abs().sum():
                p.normal_(0.0, 0.1)
    return model.to(dtype).eval()


class Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, ids):
        return self.m(input_ids=ids).logits


def _ids(seed=0):
    return torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hf_grouped_mm_matches_eager(name):
    model = build(name)
    assert model.config._experts_implementation in (None, "grouped_mm")
    with report.recording() as graphs:
        check_compiled(Logits(model), [_ids()], expect_rewritten=2, rel=HF_FP32_REL, grad_rel=HF_FP32_REL,
                       fresh_inputs=0)
    records = [r for g in graphs for r in g]
    assert {r.module.removeprefix("m.") for r in records if r.status == "rewritten"} == LAYERS, records
    assert all(r.status == "rewritten" for r in records), records
    # SwiGLU experts (all but GPT-OSS's clamped variant) get the fused activation op, with the routing
    # weights in it (weights_in_swiglu: their down projections are bias-free) and an unweighted sum
    assert all(("weighted_swiglu" in r.ops and "unpermute_sum" in r.ops and "unpermute_combine" not in r.ops)
               == (name != "gpt_oss") for r in records), records
    assert all("router_topk" in r.ops for r in records), records  # every one routes with torch.topk


def test_hf_dynamic_module_floats_are_not_host_syncs():
    """dynamic=True: Dynamo passes the modules' Python floats (variance_epsilon, scaling, ...) as 0-d host
    tensors read with .item(); each was reported as a host sync left in the graph (review helper-76)."""
    torch._dynamo.reset()
    with report.recording() as graphs:
        torch.compile(Logits(build("qwen3_moe", layers=1)), backend="moe", dynamic=True,
                      options={"moe.inductor": False})(_ids())
    records = [r for g in graphs for r in g]
    assert records and all(r.status == "rewritten" for r in records), records
    assert not [n for r in records for n in r.notes if "host syncs" in n], [r.notes for r in records]


def test_hf_gpt_oss_dynamic_shapes():
    """GPT-OSS under dynamic=True: its clamp limit and alpha are symbolic floats (Dynamo passes module floats
    as graph inputs there); they were refused as `unsupported_row_op`. Rewritten now, symbolic sizes and all."""
    torch._dynamo.reset()
    model = Logits(build("gpt_oss", "batched_mm", layers=1))
    ours = copy.deepcopy(model)
    compiled = torch.compile(ours, backend="moe", dynamic=True, options={"moe.inductor": False})
    with report.recording() as graphs:
        for shape in [(2, 8), (3, 5)]:   # one graph for both: its sizes are symbolic
            ids = torch.randint(3, 64, shape, generator=torch.Generator().manual_seed(shape[1]))
            model.zero_grad(set_to_none=True)
            ours.zero_grad(set_to_none=True)
            (ref, *_), ref_g = _run(model, [ids])
            (got, *_), got_g = _run(compiled, [ids], module=ours)
            assert_close_rel(got, ref, HF_FP32_REL, f"{shape}: logits")
            assert ref_g.keys() == got_g.keys()
            for k in ref_g:
                assert_close_rel(got_g[k], ref_g[k], HF_FP32_REL, f"{shape}: grad of {k}")
    assert [(r.status, r.code) for g in graphs for r in g] == [("rewritten", "")], graphs


def test_explain_follows_the_compiles_dynamic():
    """explain(compiled) of a dynamic=True compile traces as that compile did: GPT-OSS's symbolic clamp limit
    was refused there and explain(compiled), tracing with static shapes, said "rewritten" (review helper-76)."""
    torch._dynamo.reset()
    model = Logits(build("gpt_oss", "batched_mm", layers=1))
    compiled = torch.compile(model, backend="moe", dynamic=True, options={"moe.inductor": False})
    with report.recording() as graphs:
        compiled(_ids())
    found = sorted((r.status, r.code) for g in graphs for r in g)
    rep = moe_compile.explain(compiled, _ids())
    assert sorted((r.status, r.code) for r in rep.regions) == found, (found, str(rep))
    assert len(moe_compile.explain(model, _ids()).rewritten) == 1   # the default compile: static shapes


@pytest.mark.parametrize("name", ["gpt_oss"])
def test_hf_explain_shows_every_layer_rewritten(name):
    rep = moe_compile.explain(build(name), _ids(1))
    assert {r.module for r in rep.rewritten} == LAYERS, str(rep)
    assert not rep.refused, str(rep)
    assert all("grouped_mm" in r.ops and "unpermute_combine" in r.ops for r in rep.rewritten)


def test_hf_inductor_qwen2_moe():
    """The shared expert and its sigmoid gate stay as Inductor code around the rewritten experts."""
    check_compiled(Logits(build("qwen2_moe", layers=1)), [_ids()], expect_rewritten=1, rel=HF_FP32_REL,
                   grad_rel=HF_FP32_REL, fresh_inputs=0, inductor=True)


def test_hf_bf16_torch_grouped_mm():
    """In bf16 HF calls torch's grouped_mm (not the fp32 fallback op): also matched."""
    model = build("olmoe", dtype=torch.bfloat16)
    check_compiled(Logits(model), [_ids()], expect_rewritten=2, rel=BF16_REL, grad_rel=BF16_GRAD_REL,
                   fresh_inputs=0)


def test_hf_eager_experts_are_rewritten():
    """transformers' eager experts loop (``experts_implementation="eager"``) never reaches a graph by
    itself; inside frames compiled with moe it traces the model's own grouped implementation
    (moe_compile/hf_experts.py), so explain() shows the layer rewritten and no break to fix."""
    rep = moe_compile.explain(build("qwen3_moe", impl="eager", layers=1), _ids())
    assert {r.module for r in rep.rewritten} == {"model.layers.0.mlp.experts"}, str(rep)
    assert not rep.graph_breaks, str(rep)
