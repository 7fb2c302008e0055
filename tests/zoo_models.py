"""Tiny Mixture-of-Experts causal LMs for tests/test_zoo.py: every MoE architecture with a causal-LM
head in the installed transformers (randomly initialised, hidden 32, 2 layers, 4 experts, top-2,
vocab 64), plus five plain-PyTorch MoE layers in a tiny LM.

    build(name) -> (model, vocab)      model(input_ids) returns logits [B, S, vocab]
    moe_layers(model) -> [paths]       one module path per MoE layer (the experts container)

MoE models of transformers that are NOT here, because they have no causal-LM class of their own:
multimodal wrappers (qwen3_vl_moe, qwen3_omni_moe, glm4v_moe, glm5_next, ernie4_5_vl_moe,
mistral_large4, muse_spark, step3p7, deepseek_ocr2, unlimited_ocr, diffusion_gemma), the
encoder-decoders nllb_moe and switch_transformers, and the encoder openai_privacy_filter.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 64
HIDDEN = 32
EXPERTS = 4
TOP_K = 2

# transformers' causal LMs with MoE layers (module name under transformers.models)
HF_ARCHS = (
    "mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss",
    "llama4", "dbrx", "jetmoe", "granitemoe", "granitemoeshared", "phimoe", "jamba", "ernie4_5_moe",
    "glm4_moe", "minimax", "hunyuan_v1_moe", "flex_olmo", "dots1", "afmoe", "aria", "bailing_hybrid",
    "cohere2_moe", "deepseek_v32", "doge", "exaone_moe", "glm4_moe_lite", "glm_moe_dsa", "granitemoe_swa",
    "granitemoehybrid", "kimi_linear", "lfm2_moe", "longcat_flash", "minimax_m2", "mistral4", "nemotron_h",
    "qwen3_5_moe", "solar_open", "gemma4", "mimo_v2_flash", "laguna", "mellum", "hy_v3", "hy_v4", "flint",
    "kolibri1", "beam", "axk1", "axk2", "deepseek_v4", "inkling", "inkling2", "qwen4_exp", "zaya",
    "dots3_note", "minimax_m3_vl",
)
PLAIN_ARCHS = ("plain_mixtral", "plain_deepseek", "plain_sort", "plain_stacked", "plain_dense")
ALL_ARCHS = HF_ARCHS + PLAIN_ARCHS

# ============================================================================ Hugging Face configs
# Applied to every architecture, but only the keys that are fields of its config class.
_TINY = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # experts: every spelling of "how many" and "top-k" that some config uses
    num_local_experts=EXPERTS, num_experts=EXPERTS, n_routed_experts=EXPERTS, moe_num_experts=EXPERTS,
    num_experts_per_tok=TOP_K, num_experts_per_token=TOP_K, moe_k=TOP_K, moe_topk=TOP_K,
    moe_top_k=TOP_K, top_k=TOP_K, top_k_experts=TOP_K,
    moe_intermediate_size=16, expert_ffn_hidden_size=16,
    shared_expert_intermediate_size=32, shared_intermediate_size=32,
    moe_shared_expert_intermediate_size=32, shared_experts_intermediate_size=32,
    # every layer an MoE layer
    first_k_dense_replace=0, num_dense_layers=0, moe_layer_start_index=0, decoder_sparse_step=1,
    mlp_only_layers=[], mlp_layer_types=["sparse", "sparse"],
    # multi-head latent attention (DeepSeek family)
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
    # sparse-attention indexer (DeepSeek-V3.2 family)
    index_n_heads=2, index_head_dim=8, index_topk=4,
)
# group-limited routing, shrunk only where the default config uses groups (n_group > 1)
_GROUPS = dict(n_group=2, topk_group=1, num_expert_group=2)

# Per-architecture fixes (learned by building each one): config kwargs, or the causal-LM class
# where the module has several.
_SPECIAL: dict[str, dict] = {
    "mixtral": dict(intermediate_size=16),
    "phimoe": dict(intermediate_size=16),
    "olmoe": dict(intermediate_size=16),
    "flex_olmo": dict(intermediate_size=16),
    "minimax_m2": dict(intermediate_size=16),
    "granitemoe": dict(intermediate_size=16),
    "granitemoe_swa": dict(intermediate_size=16),
    "granitemoeshared": dict(intermediate_size=16, shared_intermediate_size=32),
    "granitemoehybrid": dict(intermediate_size=16, shared_intermediate_size=32, layer_types=["mamba", "attention"],
                             mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                             mamba_chunk_size=8),
    "gpt_oss": dict(intermediate_size=16, sliding_window=8),
    "hunyuan_v1_moe": dict(intermediate_size=16),
    "jamba": dict(intermediate_size=16, use_mamba_kernels=False, expert_layer_period=1, expert_layer_offset=0,
                  attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8),
    "minimax": dict(intermediate_size=16, layer_types=["linear_attention", "full_attention"], block_size=8),
    "llama4": dict(intermediate_size=16, intermediate_size_mlp=64, interleave_moe_layer_step=1,
                   attention_chunk_size=32),
    "jetmoe": dict(kv_channels=8, intermediate_size=16),
    "dbrx": dict(d_model=HIDDEN, n_heads=4, n_layers=2, max_seq_len=64,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=16, moe_num_experts=EXPERTS, moe_top_k=TOP_K)),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
    "ernie4_5_moe": dict(moe_num_shared_experts=1),
    "dots1": dict(n_shared_experts=1),
    "doge": dict(is_moe=True),
    "longcat_flash": dict(num_layers=1, zero_expert_num=2, ffn_hidden_size=64, head_dim=4),
    "aria": dict(moe_num_shared_experts=1, _lm="AriaTextForCausalLM"),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe"]),  # both: token-id hash routing, top-k routing
    "zaya": dict(num_experts_per_tok=1),  # its config validates top-1 only
    "dots3_note": dict(num_key_value_heads=4),
    "nemotron_h": dict(layers_block_type=["moe", "full_attention", "moe"], num_hidden_layers=3),
    "gemma4": dict(enable_moe_block=True, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                   global_head_dim=8),
}


def _fields(cfg_cls) -> dict:
    """Config field name -> default (inspect.Parameter.empty / dataclasses.MISSING when none)."""
    if dataclasses.is_dataclass(cfg_cls):
        return {f.name: f.default for f in dataclasses.fields(cfg_cls)}
    return {n: p.default for n, p in inspect.signature(cfg_cls.__init__).parameters.items()}


def _lm_class(arch: str):
    mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    name = _SPECIAL.get(arch, {}).get("_lm")
    if name is None:
        names = sorted((n for n, c in vars(mod).items() if n.endswith("ForCausalLM") and isinstance(c, type)
                        and c.__module__ == mod.__name__), key=len)
        if not names:
            raise LookupError(f"transformers.models.{arch} has no *ForCausalLM class")
        name = names[0]
    return getattr(mod, name)


def hf_config(arch: str):
    """(causal-LM class, tiny config) for a transformers architecture."""
    lm = _lm_class(arch)
    cfg_cls = lm.config_class
    fields = _fields(cfg_cls)
    special = {k: v for k, v in _SPECIAL.get(arch, {}).items() if not k.startswith("_")}
    kw = {k: v for k, v in _TINY.items() if k in fields}
    for k, v in _GROUPS.items():
        if isinstance(fields.get(k), int) and fields[k] > 1:
            kw[k] = v
    if "topk_group" in fields and "n_group" in kw:
        kw["topk_group"] = _GROUPS["topk_group"]
    if "kv_lora_rank" in fields:  # MLA: as many kv heads as query heads
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    kw.update(special)
    return lm, cfg_cls(**kw)


def randomize_degenerate_init(model: nn.Module) -> list[str]:
    """Re-randomise what some inits leave at zero and a trained model does not (returns the names):
    router weights (every routing score ties, top-k picks by index), expert biases (GPT-OSS, JetMoE:
    a bias added to the wrong rows would not show) and the selection-only expert biases of sigmoid
    routers (e_score_correction_bias, expert_bias: with zeros, selecting by the biased scores and
    weighting by the unbiased ones could not be told apart)."""
    names = []
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not t.is_floating_point() or t.count_nonzero():
                continue
            parts = name.split(".")
            owner = parts[-2] if len(parts) > 1 else ""
            if t.ndim == 2 and parts[-1] == "weight" and re.search(r"gate$|router|gating", owner):
                t.normal_(0.0, 0.5)
            elif ("expert" in name and "bias" in parts[-1]) or parts[-1] == "e_score_correction_bias":
                t.normal_(0.0, 0.1)
            else:
                continue
            names.append(name)
    return names


class Logits(nn.Module):
    """``m(input_ids).logits`` of a Hugging Face causal LM as a plain tensor."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, input_ids):
        return self.m(input_ids=input_ids, use_cache=False).logits


# =========================================================================== plain PyTorch MoE layers
class SwiGLU(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate = nn.Linear(h, i, bias=False)
        self.up = nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _route(logits: torch.Tensor, k: int):
    """softmax over experts (fp32), top-k, renormalised: (weights [T, K], ids [T, K])."""
    probs = logits.float().softmax(-1)
    w, ids = probs.topk(k, dim=-1)
    return w / w.sum(-1, keepdim=True), ids


class MixtralLoopMoE(nn.Module):
    """The Mixtral reference loop: topk of the logits, softmax of the top-k, then per expert
    ``torch.where(ids == e)`` and ``out[tok] += w * expert(x[tok])``."""

    def __init__(self, h, i, e, k):
        super().__init__()
        self.k = k
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(SwiGLU(h, i) for _ in range(e))

    def forward(self, x):
        shape, x = x.shape, x.flatten(0, -2)
        top, ids = self.gate(x).topk(self.k, dim=-1)
        w = top.softmax(-1, dtype=torch.float32).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out[tok] += w[tok, slot, None] * expert(x[tok])
        return out.view(shape)


class DeepSeekLoopMoE(nn.Module):
    """DeepSeek-V3 style: sigmoid scores, a selection-only bias, group-limited top-k, unbiased
    renormalised weights times a scaling factor, a shared expert added on top; the loop skips
    empty experts through ``bincount(...).tolist()``."""

    def __init__(self, h, i, e, k, groups=2, topk_groups=1, scale=2.5):
        super().__init__()
        self.e, self.k, self.groups, self.topk_groups, self.scale = e, k, groups, topk_groups, scale
        self.router = nn.Parameter(torch.randn(e, h) / math.sqrt(h))
        self.register_buffer("bias", torch.linspace(-0.1, 0.1, e))
        self.experts = nn.ModuleList(SwiGLU(h, i) for _ in range(e))
        self.shared = SwiGLU(h, i)

    def route(self, x):
        t = x.shape[0]
        scores = torch.sigmoid(F.linear(x.float(), self.router.float()))
        biased = scores + self.bias
        per = self.e // self.groups
        group = biased.view(t, self.groups, per).topk(min(2, per), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group).scatter_(1, group.topk(self.topk_groups, dim=-1).indices, 1.0)
        keep = keep.unsqueeze(-1).expand(t, self.groups, per).reshape(t, self.e)
        ids = biased.masked_fill(keep == 0, float("-inf")).topk(self.k, dim=-1).indices
        w = scores.gather(1, ids)
        return ids, (w / (w.sum(-1, keepdim=True) + 1e-20) * self.scale).to(x.dtype)

    def forward(self, x):
        shape, x = x.shape, x.flatten(0, -2)
        ids, w = self.route(x)
        out = torch.zeros_like(x)
        counts = torch.bincount(ids.flatten(), minlength=self.e).tolist()
        for e in range(self.e):
            if counts[e] == 0:
                continue
            tok, slot = torch.where(ids == e)
            out[tok] += self.experts[e](x[tok]) * w[tok, slot, None]
        return (out + self.shared(x)).view(shape)


class SortGroupMoE(nn.Module):
    """Sort + group: argsort the flat expert ids, gather the token rows in that order, split them
    by per-expert counts, one GELU MLP (with biases) per chunk, scatter back, weighted sum over k."""

    def __init__(self, h, i, e, k):
        super().__init__()
        self.e, self.k = e, k
        self.router = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, i), nn.GELU(), nn.Linear(i, h)) for _ in range(e))

    def forward(self, x):
        shape, x = x.shape, x.flatten(0, -2)
        t, h = x.shape
        w, ids = _route(self.router(x), self.k)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        rows = x[order // self.k]
        sizes = torch.bincount(flat, minlength=self.e).tolist()
        ys = torch.cat([self.experts[e](chunk) for e, chunk in enumerate(rows.split(sizes))])
        back = torch.empty_like(ys).index_copy_(0, order, ys)
        return (back.view(t, self.k, h) * w.unsqueeze(-1).to(x.dtype)).sum(1).view(shape)


class StackedLoopMoE(nn.Module):
    """3-D expert weights [E, 2I, H] and [E, H, I], a static loop over experts that indexes them,
    ``chunk(2)`` into gate and up, ``index_add_`` back."""

    def __init__(self, h, i, e, k):
        super().__init__()
        self.e, self.k = e, k
        self.router = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.randn(e, 2 * i, h) / math.sqrt(h))
        self.down = nn.Parameter(torch.randn(e, h, i) / math.sqrt(i))

    def forward(self, x):
        shape, x = x.shape, x.flatten(0, -2)
        w, ids = _route(self.router(x), self.k)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            g, u = F.linear(x[tok], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, self.down[e])
            out.index_add_(0, tok, y * w[tok, slot, None].to(y.dtype))
        return out.view(shape)


class DenseMoE(nn.Module):
    """Every token through every expert (bmm over 3-D weights), weighted by a dense [T, E] routing
    matrix that is zero outside the top-k."""

    def __init__(self, h, i, e, k):
        super().__init__()
        self.e, self.k = e, k
        self.router = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.randn(e, h, 2 * i) / math.sqrt(h))
        self.down = nn.Parameter(torch.randn(e, i, h) / math.sqrt(i))

    def forward(self, x):
        shape, x = x.shape, x.flatten(0, -2)
        t, h = x.shape
        w, ids = _route(self.router(x), self.k)
        dense = x.new_zeros(t, self.e).scatter(1, ids, w.to(x.dtype))
        hid = torch.bmm(x.expand(self.e, t, h), self.gate_up)
        g, u = hid.chunk(2, dim=-1)
        y = torch.bmm(F.silu(g) * u, self.down)                      # [E, T, H]
        return (y * dense.t().unsqueeze(-1)).sum(0).view(shape)


_PLAIN = {"plain_mixtral": MixtralLoopMoE, "plain_deepseek": DeepSeekLoopMoE, "plain_sort": SortGroupMoE,
          "plain_stacked": StackedLoopMoE, "plain_dense": DenseMoE}


class TinyMoELM(nn.Module):
    """embedding -> 2 x (RMSNorm -> MoE layer -> residual) -> RMSNorm -> lm_head; returns logits."""

    def __init__(self, moe_cls, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList(nn.RMSNorm(HIDDEN) for _ in range(layers))
        self.moes = nn.ModuleList(moe_cls(HIDDEN, 16, EXPERTS, TOP_K) for _ in range(layers))
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.lm_head(self.norm(h))


# =================================================================================== entry points
def build(arch: str, seed: int = 0) -> tuple[nn.Module, int]:
    """The tiny fp32 model for ``arch`` as ``model(input_ids) -> logits`` (train mode), and its vocab."""
    torch.manual_seed(seed)
    if arch in _PLAIN:
        return TinyMoELM(_PLAIN[arch]).train(), VOCAB
    lm, cfg = hf_config(arch)
    model = lm._from_config(cfg)
    randomize_degenerate_init(model)
    return Logits(model.float()).train(), VOCAB


def to_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` cast to ``dtype`` in place as ``from_pretrained(..., dtype=dtype)`` casts it: the
    parameters and buffers that a Hugging Face model keeps in fp32 stay fp32, ``_keep_in_fp32_modules_strict``
    in fp16 and bf16 (Inkling2's router runs in fp32 and fails with bf16 weights), ``_keep_in_fp32_modules``
    in fp16 only (DeepSeek-V4's compressor projections then read bf16 inputs and fail in fp32)."""
    model.to(dtype)
    keep = set()
    for m in model.modules():
        if dtype == torch.float16:
            keep.update(getattr(m, "_keep_in_fp32_modules", None) or ())
        keep.update(getattr(m, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float32 or not keep:
        return model
    names = re.compile(r"(^|\.)(" + "|".join(map(re.escape, sorted(keep))) + r")($|\.)")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and names.search(name):
            t.data = t.data.float()
    return model


_EXPERTS_CLS = re.compile(r"Experts$")
# MoE layers with no experts container: Doge's retrieval experts are rows of two nn.Embedding
_MOE_BLOCK_CLS = re.compile(r"^DogeCDMoE$")


def moe_layers(model: nn.Module) -> list[str]:
    """Module paths of the MoE layers: the experts container (a module whose class name ends in
    "Experts", or a ModuleList named "experts"), its parent where that holds several of them
    (JetMoE's input_linear / output_linear ParallelExperts, in the MLP and in the attention), or the
    MoE block itself (Doge's CDMoE, the plain layers of TinyMoELM). Shared experts are not MoE layers."""
    found = []
    for name, m in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if "shared" in last.lower():
            continue
        if _EXPERTS_CLS.search(type(m).__name__) or (isinstance(m, nn.ModuleList) and last == "experts") \
                or isinstance(m, tuple(_PLAIN.values())) or _MOE_BLOCK_CLS.search(type(m).__name__):
            found.append(name)
    # an experts container inside another one (e.g. a ModuleList "experts" of an *Experts) counts once
    found = [n for n in found if not any(n.startswith(o + ".") for o in found)]
    parents = [n.rsplit(".", 1)[0] if not n.rsplit(".", 1)[-1].isdigit() else n for n in found]
    return sorted({p if parents.count(p) > 1 else n for n, p in zip(found, parents)})
