"""Hugging Face expert loops that Dynamo cannot trace, reached by the scoped substitution
(moe_compile/hf_experts.py): ``experts_implementation="eager"`` of every ``@use_experts_implementation``
architecture, DBRX, LongCat-Flash (identity experts) and JetMoE (``expert_size.tolist()`` + split).

Two links of one chain are tested: (1) eagerly, the substitute equals the loop it replaces, outputs and
every gradient, per architecture (no compile: milliseconds per model); (2) end to end, the compiled model
(substituted, rewritten) equals the eager model with its loop, and the substitution is gone outside the
backend's scope.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect

import pytest
import torch

import moe_compile.hf_experts as hf_experts
from helpers import BF16_GRAD_REL, BF16_REL, HF_FP32_REL, assert_close_rel, check_compiled, rel_err
from moe_compile import report

transformers = pytest.importorskip("transformers")
from test_hf_models import Logits  # noqa: E402  (needs transformers)

# tiny sizes; a key is used only where the architecture's config has that field
GENERIC = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, num_local_experts=4, num_experts=4,
    n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, num_experts_per_token=2, moe_k=2, moe_topk=2,
    moe_top_k=2, top_k=2, top_k_experts=2, moe_intermediate_size=16, expert_ffn_hidden_size=16,
    shared_expert_intermediate_size=32, shared_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    shared_experts_intermediate_size=32, first_k_dense_replace=0, num_dense_layers=0, moe_layer_start_index=0,
    decoder_sparse_step=1, mlp_only_layers=[], kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=8, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SPECIAL = {
    "dbrx": dict(d_model=32, n_heads=4, n_layers=1, max_seq_len=128, vocab_size=64,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2)),
    "longcat_flash": dict(num_layers=1, zero_expert_num=2, ffn_hidden_size=64, head_dim=8),
    "jetmoe": dict(kv_channels=8, num_key_value_heads=2, intermediate_size=16),
    "doge": dict(is_moe=True, num_experts=16, num_experts_per_tok=2),
    "llama4": dict(intermediate_size=16, intermediate_size_mlp=64, interleave_moe_layer_step=1,
                   attention_chunk_size=64),
}
# architectures whose experts are @use_experts_implementation (transformers 5.23) and whose tiny config
# above builds MoE layers; an architecture missing from the installed transformers is skipped
DECLARED = ("afmoe", "aria", "cohere2_moe", "deepseek_v2", "deepseek_v4", "ernie4_5_moe", "exaone_moe", "flex_olmo",
            "flint", "glm4_moe", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoeshared",
            "hunyuan_v1_moe", "inkling", "inkling2", "kolibri1", "mellum", "minimax", "minimax_m2", "minimax_m3_vl",
            "mistral4", "mixtral", "nemotron_h", "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe",
            "qwen3_next", "qwen4_exp", "solar_open")


def build(arch: str, impl: str | None = None, dtype=torch.float32) -> torch.nn.Module:
    try:
        mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    except ImportError:
        pytest.skip(f"{arch} is not in this transformers")
    lm = getattr(mod, sorted((n for n in dir(mod) if n.endswith("ForCausalLM")
                              and getattr(getattr(mod, n), "__module__", "") == mod.__name__), key=len)[0])
    cfg_cls = lm.config_class
    try:
        fields = {f.name for f in dataclasses.fields(cfg_cls)}
    except TypeError:
        fields = set(inspect.signature(cfg_cls.__init__).parameters)
    kw = {k: v for k, v in GENERIC.items() if k in fields}
    if "kv_lora_rank" in fields:  # MLA attention: one kv head per q head
        kw["num_key_value_heads"] = 4
    kw.update(SPECIAL.get(arch, {}))
    torch.manual_seed(0)
    model = lm._from_config(cfg_cls(**kw), **({} if impl is None else {"experts_implementation": impl}))
    with torch.no_grad():  # some inits leave routers or experts zero: all scores would tie
        for _, p in model.named_parameters():
            if p.ndim >= 2 and not p.abs().sum():
                p.normal_(0.0, 0.2)
    return model.to(dtype).eval()


def _ids(seed=0):
    return torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


def _fwd_bwd(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids).logits
    (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_same(got, ref, rel=HF_FP32_REL):
    (go, gg), (ro, rg) = got, ref
    assert_close_rel(go, ro, rel, "logits")
    assert {n for n, g in gg.items() if g is None} == {n for n, g in rg.items() if g is None}
    zero = max(1e-6, *(1e-5 * g.double().norm().item() for g in rg.values() if g is not None))
    for n, g in rg.items():
        if g is not None:
            assert_close_rel(gg[n], g, rel, f"grad of {n}", zero)


# ------------------------------------------------------------------ (1) substitute == loop, eagerly
@pytest.mark.parametrize("arch", DECLARED)
def test_declared_grouped_equals_eager_loop(arch):
    """What the substitution traces for @use_experts_implementation experts (ExpertsInterface
    ["grouped_mm"]) against their eager loop: logits and every gradient."""
    loop, grouped = build(arch, "eager"), build(arch, "grouped_mm")
    assert any(hasattr(m, "has_gate") for m in loop.modules()), f"{arch}: no decorated experts module"
    _assert_same(_fwd_bwd(grouped, _ids()), _fwd_bwd(loop, _ids()))


_OWN = {"dbrx": [("DbrxExperts", hf_experts.dbrx_grouped)],
        "longcat_flash": [("LongcatFlashExperts", hf_experts.longcat_grouped)],
        "jetmoe": [("JetMoeTopKGating", hf_experts.jetmoe_gating_grouped),
                   ("JetMoeParallelExperts", hf_experts.jetmoe_experts_grouped)]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", sorted(_OWN))
def test_own_substitute_equals_eager_loop(arch, dtype, monkeypatch):
    """moe_compile's grouped forms of the classes that declare none, run eagerly, against the loop. In
    bf16 both are compared with the loop in fp64: the substitute may be no further from it than
    BF16_GRAD_REL or 1.5x the loop's own bf16 error (LongCat's router gradient is a cancelling sum that
    both miss by ~16% in bf16)."""
    loop = build(arch, dtype=dtype)
    ref = _fwd_bwd(loop, _ids())
    mod = importlib.import_module(type(loop).__module__)
    for cls_name, fn in _OWN[arch]:
        cls = getattr(mod, cls_name)
        monkeypatch.setattr(cls, "forward", hf_experts._when_compiling(fn, always=True)(cls, cls.forward))
    got = _fwd_bwd(loop, _ids())
    if dtype == torch.float32:
        _assert_same(got, ref)
        return
    monkeypatch.undo()
    exact = _fwd_bwd(build(arch, dtype=torch.float64), _ids())
    for name, g_ref, g_got, g64 in [("logits", ref[0], got[0], exact[0])] + \
            [(n, ref[1][n], got[1][n], exact[1][n]) for n in exact[1] if exact[1][n] is not None]:
        bound = max(BF16_GRAD_REL, 1.5 * rel_err(g_ref, g64))
        assert rel_err(g_got, g64) <= bound, f"{arch} bf16 {name}: {rel_err(g_got, g64):.3g} > {bound:.3g}"


def test_longcat_routes_to_identity_experts():
    """The LongCat case above means something only if tokens pick identity experts (ids >= E)."""
    model = build("longcat_flash")
    seen = []
    moe = next(m for m in model.modules() if type(m).__name__ == "LongcatFlashExperts")
    hook = moe.register_forward_pre_hook(lambda m, args: seen.append(args[1]))
    model(input_ids=_ids())
    hook.remove()
    ids = torch.cat([s.flatten() for s in seen])
    assert (ids >= moe.num_routed_experts).any() and (ids < moe.num_routed_experts).any(), ids


# ------------------------------------------------------------------ (2) end to end, scoped
E2E = [("qwen3_moe", torch.float32, 1, 0), ("gpt_oss", torch.float32, 1, 0), ("qwen3_moe", torch.bfloat16, 1, 0),
       ("dbrx", torch.float32, 1, 0), ("dbrx", torch.bfloat16, 1, 0), ("longcat_flash", torch.float32, 1, 0),
       ("jetmoe", torch.float32, 1, 1)]


@pytest.mark.parametrize("arch,dtype,rewritten,refused", E2E,
                         ids=[f"{a}-{'fp32' if d == torch.float32 else 'bf16'}" for a, d, _, _ in E2E])
def test_eager_loop_compiled_matches_eager(arch, dtype, rewritten, refused):
    """The compiled model with its eager loop: rewritten, logits and every gradient equal to eager.
    JetMoE's attention experts (JetMoeMoA) are refused with a reason: their rows go back to (token,
    slot) order for attention, never summed per token."""
    model = build(arch, "eager" if arch in ("qwen3_moe", "gpt_oss") else None, dtype)
    low = dtype == torch.bfloat16
    with report.recording() as graphs:
        check_compiled(Logits(model), [_ids()], expect_rewritten=rewritten, expect_refused=refused,
                       rel=BF16_REL if low else HF_FP32_REL, grad_rel=BF16_GRAD_REL if low else HF_FP32_REL,
                       fresh_inputs=0)
    records = [r for g in graphs for r in g]
    assert all(r.status == "rewritten" or (r.reason and r.fix) for r in records), records


def test_substitution_is_scoped():
    """Nothing is installed outside the backend's scope: eager calls run the loop, another backend
    still cannot trace it, and the interface and classes are as before after a compiled call."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    dbrx_mod = importlib.import_module("transformers.models.dbrx.modeling_dbrx")
    before = (dict(ALL_EXPERTS_FUNCTIONS._local_mapping), dbrx_mod.DbrxExperts.__dict__["forward"])
    model = build("qwen3_moe", "eager")
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend="moe", options={"moe.inductor": False})
    with report.recording() as graphs:
        compiled(input_ids=_ids())
    assert [r.status for g in graphs for r in g] == ["rewritten"]
    assert (dict(ALL_EXPERTS_FUNCTIONS._local_mapping), dbrx_mod.DbrxExperts.__dict__["forward"]) == before
    # the same code compiled with another backend: the loop still breaks the experts' frame
    seen = []

    def count_ops(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(copy.deepcopy(model), backend=count_ops)(input_ids=_ids())
    assert not any("grouped_mm" in t for t in seen)
    # and eagerly, under the scope itself, the loop runs (not the grouped form)
    experts = next(m for m in model.modules() if hasattr(m, "has_gate"))
    stock = type(experts).__dict__["forward"]
    with hf_experts.substituted():
        assert getattr(type(experts).__dict__["forward"], "_moe_compile_substitute", False)
        grouped, hf_experts._grouped[0] = hf_experts._grouped[0], None   # calling it would raise
        try:
            model(input_ids=_ids())
        finally:
            hf_experts._grouped[0] = grouped
    assert type(experts).__dict__["forward"] is stock and dict(ALL_EXPERTS_FUNCTIONS._local_mapping) == before[0]


def _compiled_vs_eager(model):
    torch._dynamo.reset()
    compiled = copy.deepcopy(model)
    compiled.compile(backend="moe", options={"moe.inductor": False})   # in place: the same parameter names
    _assert_same(_fwd_bwd(compiled, _ids()), _fwd_bwd(model, _ids()))


def _gelu_gate(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate) * up


_USER_CODE = {"dbrx_mlp_hook": "dbrx", "longcat_identity_hook": "longcat_flash", "dbrx_class_patch": "dbrx",
              "jetmoe_experts_class_patch": "jetmoe", "dbrx_wraps_patch": "dbrx", "registered_eager": "qwen3_moe",
              "user_grouped_mm": "qwen3_moe", "patched_grouped_linear": "qwen3_moe",
              "subclass_apply_gate": "qwen3_moe", "class_apply_gate": "qwen3_moe",
              "decorated_subclass": "qwen3_moe", "instance_apply_gate": "qwen3_moe"}


@pytest.mark.parametrize("case", sorted(_USER_CODE))
def test_substitutes_never_skip_user_code(case, monkeypatch):
    """The substitutes compute what the stock loops compute; code a user put on that path must not be
    skipped. Found by adversarial reviews (relative error before): a hook on DBRX's per-expert MLP (the
    loop calls it, the substitute read its weights; 1.0), a hook on LongCat's identity expert (computed
    as x * weights; 0.49), a class-level patch of an experts forward, also through ``functools.wraps``
    (it copies ``__qualname__``), taken for the original (1.33 / 7.8). For ``@use_experts_implementation``
    experts asked for "eager": an "eager" the user registered in ExpertsInterface (1.0), a user's
    "grouped_mm" (0.5), a patched ``_grouped_linear`` (0.90), an ``_apply_gate`` of the user's on a
    subclass (0.19), on the class or on the instance (0.087), a decorated subclass with its own
    forward: the substitute computed transformers' grouped math instead."""
    import functools

    import transformers.integrations.moe as tmoe
    import transformers.models.dbrx.modeling_dbrx as dbrx
    import transformers.models.jetmoe.modeling_jetmoe as jetmoe
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qwen3

    from moe_compile import skipped_frames

    monkeypatch.setattr(skipped_frames, "_skipped", {})   # frames Dynamo gives up on: recorded process-wide for explain()
    arch = _USER_CODE[case]
    if case == "dbrx_class_patch":
        stock = dbrx.DbrxExperts.forward
        monkeypatch.setattr(dbrx.DbrxExperts, "forward", lambda self, h, i, w: stock(self, h, i, w * 0.5 + 0.1))
    elif case == "dbrx_wraps_patch":
        stock = dbrx.DbrxExperts.forward
        monkeypatch.setattr(dbrx.DbrxExperts, "forward",
                            functools.wraps(stock)(lambda self, h, i, w: stock(self, h, i, w * 0.5 + 0.1)))
    elif case == "jetmoe_experts_class_patch":
        stock = jetmoe.JetMoeParallelExperts.forward
        monkeypatch.setattr(jetmoe.JetMoeParallelExperts, "forward", lambda self, x, s: 0.5 * stock(self, x, s))
    elif case == "registered_eager":   # ExpertsInterface.register writes the class-wide mapping
        loop = qwen3.Qwen3MoeExperts.forward.__wrapped__
        monkeypatch.setitem(tmoe.ExpertsInterface._global_mapping, "eager", lambda *a: 0.5 * loop(*a))
    elif case == "user_grouped_mm":
        stock = tmoe.ALL_EXPERTS_FUNCTIONS["grouped_mm"]
        monkeypatch.setitem(tmoe.ALL_EXPERTS_FUNCTIONS._local_mapping, "grouped_mm", lambda *a: 0.5 * stock(*a))
    elif case == "patched_grouped_linear":
        stock = tmoe._grouped_linear
        monkeypatch.setattr(tmoe, "_grouped_linear", lambda *a, **k: 0.5 * stock(*a, **k))
    elif case == "class_apply_gate":
        monkeypatch.setattr(qwen3.Qwen3MoeExperts, "_apply_gate", _gelu_gate)
    model = build(arch, "eager" if arch == "qwen3_moe" else None)
    if case == "subclass_apply_gate":
        sub = type("UserExperts", (qwen3.Qwen3MoeExperts,), {"_apply_gate": _gelu_gate})
    elif case == "decorated_subclass":
        sub = tmoe.use_experts_implementation(type("UserExperts", (qwen3.Qwen3MoeExperts,), {
            "forward": lambda self, h, i, w: 2.0 * qwen3.Qwen3MoeExperts.forward(self, h, i, w)}))
    for m in model.modules():
        if case in ("subclass_apply_gate", "decorated_subclass") and type(m) is qwen3.Qwen3MoeExperts:
            m.__class__ = sub
        if case == "instance_apply_gate" and type(m) is qwen3.Qwen3MoeExperts:
            m._apply_gate = _gelu_gate.__get__(m)
    for m in model.modules():
        if case == "dbrx_mlp_hook" and type(m).__name__ == "DbrxExpertGLU":
            m.register_forward_hook(lambda mod, args, out: out * 0.5)
        if case == "longcat_identity_hook" and hasattr(m, "identity_expert"):
            m.identity_expert.register_forward_hook(lambda mod, args, out: out * 2.0)
    if case == "longcat_identity_hook":   # route to the identity experts too (their selection bias raised)
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "e_score_correction_bias") and m.e_score_correction_bias.numel() > 4:
                    m.e_score_correction_bias[4:] += 1.0
    _compiled_vs_eager(model)
