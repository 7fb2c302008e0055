"""Expert parallelism, side by side: one MoE layer and a whole model, every variant in one torchrun.

    torchrun --nproc_per_node 2 examples/benchmark/ep.py --json ep.json          # 2 GPUs (any count works)
    torchrun --nproc_per_node 2 examples/benchmark/ep.py --device cpu --tiny     # CPU + gloo, tiny shapes

Variants (each on every rank; tokens per GPU and layer count fixed for every EP size):

    single_moe      one GPU's worth: all experts local, no FSDP, no collectives, backend="moe"
    ep_moe          experts sharded over all ranks (parallelize_experts), dense parts FSDP2-sharded,
                    backend="moe" with options {"moe.ep_overlap_chunks": 2} (sync-free: tokens all-gathered,
                    partial outputs reduce-scattered; each chunk's collectives scheduled under the other
                    chunk's expert GEMMs)
    ep_moe_chunks1  the same with "moe.ep_overlap_chunks": 1 (one chain, no overlap)
    ep_titan        the anchor: EP the way torchtitan's ExpertParallel does it today (TitanExperts below:
                    counts exchanged, split sizes copied to the host with .tolist(), NCCL all_to_all_single
                    with variable splits, grouped_mm), stock Inductor per block with capture_scalar_outputs
                    (--titan-mode auto: if that fails to compile or run, the dispatch runs eagerly between the
                    compiled graphs instead, and the row's titan_mode says so)
    ep_deepep       DeepEP V1 normal-mode intranode dispatch/combine (deep_ep.Buffer), if `import deep_ep` works

Levels: "layer" = router + routed experts alone (no FSDP, no optimizer: forward + backward with a fixed
output gradient, as moe_layer.py); "model" = embedding, N blocks (attention + MoE), final norm, LM head,
cross-entropy, backward and an AdamW step. Configs (MODELS / LAYERS): Qwen3-30B-A3B widths and a
DeepSeek-V3-like fine-grained config; --tiny shrinks both for CPU checks.

Metrics (one row per level x config x variant, printed as JSON as it finishes; the table last):
  step ms          median over --steps steps (CUDA events; CPU: wall clock), max over ranks
  tokens/s/GPU     tokens per GPU per step / step time
  TFLOP/s/GPU      model FLOPs per GPU per step / step time, by NeMo Automodel's analytic formulas
                   (nemo_automodel/components/utils/flops_utils.py: qwen3_flops, deepseekv3_flops,
                   moe_mlp_flops_calculator; see automodel_* below): 3 x 2 x (GEMM FLOPs) counting only the
                   top-k routed experts (+ shared expert), causal attention halved, LM head included, router,
                   norms and elementwise work not counted. A Qwen3-30B-A3B check against Automodel's own
                   published table is in tests/test_ep_benchmark.py.
  comm ms          union of communication kernel time per step (GPU: kernels whose name contains "nccl"
                   or is a DeepEP dispatch/combine kernel; CPU: gloo worker events)
  exposed comm ms  the part of that union during which NO other GPU activity runs:
                   |union(comm intervals) minus union(compute intervals)| per step, where compute is every
                   other kernel, memcpy and memset of this GPU, on any stream (profiler trace of
                   --profile-steps steps after the timed ones; max over ranks). A communication kernel that
                   waits for a late peer counts as communication, so load imbalance and rank skew show up
                   here. Sum over kinds (a2a = all-to-all / send-recv / DeepEP; gather = all-gather /
                   reduce-scatter / all-reduce: FSDP2's, and ep_moe's token movement, which the kernel names
                   do not tell apart) can exceed the total where kernels of two kinds overlap.
  GPU idle ms      profiled window minus union(all GPU activity), per step: host-bound gaps, e.g. the
                   anchor's .tolist() syncs
  peak GiB         torch.cuda.max_memory_allocated over the timed steps (after warm-up), max over ranks
  loss0            this rank's loss (model) or <out, g>/numel (layer) of the first step, before any
                   optimizer step: every variant starts from the same weights and tokens, so it must agree
                   across variants (the CPU test checks it)
  vs anchor        ep_titan's step time / this variant's step time (same level and config)

One GPU (`--nproc_per_node 1`): the expert-parallel variants run over a group of one rank, every
expert local; the collectives move nothing between GPUs, so each row's excess over single_moe is what
the movement costs on the GPU itself (gathers, layout, the collectives' local copies, the anchor's
host syncs).

Multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are
set unless the caller set them). Parameters are bf16 (CPU: fp32), random fan-in-scaled init, AdamW
(foreach) in the parameters' dtype; attention has no rotary embedding (elementwise work no formula counts,
the same in every variant). A variant that fails prints its error in its row; the others still run.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flops  # noqa: E402  (examples/flops.py)
from ab import length, merge, uncovered  # noqa: E402,F401  (examples/benchmark/ab.py; tests use ep.merge / ep.uncovered)

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
VARIANTS = ("single_moe", "ep_moe", "ep_moe_chunks1", "ep_titan", "ep_deepep")
LEVELS = ("layer", "model")
ANCHOR = "ep_titan"


# ------------------------------------------------------------------------------------------ configs
@dataclasses.dataclass(frozen=True)
class ModelCfg:
    label: str
    layers: int
    hidden: int
    vocab: int
    heads: int
    moe_inter: int
    experts: int
    top_k: int
    seq: int
    batch: int                # sequences per GPU
    kv_heads: int = 0         # GQA (attn="gqa")
    head_dim: int = 0
    shared: int = 0           # shared experts, each moe_inter wide
    router: str = "softmax"   # softmax, renormalised top-k (Qwen3) | sigmoid, renormalised x 2.5 (DeepSeek-V3)
    attn: str = "gqa"         # gqa (Qwen3, with q/k RMSNorm) | mla (DeepSeek-V3 multi-head latent attention)
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclasses.dataclass(frozen=True)
class LayerCfg:
    label: str
    tokens: int               # per GPU
    hidden: int
    inter: int
    experts: int
    top_k: int
    router: str = "softmax"


MODELS = {
    # Qwen3-30B-A3B (its HF config), 8 of its 48 layers
    "qwen3": ModelCfg("Qwen3-30B-A3B widths", layers=8, hidden=2048, vocab=151936, heads=32, kv_heads=4,
                      head_dim=128, moe_inter=768, experts=128, top_k=8, seq=4096, batch=2),
    # DeepSeek-V3's routing (256 fine-grained experts, top-8, one shared expert, sigmoid gate x 2.5, no group
    # limit) and MLA, widths scaled to H=2048 (expert width 512 ~ V3's 2048/7168 ratio) so that 8 layers with
    # all experts fit one GPU for single_moe (V3's own widths: 22.5 GB of expert weights per layer)
    "dsv3": ModelCfg("DeepSeek-V3-like fine-grained (256 experts, top-8, 1 shared, MLA; H=2048)",
                     layers=8, hidden=2048, vocab=129280, heads=16, moe_inter=512, experts=256, top_k=8, seq=4096,
                     batch=1, shared=1, router="sigmoid", attn="mla", q_lora=768, kv_lora=512, qk_nope=128,
                     qk_rope=64, v_head=128),
}
LAYERS = {  # the shapes of moe_layer.py
    "qwen3": LayerCfg("Qwen3-30B-A3B layer", tokens=8192, hidden=2048, inter=768, experts=128, top_k=8),
    "dsv3": LayerCfg("DeepSeek-V3 layer (full widths)", tokens=4096, hidden=7168, inter=2048, experts=256, top_k=8,
                     router="sigmoid"),
}
TINY_MODELS = {
    "qwen3": dataclasses.replace(MODELS["qwen3"], label="tiny qwen3", layers=2, hidden=64, vocab=128, heads=4,
                                 kv_heads=2, head_dim=16, moe_inter=32, experts=8, top_k=2, seq=16, batch=2),
    "dsv3": dataclasses.replace(MODELS["dsv3"], label="tiny dsv3", layers=2, hidden=64, vocab=128, heads=4,
                                moe_inter=16, experts=8, top_k=2, seq=16, batch=1, q_lora=32, kv_lora=16,
                                qk_nope=16, qk_rope=8, v_head=16),
}
TINY_LAYERS = {
    "qwen3": LayerCfg("tiny qwen3 layer", tokens=32, hidden=64, inter=32, experts=8, top_k=2),
    "dsv3": LayerCfg("tiny dsv3 layer", tokens=16, hidden=96, inter=32, experts=8, top_k=2, router="sigmoid"),
}


# ------------------------------------------------------------------------------------------ FLOPs (NeMo Automodel)
# examples/flops.py's formulas (Automodel's qwen3_flops and deepseekv3_flops, re-derived there), fed
# this file's configs under the Hugging Face config names they read.
def _as_hf_config(c: ModelCfg, dense_layers: int = 0, dense_inter: int = 0) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        hidden_size=c.hidden, num_hidden_layers=c.layers, num_attention_heads=c.heads,
        num_key_value_heads=c.kv_heads or c.heads, head_dim=c.head_dim or c.hidden // c.heads,
        num_experts_per_tok=c.top_k, moe_intermediate_size=c.moe_inter, intermediate_size=dense_inter or c.moe_inter,
        vocab_size=c.vocab, q_lora_rank=c.q_lora or None, kv_lora_rank=c.kv_lora, qk_nope_head_dim=c.qk_nope,
        qk_rope_head_dim=c.qk_rope, v_head_dim=c.v_head, first_k_dense_replace=dense_layers)


def automodel_qwen3_flops(c: ModelCfg, gbs: int, seq: int) -> float:
    return flops.qwen3(_as_hf_config(c), gbs, seq)


def automodel_deepseekv3_flops(c: ModelCfg, gbs: int, seq: int, dense_layers: int = 0, dense_inter: int = 0) -> float:
    """Automodel counts ONE shared expert of moe_intermediate_size per MoE layer (our dsv3 has exactly one)."""
    return flops.deepseek_v3(_as_hf_config(c, dense_layers, dense_inter), gbs, seq)


def automodel_moe_mlp_flops(tokens: int, hidden: int, inter: int, top_k: int) -> float:
    """One MoE layer's routed experts (gated): Automodel's moe_mlp_flops_calculator; router not counted."""
    return 6 * tokens * top_k * hidden * inter * 3


def model_flops(c: ModelCfg) -> float:
    return (automodel_deepseekv3_flops if c.attn == "mla" else automodel_qwen3_flops)(c, c.batch, c.seq)


# ------------------------------------------------------------------------------------------ the model
class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class SwiGLU(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_up = nn.Linear(h, 2 * i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class GQA(nn.Module):
    """Qwen3 attention: grouped-query, RMSNorm on q and k per head, causal SDPA."""

    def __init__(self, c: ModelCfg):
        super().__init__()
        self.n, self.kv, self.d = c.heads, c.kv_heads, c.head_dim
        self.q = nn.Linear(c.hidden, self.n * self.d, bias=False)
        self.k = nn.Linear(c.hidden, self.kv * self.d, bias=False)
        self.v = nn.Linear(c.hidden, self.kv * self.d, bias=False)
        self.o = nn.Linear(self.n * self.d, c.hidden, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.d), RMSNorm(self.d)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_norm(self.q(x).view(b, s, self.n, self.d)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, s, self.kv, self.d)).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv, self.d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(o.transpose(1, 2).reshape(b, s, self.n * self.d))


class MLA(nn.Module):
    """DeepSeek-V3 multi-head latent attention: low-rank q, a shared latent for k/v, decoupled rope dims
    (not rotated here), causal SDPA with qk width nope + rope and v width v_head."""

    def __init__(self, c: ModelCfg):
        super().__init__()
        self.c = c
        n = c.heads
        self.wq_a = nn.Linear(c.hidden, c.q_lora, bias=False)
        self.q_norm = RMSNorm(c.q_lora)
        self.wq_b = nn.Linear(c.q_lora, n * (c.qk_nope + c.qk_rope), bias=False)
        self.wkv_a = nn.Linear(c.hidden, c.kv_lora + c.qk_rope, bias=False)
        self.kv_norm = RMSNorm(c.kv_lora)
        self.wkv_b = nn.Linear(c.kv_lora, n * (c.qk_nope + c.v_head), bias=False)
        self.wo = nn.Linear(n * c.v_head, c.hidden, bias=False)

    def forward(self, x):
        c, (b, s, _) = self.c, x.shape
        n = c.heads
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(b, s, n, c.qk_nope + c.qk_rope)
        kv, k_pe = self.wkv_a(x).split([c.kv_lora, c.qk_rope], dim=-1)
        k_nope, v = self.wkv_b(self.kv_norm(kv)).view(b, s, n, c.qk_nope + c.v_head).split([c.qk_nope, c.v_head], -1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(b, s, n, c.qk_rope)], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, n * c.v_head))


def grouped_mm(x, w, offs):
    """x [rows, K] @ w [G, K, N] per group of rows (offs: int32 group ends). CUDA: torch._grouped_mm (bf16);
    CPU: transformers' grouped_mm_fallback, which also traces in fp32 (torch._grouped_mm's meta function
    wants bf16). backend="moe" rewrites either."""
    if x.device.type == "cuda":
        return torch._grouped_mm(x, w, offs=offs)
    # registered by Experts.__init__ (an import in traced code is a graph break on torch 2.11)
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs)


class Experts(nn.Module):
    """E SwiGLU experts in transformers 5's layout (gate_up_proj [E, 2I, H], down_proj [E, H, I]), computed
    the way transformers' grouped_mm implementation does: sort the (token, slot) pairs by expert, grouped
    GEMMs, unsort, sum over top-k. backend="moe" rewrites this form (docs/architecture.md, Forms), with or
    without parallelize_experts."""

    def __init__(self, e, h, i):
        super().__init__()
        try:   # registers torch.ops.transformers.grouped_mm_fallback (the CPU path of grouped_mm)
            import transformers.integrations.moe  # noqa: F401
        except ImportError:   # CUDA runs torch._grouped_mm
            pass
        self.num_experts, self.inter = e, i
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x, ids, w):
        t, k = ids.shape
        e = self.num_experts
        ids_g, perm = torch.sort(ids.reshape(-1), stable=True)
        offs = torch.cumsum(torch.histc(ids_g.float(), bins=e, min=0, max=e - 1), 0, dtype=torch.int32)
        h = grouped_mm(x[perm // k], self.gate_up_proj.transpose(-2, -1), offs=offs)
        g, u = h.chunk(2, dim=-1)
        h = grouped_mm(F.silu(g) * u, self.down_proj.transpose(-2, -1), offs=offs)
        h = h * w.reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        return h[inv].view(t, k, -1).sum(1)


class MoE(nn.Module):
    """Router + routed experts (+ shared experts). Softmax: top-k of the probabilities, renormalised (Qwen3);
    sigmoid: top-k of scores + a selection-only bias (aux-loss-free balancing, zero here), weights renormalised
    x 2.5 (DeepSeek-V3, without its group-limited routing)."""

    def __init__(self, h, i, e, k, router="softmax", shared=0):
        super().__init__()
        self.k, self.router = k, router
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = Experts(e, h, i)
        self.shared = SwiGLU(h, i * shared) if shared else None
        if router == "sigmoid":
            self.register_buffer("score_bias", torch.zeros(e))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = self.gate(x).float()
        if self.router == "softmax":
            w, ids = scores.softmax(-1).topk(self.k, dim=-1)
            w = w / w.sum(-1, keepdim=True)
        else:
            scores = scores.sigmoid()
            ids = (scores + self.score_bias).topk(self.k, dim=-1)[1]
            w = scores.gather(1, ids)
            w = w / w.sum(-1, keepdim=True) * 2.5
        out = self.experts(x, ids, w.to(x.dtype))
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, c: ModelCfg):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.attn = MLA(c) if c.attn == "mla" else GQA(c)
        self.mlp = MoE(c.hidden, c.moe_inter, c.experts, c.top_k, c.router, c.shared)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(self, c: ModelCfg):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def init_weights(module: nn.Module) -> None:
    """Deterministic (seed 0, parameter order, one generator on the parameters' device): fan-in-scaled normal
    for matrices and stacked experts, ones for norms. Every rank builds the same full model with the same
    calls, so every variant starts from the same weights."""
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)


def moe_modules(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


# ------------------------------------------------------------------------------------------ the anchor
def _expert_major(rc: torch.Tensor, rows: int):
    """Received rows come source-major ((source s, local expert j) blocks, rc[s, j] rows each); grouped_mm
    wants expert-major ((j, s) blocks). Returns dest [rows] (received row r -> expert-major row dest[r]), src
    (its inverse) and the local experts' int32 group ends."""
    ep, el = rc.shape
    row = torch.arange(rows, device=rc.device)
    flat = rc.reshape(-1)
    src_end = flat.cumsum(0)
    blk = torch.searchsorted(src_end, row, right=True).clamp(max=flat.numel() - 1)
    within = row - (src_end - flat)[blk]
    em = rc.t().reshape(-1)
    em_start = em.cumsum(0) - em
    dest = em_start[(blk % el) * ep + blk // el] + within
    src = torch.empty_like(dest).scatter_(0, dest, row)
    return dest, src, rc.sum(0).cumsum(0).to(torch.int32)


class TitanExperts(nn.Module):
    """The anchor: expert parallelism as torchtitan's ExpertParallel does it today (pytorch/torchtitan
    torchtitan/distributed/expert_parallel.py, _token_dispatch / _token_combine, read 2026-11-23; this is our
    own code): tokens sorted by global expert, per-expert counts exchanged with an all-to-all, the per-rank
    split sizes copied to the host (one .tolist(): a device-to-host sync per dispatch), all_to_all_single
    with those variable splits, the received rows reordered from source-major to expert-major, grouped_mm on
    the local experts, the inverse reorder, all_to_all_single back, weighted sum over top-k. torchtitan
    compiles each block with capture_scalar_outputs=True, so the splits are unbacked sizes in the graph."""

    def __init__(self, full: Experts, group):
        super().__init__()
        self.group, self.ep, rank = group, group.size(), group.rank()
        self.num_experts, self.inter = full.num_experts, full.inter
        el = self.num_experts // self.ep
        self.gate_up_proj = nn.Parameter(full.gate_up_proj.detach()[rank * el:(rank + 1) * el].clone())
        self.down_proj = nn.Parameter(full.down_proj.detach()[rank * el:(rank + 1) * el].clone())

    def forward(self, x, ids, w):
        import torch.distributed._functional_collectives as fc

        t, k = ids.shape
        ep, e = self.ep, self.num_experts
        ids_g, perm = torch.sort(ids.reshape(-1), stable=True)
        counts = torch.histc(ids_g.float(), bins=e, min=0, max=e - 1).to(torch.int64)
        with torch.no_grad():
            recv_counts = fc.wait_tensor(fc.all_to_all_single(counts, None, None, self.group))
            rc = recv_counts.view(ep, e // ep)                       # [source rank, my local expert]
            send_splits, recv_splits = torch.stack([counts.view(ep, -1).sum(1), rc.sum(1)]).tolist()  # host sync
        recv = fc.all_to_all_single_autograd(x[perm // k], recv_splits, send_splits, self.group)
        dest, src, offs = _expert_major(rc, recv.shape[0])
        h = grouped_mm(recv[src], self.gate_up_proj.transpose(-2, -1), offs=offs)
        g, u = h.chunk(2, dim=-1)
        y = grouped_mm(F.silu(g) * u, self.down_proj.transpose(-2, -1), offs=offs)
        back = fc.all_to_all_single_autograd(y[dest], send_splits, recv_splits, self.group)
        back = back * w.reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        return back[inv].view(t, k, -1).sum(1)


# ------------------------------------------------------------------------------------------ DeepEP
_DEEPEP_BUFFERS: dict = {}


def deepep_status(device) -> str | None:
    """None when the DeepEP variant can run, else why not."""
    if device.type != "cuda":
        return "blocked: no GPU (DeepEP needs CUDA + NVLink)"
    try:
        import deep_ep  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (any import failure: not built, wrong NCCL, ...)
        first = str(exc).splitlines()[0][:80] if str(exc) else ""
        return f"skipped: import deep_ep failed ({type(exc).__name__}: {first})"
    if not hasattr(deep_ep, "Buffer"):
        return "skipped: deep_ep has no V1 Buffer (written against DeepEP V1, e.g. commit 567632d)"
    return None


def _deepep_buffer(group, hidden_bytes: int):
    import deep_ep

    key = group.group_name
    buf = _DEEPEP_BUFFERS.get(key)
    ws = group.size()
    nvl = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, ws)
              for cfg in (deep_ep.Buffer.get_dispatch_config(ws), deep_ep.Buffer.get_combine_config(ws)))
    if buf is None or buf.num_nvl_bytes < nvl:
        deep_ep.Buffer.set_num_sms(24)
        buf = _DEEPEP_BUFFERS[key] = deep_ep.Buffer(group, nvl, 0)
    return buf


class _DeepEPDispatch(torch.autograd.Function):
    """Token-level dispatch (a token goes once to each rank holding any of its experts); backward: combine."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_w, buf, num_experts):
        n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_w, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)   # counts: a host list (DeepEP waits for it)
        ctx.buf, ctx.handle = buf, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx, counts, handle

    @staticmethod
    def backward(ctx, g_x, g_w, *_):
        gx, gw, _ = ctx.buf.combine(g_x.contiguous(), ctx.handle,
                                    topk_weights=None if g_w is None else g_w.float().contiguous())
        return gx, None, gw, None, None


class _DeepEPCombine(torch.autograd.Function):
    """Sums each token's partial outputs over the ranks it was sent to; backward: dispatch with the handle."""

    @staticmethod
    def forward(ctx, y, buf, handle):
        ctx.buf, ctx.handle = buf, handle
        return buf.combine(y, handle)[0]

    @staticmethod
    def backward(ctx, g):
        return ctx.buf.dispatch(g.contiguous(), handle=ctx.handle)[0], None, None


class DeepEPExperts(nn.Module):
    """DeepEP V1 normal-mode intranode dispatch/combine (deep_ep.Buffer, NVLink): tokens (not rows) move, once
    per destination rank; the receiver runs each of its local experts on the tokens routed to it (grouped_mm)
    and sums them per token; combine sums over ranks. The dispatch returns receive counts to the host (normal
    mode, no num_worst_tokens): a host sync per layer, as in the stacks that use DeepEP today. Opaque to
    Dynamo: called outside the compiled graph."""

    def __init__(self, full: Experts, group):
        super().__init__()
        self.group, self.ep, rank = group, group.size(), group.rank()
        self.num_experts, self.inter = full.num_experts, full.inter
        self.e_local = el = self.num_experts // self.ep
        self.gate_up_proj = nn.Parameter(full.gate_up_proj.detach()[rank * el:(rank + 1) * el].clone())
        self.down_proj = nn.Parameter(full.down_proj.detach()[rank * el:(rank + 1) * el].clone())

    @torch.compiler.disable
    def forward(self, x, ids, w):
        import deep_ep

        k = ids.shape[1]
        buf = _deepep_buffer(self.group, x.shape[1] * x.element_size())
        recv_x, recv_w, recv_idx, counts, handle = _DeepEPDispatch.apply(
            x.contiguous(), ids.to(deep_ep.topk_idx_t), w.float(), buf, self.num_experts)
        flat = recv_idx.reshape(-1)
        order = torch.argsort(torch.where(flat >= 0, flat, self.e_local), stable=True)[:sum(counts)]
        tok = order // k
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        h = grouped_mm(recv_x[tok], self.gate_up_proj.transpose(-2, -1), offs=offs)
        g, u = h.chunk(2, dim=-1)
        y = grouped_mm(F.silu(g) * u, self.down_proj.transpose(-2, -1), offs=offs)
        y = y * recv_w.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        per_token = torch.zeros(recv_x.shape[0], y.shape[1], dtype=y.dtype, device=y.device).index_add(0, tok, y)
        return _DeepEPCombine.apply(per_token, buf, handle)


# ------------------------------------------------------------------------------------------ exposed communication
COMM_KINDS = {  # kernel-name substrings (lower case) -> kind; anything else on the GPU is compute
    "a2a": ("alltoall", "all_to_all", "sendrecv", "deep_ep::intranode::dispatch", "deep_ep::intranode::combine",
            "deep_ep::internode", "notify_dispatch", "notify_combine"),
    "gather": ("allgather", "all_gather", "reducescatter", "reduce_scatter", "allreduce", "all_reduce"),
}


def comm_kind(name: str, cpu: bool) -> str | None:
    n = name.lower()
    if cpu:
        if not n.startswith("gloo:"):
            return None
    elif "nccl" not in n and "deep_ep" not in n and "notify_" not in n:
        return None
    for kind, keys in COMM_KINDS.items():
        if any(key in n for key in keys):
            return kind
    return "other"


def trace_intervals(path: str, cpu: bool):
    """(comm intervals by kind, compute intervals, every activity) in microseconds from a chrome trace.
    GPU: kernels, memcpy, memset (not user annotations); CPU: gloo worker events vs aten ops."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    comm, compute, every = {}, [], []
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        name, cat = ev.get("name", ""), ev.get("cat", "")
        span = (float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]))
        if cpu:
            kind = comm_kind(name, True)
            if kind is None and not name.startswith("aten::"):
                continue
        else:
            if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue
            kind = comm_kind(name, False)
        every.append(span)
        if kind is None:
            compute.append(span)
        else:
            comm.setdefault(kind, []).append(span)
    return comm, compute, every


def exposed_comm(path: str, cpu: bool, steps: int) -> dict:
    comm, compute, every = trace_intervals(path, cpu)
    everything = [i for v in comm.values() for i in v]
    out = {"comm_ms": length(merge(everything)) / 1e3 / steps,
           "exposed_ms": uncovered(everything, compute) / 1e3 / steps}
    for kind, ivs in comm.items():
        out[f"exposed_{kind}_ms"] = uncovered(ivs, compute) / 1e3 / steps
    if every:
        window = max(e for _, e in every) - min(s for s, _ in every)
        out["idle_ms"] = (window - length(merge(every))) / 1e3 / steps
    return out


# ------------------------------------------------------------------------------------------ building variants
@dataclasses.dataclass
class Ctx:
    device: torch.device
    dtype: torch.dtype
    cpu: bool
    rank: int
    world: int
    chunks: int
    titan_mode: str = "graph"
    meshes: dict = dataclasses.field(default_factory=dict)

    def mesh(self, name: str):
        """"ep" (the (dp=1, ep=world) mesh; ["dp"] / ["ep"] name its dims) or "all" (every rank, 1-D), made
        once per run: every init_device_mesh call creates new communicators."""
        if name not in self.meshes:
            from torch.distributed.device_mesh import init_device_mesh

            shape, dims = ((1, self.world), ("dp", "ep")) if name == "ep" else ((self.world,), ("all",))
            self.meshes[name] = init_device_mesh(self.device.type, shape, mesh_dim_names=dims)
        return self.meshes[name]


def moe_options(ctx: Ctx, chunks: int) -> dict:
    opts = {"moe.ep_overlap_chunks": chunks}
    if ctx.cpu:
        opts["moe.inductor"] = False   # CPU checks: AOTAutograd only (fast to compile)
    return opts


def build(level: str, cfg, variant: str, ctx: Ctx):
    """(module to train, list of modules to compile, compile kwargs, optional context for the run)."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(ctx.dtype)
    try:
        with torch.device(ctx.device):
            if level == "layer":
                module = MoE(cfg.hidden, cfg.inter, cfg.experts, cfg.top_k, cfg.router)
            else:
                module = Model(cfg)
    finally:
        torch.set_default_dtype(old)
    init_weights(module)
    units = [module] if level == "layer" else list(module.layers)
    run_ctx = contextlib.nullcontext()
    if variant == "single_moe":
        return module, units, dict(backend="moe", options=moe_options(ctx, 1)), run_ctx

    from torch.distributed.fsdp import fully_shard

    import moe_compile

    mesh = ctx.mesh("ep")
    ep_group = mesh["ep"].get_group()
    if variant.startswith("ep_moe"):
        moe_compile.parallelize_experts(module, mesh["ep"])
        compile_kw = dict(backend="moe", options=moe_options(ctx, ctx.chunks if variant == "ep_moe" else 1))
    else:
        cls = TitanExperts if variant == "ep_titan" else DeepEPExperts
        for moe in moe_modules(module):
            moe.experts = cls(moe.experts, ep_group)
            if variant == "ep_titan" and ctx.titan_mode == "eager-dispatch":
                moe.experts.forward = torch.compiler.disable(moe.experts.forward)
        compile_kw = dict(backend="aot_eager" if ctx.cpu else "inductor")
        if variant == "ep_titan" and ctx.titan_mode == "graph":  # torchtitan's apply_compile sets it: the
            # .tolist() splits become unbacked sizes inside the block's graph
            run_ctx = torch._dynamo.config.patch(capture_scalar_outputs=True)
    gc.collect()
    ignored = set()
    if level == "model":  # experts over the ranks holding the same experts (dp), dense parts over every rank
        if variant.startswith("ep_moe"):   # dp has one rank here: the experts stay out of FSDP
            moe_compile.fully_shard_experts(module, mesh["dp"])
            ignored = moe_compile.fsdp_ignored_params(module)
        else:
            for moe in moe_modules(module):
                fully_shard(moe.experts, mesh=mesh["dp"])
                moe.experts.set_gradient_divide_factor(float(ctx.world))
        every_rank = ctx.mesh("all")
        for block in module.layers:
            fully_shard(block, mesh=every_rank, ignored_params=ignored)
        fully_shard(module, mesh=every_rank, ignored_params=ignored)
    return module, units, compile_kw, run_ctx


def make_step(level: str, cfg, module, ctx: Ctx):
    """(step function returning the loss tensor, tokens per GPU, model FLOPs per GPU per step)."""
    gen = torch.Generator(device="cpu").manual_seed(1000 + ctx.rank)
    if level == "layer":
        x = (torch.randn(cfg.tokens, cfg.hidden, generator=gen)).to(ctx.device, ctx.dtype).requires_grad_()
        g = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(ctx.device, ctx.dtype)
        params = list(module.parameters())

        def step():
            for p in params:
                p.grad = None
            x.grad = None
            out = module(x)
            out.backward(g)
            return (out.detach().float() * g.float()).sum() / out.numel()

        return step, cfg.tokens, automodel_moe_mlp_flops(cfg.tokens, cfg.hidden, cfg.inter, cfg.top_k)

    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen).to(ctx.device)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    experts = [p for m in moe_modules(module) for p in m.experts.parameters()]
    seen = {id(p) for p in experts}
    groups = [{"params": experts}, {"params": [p for p in module.parameters() if id(p) not in seen]}]
    opt = torch.optim.AdamW([gr for gr in groups if gr["params"]], lr=1e-5, foreach=not ctx.cpu)

    def step():
        logits = module(inputs)
        loss = F.cross_entropy(logits.view(-1, cfg.vocab).float(), labels.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, cfg.tokens, model_flops(cfg)


# ------------------------------------------------------------------------------------------ running one variant
def _sync(ctx):
    if not ctx.cpu:
        torch.cuda.synchronize()


def _timed(step, ctx, steps):
    times = []
    for _ in range(steps):
        if ctx.cpu:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        else:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def _profile(step, ctx, steps, keep_dir, tag):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] if ctx.cpu else [ProfilerActivity.CUDA]   # GPU: kernels are all it reads
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        _sync(ctx)
    folder = keep_dir or tempfile.mkdtemp(prefix="ep_trace_")
    path = os.path.join(folder, f"{tag}_rank{ctx.rank}.json")
    prof.export_chrome_trace(path)
    try:
        return exposed_comm(path, ctx.cpu, steps)
    finally:
        if not keep_dir:
            os.remove(path)
            os.rmdir(folder)


def _all_ranks_ok(ok: bool, ctx) -> bool:
    if ctx.world == 1:
        return ok
    t = torch.tensor([1 if ok else 0], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _reduce_max(values: dict, ctx) -> dict:
    keys = sorted(values)
    if ctx.world == 1 or not keys:
        return values
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def run_variant(level, name, cfg, variant, ctx, args) -> dict:
    import moe_compile

    row = dict(level=level, config=name, variant=variant, ep=1 if variant == "single_moe" else ctx.world)
    if variant == "ep_titan":
        row["titan_mode"] = ctx.titan_mode
    if variant == "ep_deepep" and (why := deepep_status(ctx.device)):
        row["status"] = why
        return row
    if variant != "single_moe" and ctx.world < 2 and ctx.cpu:
        row["status"] = "skipped: expert parallelism needs >= 2 ranks"
        return row
    torch._dynamo.reset()  # one process compiles several variants: no compiled entry may leak across backends
    module = step = None
    try:
        module, units, compile_kw, run_ctx = build(level, cfg, variant, ctx)
        for unit in units:
            unit.compile(**compile_kw)
        step, tokens, flops = make_step(level, cfg, module, ctx)
        with run_ctx:
            rewritten0 = moe_compile.counters["rewritten"]
            _sync(ctx)
            t0 = time.perf_counter()
            row["loss0"] = float(step())
            _sync(ctx)
            first_ms = (time.perf_counter() - t0) * 1e3
            row["rewritten"] = moe_compile.counters["rewritten"] - rewritten0
            for _ in range(args.warmup):
                step()
            _sync(ctx)
            if not ctx.cpu:
                torch.cuda.reset_peak_memory_stats()
            stats = {"step_ms": _timed(step, ctx, args.steps)}
            if not ctx.cpu:
                stats["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
            if args.profile_steps:
                stats.update(_profile(step, ctx, args.profile_steps, args.keep_traces, f"{level}_{name}_{variant}"))
        stats["compile_s"] = max(0.0, first_ms - stats["step_ms"]) / 1e3
    except Exception as exc:  # noqa: BLE001 (one broken variant must not stop the table)
        msg = str(exc).splitlines()[0][:160] if str(exc) else ""
        row["status"] = f"error: {type(exc).__name__}: {msg}"
        if args.raise_errors:
            raise
    try:
        if _all_ranks_ok("status" not in row, ctx):   # every rank takes part in the same collectives below
            row.update(_reduce_max(stats, ctx))
            row["tokens_per_gpu"] = tokens
            row["tokens_s_gpu"] = tokens / (row["step_ms"] / 1e3)
            row["tflops_gpu"] = flops / (row["step_ms"] / 1e3) / 1e12
            row["status"] = "ok"
        else:
            row.setdefault("status", "error: failed on another rank")
    finally:
        del module, step
        _DEEPEP_BUFFERS.clear()
        torch._dynamo.reset()
        gc.collect()
        if not ctx.cpu:
            torch.cuda.empty_cache()
        if ctx.world > 1:
            dist.barrier()
    return row


# ------------------------------------------------------------------------------------------ reporting
def versions(ctx) -> dict:
    info = dict(torch=torch.__version__, world=ctx.world, device=ctx.device.type)
    if not ctx.cpu:
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
        with contextlib.suppress(Exception):
            import triton
            info["triton"] = triton.__version__
    with contextlib.suppress(Exception):
        import deep_ep  # noqa: F401
        info["deep_ep"] = getattr(deep_ep, "__version__", "importable")
    with contextlib.suppress(Exception):
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    info.update({k: os.environ.get(k, "") for k in MULTICAST_OFF})
    return info


def print_table(rows, info):
    anchor = {(r["level"], r["config"]): r["step_ms"] for r in rows if r["variant"] == ANCHOR and "step_ms" in r}
    print(f"\n## expert parallelism: {info.get('gpu', info['device'])} x {info['world']}, torch {info['torch']}"
          f"{', nccl ' + info['nccl'] if 'nccl' in info else ''}")
    print("| level | config | variant | ep | tokens/GPU | step ms | tokens/s/GPU | TFLOP/s/GPU | vs anchor | comm ms "
          "| exposed comm ms (a2a / gather) | GPU idle ms | peak GiB | loss0 | rewritten | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def f(r, key, fmt):
        v = r.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    for r in rows:
        label = r["variant"] + (f" ({r['titan_mode']})" if r.get("titan_mode", "graph") != "graph" else "")
        head = f"| {r['level']} | {r['config']} | {label} | {r['ep']} |"
        if r.get("status") != "ok":
            print(f"{head} {r.get('status')} |")
            continue
        ratio = anchor.get((r["level"], r["config"]))
        vs = f"{ratio / r['step_ms']:.2f}x" if ratio else "-"
        exposed = f"{f(r, 'exposed_ms', '.2f')} ({f(r, 'exposed_a2a_ms', '.2f')} / {f(r, 'exposed_gather_ms', '.2f')})"
        print(f"{head} {r['tokens_per_gpu']} | {f(r, 'step_ms', '.2f')} | {f(r, 'tokens_s_gpu', ',.0f')} "
              f"| {f(r, 'tflops_gpu', '.0f' if info['device'] == 'cuda' else '.4f')} | {vs} | {f(r, 'comm_ms', '.2f')} "
              f"| {exposed} | {f(r, 'idle_ms', '.2f')} | {f(r, 'peak_gib', '.1f')} | {f(r, 'loss0', '.6g')} "
              f"| {r.get('rewritten', '-')} | {f(r, 'compile_s', '.1f')} |")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU checks)")
    ap.add_argument("--levels", nargs="+", default=list(LEVELS), choices=LEVELS)
    ap.add_argument("--configs", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--chunks", type=int, default=2, help="moe.ep_overlap_chunks of ep_moe")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=2, help="steps profiled for the communication columns")
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--batch", type=int, default=None, help="override sequences per GPU")
    ap.add_argument("--seq", type=int, default=None, help="override the sequence length")
    ap.add_argument("--json", default=None, help="write every row here (rank 0)")
    ap.add_argument("--keep-traces", default=None, metavar="DIR", help="keep the profiler traces here")
    ap.add_argument("--titan-mode", choices=("auto", "graph", "eager-dispatch"), default="auto",
                    help="ep_titan: its dispatch compiled into the block's graph (torchtitan's way, capture_scalar_"
                         "outputs), or run eagerly between graphs; auto: graph, then eager-dispatch if that fails")
    ap.add_argument("--timeout", type=int, default=600, help="process-group timeout, seconds")
    ap.add_argument("--raise-errors", action="store_true", help="raise instead of printing a variant's error")
    return ap.parse_args(argv)


def _init(args) -> tuple[Ctx, bool]:
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    cpu = args.device == "cpu"
    owned = not dist.is_initialized()
    if owned:
        if "RANK" not in os.environ:  # plain `python ep.py`: a group of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if not cpu:
            torch.cuda.set_device(local)
        dist.init_process_group("gloo" if cpu else "nccl", timeout=datetime.timedelta(seconds=args.timeout),
                                **({} if cpu else {"device_id": torch.device("cuda", local)}))
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    ctx = Ctx(device=device, dtype=torch.float32 if cpu else torch.bfloat16, cpu=cpu, rank=dist.get_rank(),
              world=dist.get_world_size(), chunks=args.chunks,
              titan_mode="graph" if args.titan_mode == "auto" else args.titan_mode)
    return ctx, owned


def run(argv=None) -> list[dict]:
    """Every selected level x config x variant on this rank; returns this rank's rows (loss0 is this rank's)."""
    args = parse_args(argv)
    ctx, owned = _init(args)
    models, layers = (TINY_MODELS, TINY_LAYERS) if args.tiny else (MODELS, LAYERS)
    say = print if ctx.rank == 0 else (lambda *a, **k: None)
    info = versions(ctx)
    say("# " + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    if ctx.cpu:
        say("# CPU run (gloo): checks that every variant runs and agrees; its times are not GPU figures", flush=True)
    rows = []
    try:
        for level in args.levels:
            for name in args.configs:
                cfg = layers[name] if level == "layer" else models[name]
                if level == "model":
                    cfg = dataclasses.replace(cfg, **{k: v for k, v in (("layers", args.layers), ("batch", args.batch),
                                                                        ("seq", args.seq)) if v})
                say(f"# {level} {name}: {cfg}", flush=True)
                for variant in args.variants:
                    row = run_variant(level, name, cfg, variant, ctx, args)
                    if variant == ANCHOR and args.titan_mode == "auto" and row["status"].startswith("error"):
                        say(f"# {level} {name} ep_titan in graph mode failed ({row['status']}); again with its "
                            "dispatch outside the compiled graph", flush=True)
                        ctx.titan_mode = "eager-dispatch"
                        row = run_variant(level, name, cfg, variant, ctx, args)
                        ctx.titan_mode = "graph"
                    if ctx.cpu and variant == "ep_deepep":
                        say(f"blocked: no GPU: {level} {name} ep_deepep needs CUDA + NVLink (deep_ep)", flush=True)
                    say(json.dumps(row), flush=True)
                    rows.append(row)
                    if args.json and ctx.rank == 0:
                        with open(args.json, "w") as f:
                            json.dump(dict(info=info, argv=sys.argv if argv is None else argv, rows=rows), f, indent=1)
        if ctx.rank == 0:
            print_table(rows, info)
            sys.stdout.flush()
    finally:
        if owned:
            dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    run()
