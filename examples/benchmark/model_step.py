"""Whole-model training step on one GPU: Hugging Face MoE causal LMs at their true widths (a few
layers), side by side with plain ModuleList-loop versions of the same layers, eager / stock
torch.compile / backend="moe" / backend="moe" + CUDA graphs, in one run.

    python examples/benchmark/model_step.py                                  # every model, form, variant
    python examples/benchmark/model_step.py --models qwen3 --forms hf --variants eager inductor moe moe_cg
    python examples/benchmark/model_step.py --models qwen3 --per-block       # compile_blocks instead of whole-model
    python examples/benchmark/model_step.py --tiny                           # CPU check: small widths, 2 layers
    python examples/benchmark/model_step.py --models qwen3 --per-block --fsdp # FSDP2 (one rank here;
    torchrun --nproc-per-node 2 examples/benchmark/model_step.py --models qwen3 --per-block --fsdp  # or P ranks)

Models (``MODELS``; ``--layers``/``--batch``/``--seq`` override the defaults):
  qwen3    Qwen3-30B-A3B widths: H 2048, 128 experts of I 768, top-8, GQA 32/4 heads of 128, vocab 151936
  gptoss   GPT-OSS-20B widths: H 2880, 32 experts of I 2880 (biases, clamped SwiGLU), top-4, 64/8 heads of 64,
           sliding window 128 on every other layer, vocab 201088; eager attention (transformers has no SDPA
           path for its attention sinks), so 8 x 1024 tokens
  dsv3     DeepSeek-V3 architecture (MLA, sigmoid routing with score-correction bias, shared experts, routed
           scaling) at Moonlight-16B-A3B's widths: H 2048, 64 experts of I 1408, top-6, 2 shared experts,
           16 heads, kv_lora_rank 512, vocab 163840; every layer MoE. A true-width DeepSeek-V3 MoE layer
           holds 11.3 B parameters, ~90 GB of bf16 weights + gradients + AdamW state: not one GPU's worth
  mixtral  Mixtral-8x7B widths: H 4096, 8 experts of I 14336, top-2, 32/8 heads, vocab 32000
Forms: ``hf`` = the transformers model as is (3-D expert parameters, experts_implementation="grouped_mm");
``loop`` = the same model whose experts module is replaced by a plain ModuleList of per-expert
nn.Linear modules called in a ``torch.where`` + ``index_add_`` loop (``LoopExperts``; same router,
same weights, same function). Variants: ``eager``; ``inductor`` (stock ``torch.compile``; on the loop
form only with --slow: it graph-breaks in every expert); ``moe`` (``backend="moe"``); ``moe_cg``
(``backend="moe"`` with ``options={"triton.cudagraphs": True}``, what ``mode="reduce-overhead"`` sets);
``inductor_cg`` (stock torch.compile with the same option; not in the default set, name it).

Step: ``opt.zero_grad(set_to_none=True)``, ``model(input_ids, labels=input_ids).loss`` (transformers'
shifted cross-entropy, in the compiled graph), ``.backward()``, fused AdamW ``opt.step()`` (eager).
bf16 parameters (fp32 on CPU and under --autocast), random fan-in-scaled init of all-zero router weights, uniform random
tokens, a new batch every step; every variant starts from the same weights and sees the same batches.

Columns: tokens/s and model TFLOP/s per step (FLOPs by NeMo Automodel's formula, ``examples/flops.py``:
3 x 2mnk per GEMM, routed top-k experts only, causal attention halved, LM head included; the same
FLOPs for both forms); step ms = median of --steps CUDA-event-timed steps after --warmup; host ms =
median time to issue one step (no sync); peak GiB = ``max_memory_allocated`` over the timed steps
(under --fsdp on several ranks: the largest rank's);
compile s = first step - median step; "regions rewritten" = MoE regions the backend rewrote while
compiling (``moe_compile.counters``; one per layer for a whole-model compile, one per block class with
--per-block); "moe layers" = calls of ``moe_compile::route_permute`` per
forward in the profiled steps (the number of MoE layers running rewritten code: every MoE layer for
``moe``, 0 for eager and stock compile; "-" for the CUDA-graph variants, whose graph replays call no host op); loss = the first step's loss (all variants start alike).

Time split (``--profile-steps`` steps under torch.profiler, ms per step). ONE rule, the same for every
variant: a GPU kernel (on CPU: a leaf CPU op) belongs to the first part in ``PARTS`` whose pattern
matches its own name or the name of an op on its launch stack (the CPU op that launched it and that
op's parents); "host gaps" = wall time of the profiled steps - the union of kernel intervals (time
the GPU had nothing to run). Consequences of the rule, read the split with them in mind: attention =
the attention kernels (SDPA / flash / memory-efficient, their backward); its q/k/v/o projections are
dense GEMMs (gemm), and GPT-OSS's eager attention (bmm + softmax) is gemm + other. MoE = routing
(top-k, sorts, histograms), permutes, grouped GEMMs, combine, and every kernel launched inside a
moe_compile op; in the eager loop form the per-expert GEMMs are ordinary aten::linear calls and count
as gemm; eager embedding backward's index sort counts as MoE (small). optimizer = fused AdamW.
other = norms, element-wise, loss, copies. record_function ranges the profiler also draws on the GPU
timeline (user annotations, e.g. ``Optimizer.step#AdamW.step``) are not kernels and are not counted
(before this rule's fix they were: the optimizer column of earlier results counted fused AdamW twice).
``--gaps N``: where the host gaps come from: each stretch of GPU idle time is charged to the host op
(and two parents) that launched the kernel ending it, i.e. what the host was busy issuing while the
GPU waited; the N largest launch sites are printed.

--fsdp: ``fully_shard`` on every decoder layer, then on the model (FSDP2 over all ranks; launched
without torchrun it is a one-rank group, which still runs FSDP2's all-gather / free / reduce-scatter
path and so shows its memory behaviour on one GPU). Tokens and figures are per rank; rank 0 prints.

--autocast: mixed precision as Hugging Face's Trainer runs it with ``bf16=True`` and as the plain
PyTorch AMP recipe does: fp32 parameters (and fp32 AdamW state), the forward under
``torch.autocast(device, torch.bfloat16)``, the backward and optimizer step outside it. Products of
fp32 weights then run in bf16 where autocast casts them (nn.Linear, matmul, bmm); transformers' 3-D
``grouped_mm`` experts are not autocast (``torch._grouped_mm`` is not on autocast's lists, and under
torch.compile transformers falls back to its own fp32 loop for non-bf16 weights), so in the ``hf``
form the expert GEMMs run in fp32 in every variant, backend="moe" included (it computes what eager
computes); the ``loop`` form's nn.Linear experts run in bf16. Twice the parameter bytes of a bf16
run: use fewer --layers for the large models.

--act-ckpt: transformers' activation checkpointing (``gradient_checkpointing_enable``, non-reentrant)
on every decoder layer: each layer's forward runs again in the backward ("moe layers" then counts
the recomputed calls too).

Run on a GPU with a fresh Inductor cache (``TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)``); the table is printed last.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import gc
import json
import math
import os
import re
import statistics
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import GpuClocks, add_kernel_arg, apply_kernel_args, length, merge, versions  # noqa: E402  (examples/benchmark/ab.py)
from flops import model_flops  # noqa: E402  (examples/flops.py)


# ------------------------------------------------------------------------------------ models
@dataclasses.dataclass(frozen=True)
class Spec:
    label: str
    config: str              # transformers config class
    lm: str                  # transformers causal-LM class
    widths: dict             # the true widths
    tiny: dict               # --tiny overrides
    layers: int
    batch: int
    seq: int
    attn: str = "sdpa"


_TINY_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
MODELS = {
    "qwen3": Spec("Qwen3-30B-A3B", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                       num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                       head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                       decoder_sparse_step=1, mlp_only_layers=[]),
                  dict(_TINY_COMMON, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2),
                  layers=8, batch=2, seq=4096),
    "gptoss": Spec("GPT-OSS-20B", "GptOssConfig", "GptOssForCausalLM",
                   dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                        sliding_window=128, max_position_embeddings=131072),
                   dict(_TINY_COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                        sliding_window=16),
                   layers=4, batch=8, seq=1024, attn="eager"),
    "dsv3": Spec("DeepSeek-V3-like (Moonlight-16B-A3B widths)", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                 dict(hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, n_routed_experts=64,
                      n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1, norm_topk_prob=True,
                      routed_scaling_factor=2.446, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                      kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                      vocab_size=163840, first_k_dense_replace=0, max_position_embeddings=8192, rms_norm_eps=1e-5),
                 dict(_TINY_COMMON, num_key_value_heads=4, head_dim=8, intermediate_size=64, moe_intermediate_size=32,
                      n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                      kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
                 layers=4, batch=2, seq=4096),
    "mixtral": Spec("Mixtral-8x7B", "MixtralConfig", "MixtralForCausalLM",
                    dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=32768, rms_norm_eps=1e-5),
                    dict(_TINY_COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
                    layers=4, batch=2, seq=4096),
}
TINY_SHAPE = dict(layers=2, batch=2, seq=64)
FORMS = ("hf", "loop")
VARIANTS = ("eager", "inductor", "moe", "moe_cg")
EXTRA_VARIANTS = ("inductor_cg",)   # run only when named
SLOW = ("loop_inductor",)


def make_config(spec: Spec, tiny: bool, layers: int):
    import transformers

    kw = {**spec.widths, **(spec.tiny if tiny else {}), "num_hidden_layers": layers, "use_cache": False,
          "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    cfg = getattr(transformers, spec.config)(**kw)
    cfg._attn_implementation = spec.attn
    cfg._experts_implementation = "grouped_mm"  # transformers 5's default, set as moe_layer.py does (5.17 and 5.23)
    return cfg


class SwiGLUExpert(nn.Module):
    def __init__(self, h, i, bias=False):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(h, i, bias=bias), nn.Linear(h, i, bias=bias), nn.Linear(i, h, bias=bias)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GptOssExpert(nn.Module):
    """GPT-OSS's expert as one module: interleaved gate/up columns, clamped SwiGLU, biases."""

    def __init__(self, h, i, alpha, limit):
        super().__init__()
        self.gate_up, self.down = nn.Linear(h, 2 * i), nn.Linear(i, h)
        self.alpha, self.limit = alpha, limit

    def forward(self, x):
        gu = self.gate_up(x)
        gate, up = gu[..., ::2].clamp(max=self.limit), gu[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return self.down((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class LoopExperts(nn.Module):
    """A drop-in for transformers' experts module (``experts(x, top_k_index, top_k_weights)``),
    written the plain way: a ModuleList of per-expert modules and a loop over experts."""

    def __init__(self, experts):
        super().__init__()
        self.experts = nn.ModuleList(experts)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(top_k_index == i)
            y = expert(hidden_states[tok]) * top_k_weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def to_loop(model: nn.Module) -> int:
    """Replace every transformers experts module (3-D ``gate_up_proj`` / ``down_proj``) by a
    ``LoopExperts`` holding the same weights; returns how many were replaced."""
    todo = [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and getattr(m, "gate_up_proj").dim() == 3]
    for name, m in todo:
        gu, down = m.gate_up_proj.detach(), m.down_proj.detach()
        gu_b, down_b = getattr(m, "gate_up_proj_bias", None), getattr(m, "down_proj_bias", None)
        # [E, in, out] (x @ W[e]) when transformers declares the experts transposed (GPT-OSS), else
        # nn.Linear's [E, out, in]; older versions without the flag: GPT-OSS (the one with biases)
        if getattr(m, "is_transposed", gu_b is not None):
            gu, down = gu.transpose(1, 2), down.transpose(1, 2)
        e, i2, h = gu.shape
        experts = []
        with torch.device(gu.device):
            for k in range(e):
                w_gu, w_down = gu[k], down[k]
                if gu_b is not None:  # GPT-OSS: interleaved gate/up, clamped SwiGLU, biases
                    ex = GptOssExpert(h, i2 // 2, m.alpha, m.limit).to(gu.dtype)
                    ex.gate_up.weight.data.copy_(w_gu), ex.gate_up.bias.data.copy_(gu_b[k])
                    ex.down.weight.data.copy_(w_down), ex.down.bias.data.copy_(down_b[k])
                else:                 # gate = first half of gate_up, up = second half
                    ex = SwiGLUExpert(h, i2 // 2).to(gu.dtype)
                    ex.w1.weight.data.copy_(w_gu[: i2 // 2]), ex.w3.weight.data.copy_(w_gu[i2 // 2:])
                    ex.w2.weight.data.copy_(w_down)
                experts.append(ex)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, LoopExperts(experts).train(m.training))
    return len(todo)


def build(name: str, form: str, tiny: bool, layers: int, device, dtype) -> nn.Module:
    import transformers

    spec = MODELS[name]
    cfg = make_config(spec, tiny, layers)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build the parameters directly in their dtype, on the device
    try:
        with torch.device(device):
            model = getattr(transformers, spec.lm)._from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():  # some inits leave routers at zero: every score would tie
        for n, p in model.named_parameters():
            if p.dim() == 2 and n.endswith(("gate.weight", "router.weight")) and not p.abs().sum():
                p.normal_(0.0, p.shape[-1] ** -0.5)
    if form == "loop":
        to_loop(model)
    return model.train()


def param_count(name: str, tiny: bool, layers: int) -> int:
    """Parameters of the model, from a meta-device build (no memory)."""
    import transformers

    spec = MODELS[name]
    with torch.device("meta"):
        model = getattr(transformers, spec.lm)._from_config(make_config(spec, tiny, layers))
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------ time split
PARTS = (  # (part, pattern): the first part whose pattern matches the kernel or its launch stack
    ("optimizer", r"adam|multi_tensor_apply"),
    ("attention", r"flash|fmha|sdpa|scaled_dot_product|efficient_attention|flex_attention|attention_kernel"),
    ("moe", r"moe_compile|grouped|group_?gemm|groupproblem|gmm|permute_rows|unpermute|combine|swiglu|route_|"
            r"topk|sort|histc|bincount|index_add|searchsorted|quack|empty_groups|wgrad|bias_grad|rows_fixup|"
            r"scale_bwd|permute_scale|saved_copy"),
    # quack: its weight-gradient GEMM; empty_groups: the pass after CUTLASS weight gradients;
    # wgrad / bias_grad / rows_fixup: our Triton weight-gradient (fp32), bias-gradient and list-GEMM kernels;
    # scale_bwd: permute_scale's backward (its forward is the permute_rows kernel)
    # (tests/test_examples.py checks every kernel of kernels/ lands here)
    ("gemm", r"gemm|matmul|\bmm\b|aten::mm|aten::addmm|aten::bmm|aten::linear|cublas|cutlass|nvjet|xmma|"
             r"sm\d\d_|triton_tem"),
)
_PART_RES = [(part, re.compile(pattern, re.IGNORECASE)) for part, pattern in PARTS]
PART_NAMES = [p for p, _ in PARTS] + ["other", "host gaps"]
NOT_COUNTED = "not counted (GPU annotation)"  # --top-kernels' row for what the split skips
WINDOW = "model_step/profiled_steps"  # record_function around the profiled steps


def classify(names) -> str:
    """The part of a kernel given its name followed by the names of its launch stack."""
    for part, regex in _PART_RES:
        if any(regex.search(n) for n in names):
            return part
    return "other"


def _stack_names(op):
    names = []
    while op is not None:
        names.append(op.name)
        op = op.cpu_parent
    return names


def _host_ops(events) -> list:
    """The profiler's host-side (CPU, synchronous) events: ops, and on a GPU the runtime calls."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CPU and not getattr(e, "is_async", False)]


def time_split(events, wall_us: float, steps: int, device: str, kernels: dict | None = None) -> dict:
    """{part: ms per step} from profiler events (see the module docstring for the rule). ``kernels``:
    filled with {(part, kernel name): ms per step} (GPU runs)."""
    from torch.autograd import DeviceType

    cpu_ops = _host_ops(events)
    # (events: those inside the profiled window; a kernel's launch stack may reach outside it)
    parts = dict.fromkeys(PART_NAMES, 0.0)
    intervals = []
    if device == "cuda":
        by_corr = {e.id: e for e in cpu_ops}
        for k in events:
            if k.device_type != DeviceType.CUDA:
                continue
            s, e = k.time_range.start, k.time_range.end
            if getattr(k, "is_user_annotation", False):
                # a record_function range drawn on the GPU timeline (Optimizer.step#AdamW.step spans the
                # optimizer's kernels): not a kernel; counting it counted the optimizer twice
                part = NOT_COUNTED
            else:
                intervals.append((s, e))
                part = classify([k.name] + _stack_names(by_corr.get(getattr(k, "linked_correlation_id", 0))))
                parts[part] += e - s
            if kernels is not None:
                kernels[(part, k.name)] = kernels.get((part, k.name), 0.0) + (e - s) / steps / 1e3
    else:  # CPU: leaf ops stand for kernels
        for op in cpu_ops:
            if op.cpu_children:
                continue
            s, e = op.time_range.start, op.time_range.end
            intervals.append((s, e))
            parts[classify(_stack_names(op))] += e - s
    parts["host gaps"] = max(0.0, wall_us - length(merge(intervals)))
    return {k: v / steps / 1e3 for k, v in parts.items()}


_RUNTIME = re.compile(r"^(cuda|cu[A-Z])")  # the CUDA runtime / driver call that launched a kernel


def gap_causes(events, window_start: float, steps: int, min_gap_us: float = 2.0) -> dict:
    """{launch site: (ms per step, gaps per step)} of the GPU's idle time: each stretch with no kernel
    running (from the window's start, or the end of everything before it) is charged to the kernel
    that ended it, named by the host op that launched that kernel and its two parents (the CUDA
    runtime call left out), innermost first. What the host was doing while the GPU waited; gaps
    shorter than ``min_gap_us`` (launch latency) are left out."""
    from torch.autograd import DeviceType

    cpu_ops = _host_ops(events)
    # the launch call (cudaLaunchKernel, cuLaunchKernelEx, ...) shares the kernel's correlation id: its
    # parents are the ops that launched it (torch 2.11); newer torch also links the kernel to the op
    launches = {e.id: e for e in cpu_ops if _RUNTIME.match(e.name)}
    by_corr = {e.id: e for e in cpu_ops}
    runs = sorted((k for k in events if k.device_type == DeviceType.CUDA
                   and not getattr(k, "is_user_annotation", False)), key=lambda k: k.time_range.start)
    causes: dict = {}
    covered = window_start
    for k in runs:
        gap = k.time_range.start - covered
        if gap >= min_gap_us:
            op = launches.get(k.id) or by_corr.get(getattr(k, "linked_correlation_id", 0))
            names = [n for n in _stack_names(op) if not _RUNTIME.match(n)]
            site = " < ".join(names[:3]) or f"(no host op) {k.name[:60]}"
            ms, n = causes.get(site, (0.0, 0))
            causes[site] = (ms + gap / steps / 1e3, n + 1 / steps)
        covered = max(covered, k.time_range.end)
    return causes


def route_permute_calls(events) -> int:
    """Calls of moe_compile::route_permute (one per rewritten MoE layer per forward), not counting
    the op's own nested dispatch events."""
    from moe_compile.kernels.runtime_ops import count_calls

    return count_calls(events, "route_permute")


# ------------------------------------------------------------------------------------ one variant
def start_process_group(device: str) -> int:
    """The default process group for --fsdp: torchrun's, else a one-rank group. Returns the rank."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group(backend)
        else:  # one rank: an in-process store, no port to collide on
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank()


def shard(model: nn.Module) -> int:
    """FSDP2: each decoder layer, then the rest of the model, sharded over every rank. Returns the
    number of Parameters FSDP2 now holds as DTensors (all of them)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from moe_compile.blocks import find_blocks

    for block in find_blocks(model):
        fully_shard(block)
    fully_shard(model)
    return sum(isinstance(p, DTensor) for p in model.parameters())


def compile_model(model, variant: str, per_block: bool, moe_options: dict, device: str, loss: bool = True):
    backend = {"eager": None, "inductor": "inductor", "inductor_cg": "inductor", "moe": "moe", "moe_cg": "moe"}[variant]
    if backend is None:
        return model
    options = dict(moe_options) if backend == "moe" else {}
    if variant.endswith("_cg"):
        options["triton.cudagraphs"] = True
    if device == "cpu" and options.get("moe.inductor", True):
        options["cpp.enable_kernel_profile"] = True  # CPU: Inductor's kernels show up in the time split
    kw = {"options": options} if options else {}
    if per_block:
        import moe_compile

        moe_compile.compile_blocks(model, backend=backend, loss=loss, **kw)
        return model
    return torch.compile(model, backend=backend, **kw)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_steps(step, steps, device):
    """(median step ms, median host ms to issue one step)."""
    host, pairs, walls = [], [], []
    for _ in range(steps):
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        if device == "cuda":
            e.record()
            pairs.append((s, e))
        else:
            walls.append(host[-1])
    _sync(device)
    times = [s.elapsed_time(e) for s, e in pairs] if device == "cuda" else walls
    return statistics.median(times), statistics.median(host)


CLOCKS = None   # ab.GpuClocks on a GPU while main() runs: SM clock, power, throttle of each timed window


def run_variant(name, form, variant, args, device, dtype) -> dict:
    import moe_compile

    spec = MODELS[name]
    layers = args.layers or (TINY_SHAPE["layers"] if args.tiny else spec.layers)
    batch = args.batch or (TINY_SHAPE["batch"] if args.tiny else spec.batch)
    seq = args.seq or (TINY_SHAPE["seq"] if args.tiny else spec.seq)
    torch._dynamo.reset()  # torch 2.11 reuses a code object's compiled entry across backends otherwise
    model = build(name, form, args.tiny, layers, device, dtype)
    if args.act_ckpt:   # transformers' activation checkpointing: each decoder layer in torch.utils.checkpoint
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sharded = shard(model) if args.fsdp else None
    params = [p for p in model.parameters() if p.requires_grad]
    fused = device == "cuda" or hasattr(torch._C._VariableFunctions, "_fused_adamw_")
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused)
    fn = compile_model(model, variant, args.per_block, args.moe_options, device, loss=not args.eager_loss)
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(3, model.config.vocab_size, (batch, seq), device=device, generator=gen) for _ in range(4)]
    losses, it = [], iter(range(10 ** 9))

    def step():
        ids = batches[next(it) % len(batches)]
        opt.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=args.autocast):
            loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())

    row = dict(model=name, form=form, variant=variant, layers=layers, batch=batch, seq=seq)
    if sharded is not None:
        row["sharded_params"] = sharded
    rewritten0 = moe_compile.counters["rewritten"]
    _sync(device)
    t0 = time.perf_counter()
    step()  # compiles forward and backward
    _sync(device)
    first = time.perf_counter() - t0
    row["rewritten"] = moe_compile.counters["rewritten"] - rewritten0
    for _ in range(args.warmup):
        step()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    row["step_ms"], row["host_ms"] = _timed_steps(step, args.steps, device)   # ends with a synchronize
    if CLOCKS is not None:
        row.update(CLOCKS.window(t0, time.time()))
    if device == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        if args.fsdp and torch.distributed.get_world_size() > 1:   # the largest rank's, not rank 0's
            peak = torch.tensor([row["peak_gib"]], device=device)
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            row["peak_gib"] = peak.item()
    row["compile_s"] = max(0.0, first - row["step_ms"] / 1e3) if variant != "eager" else 0.0
    tokens = batch * seq
    row["tokens_s"] = tokens / (row["step_ms"] / 1e3)
    flops = model_flops(model.config, batch, seq)
    if flops:
        row["tflops"] = flops / (row["step_ms"] / 1e3) / 1e12
    row["loss"] = losses[0].item()
    row["loss_last"] = losses[-1].item()
    if args.memory_peak and device == "cuda" and not variant.endswith("_cg"):
        from moe_layer import _memory_peak   # what one step allocates and still holds at its peak

        _memory_peak(step, f"{name} {form} {variant}", top=args.memory_peak)
    if args.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        _sync(device)
        with profile(activities=acts) as prof:
            step()  # the profiler's own first-step costs stay outside the window
            _sync(device)
            with torch.profiler.record_function(WINDOW):
                for _ in range(args.profile_steps):
                    step()
                _sync(device)
        from torch.autograd import DeviceType

        events = prof.events()
        # the CPU range (on a GPU the profiler also records the range as a GPU-side annotation)
        (win,) = [e for e in events if e.name == WINDOW and e.device_type == DeviceType.CPU]
        start, end = win.time_range.start, win.time_range.end
        events = [e for e in events if start <= e.time_range.start <= end and e.name != WINDOW]
        kernels = {}
        row["split_ms"] = time_split(events, end - start, args.profile_steps, device, kernels)
        if args.top_kernels and kernels:
            print(f"# {name} {form} {variant}: the {args.top_kernels} longest kernels of each part, ms per step")
            for part in PART_NAMES[:-1] + [NOT_COUNTED]:
                top = sorted(((ms, n) for (p, n), ms in kernels.items() if p == part), reverse=True)
                for ms, n in top[:args.top_kernels]:
                    print(f"#   {part:9s} {ms:7.3f}  {n[:150]}")
        if args.gaps and device == "cuda":
            causes = sorted(gap_causes(events, start, args.profile_steps).items(), key=lambda kv: -kv[1][0])
            print(f"# {name} {form} {variant}: GPU idle time by the launch site of the kernel that ended it, "
                  f"ms per step (gaps per step); {len(causes)} sites")
            for site, (ms, n) in causes[:args.gaps]:
                print(f"#   {ms:7.3f} ({n:6.1f})  {site[:160]}")
        # CUDA-graph replays call no host op: the count is only meaningful without graphs
        row["moe_layers"] = None if variant.endswith("_cg") else route_permute_calls(events) // args.profile_steps
    del model, fn, opt, params, batches, losses
    return row


# ------------------------------------------------------------------------------------ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + EXTRA_VARIANTS)
    ap.add_argument("--slow", action="store_true", help=f"also run {SLOW} (stock Inductor on the expert loop)")
    ap.add_argument("--tiny", action="store_true", help="small widths, 2 layers, 2 x 64 tokens: a CPU check")
    ap.add_argument("--per-block", action="store_true", help="moe_compile.compile_blocks (one compile per layer)")
    ap.add_argument("--eager-loss", action="store_true",
                    help="with --per-block: leave model.loss_function eager (compile_blocks(loss=False))")
    ap.add_argument("--act-ckpt", action="store_true",
                    help="model.gradient_checkpointing_enable() (non-reentrant): every decoder layer recomputed in the backward")
    ap.add_argument("--autocast", action="store_true",
                    help="fp32 parameters, the forward under torch.autocast(bfloat16): HF Trainer's bf16=True (see above)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default 3; --tiny 1)")
    ap.add_argument("--profile-steps", type=int, default=None, help="steps under torch.profiler (default 3; 0: none)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--moe-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option for the backend='moe' variants, e.g. moe.inductor=False (value parsed as Python)")
    ap.add_argument("--top-kernels", type=int, default=0, metavar="N",
                    help="print the N longest GPU kernels of each part of the split (before the table)")
    ap.add_argument("--gaps", type=int, default=0, metavar="N",
                    help="print the N launch sites that leave the GPU idle longest (what the host was doing)")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 on every decoder layer and the model (see above)")
    ap.add_argument("--memory-peak", type=int, default=0, metavar="N",
                    help="after timing, one step under the allocator's history: the N largest kinds of block "
                         "allocated in the step and alive at its peak, with where they were allocated")
    ap.add_argument("--json", default=None)
    add_kernel_arg(ap)
    args = ap.parse_args(argv)
    args.steps = args.steps or (3 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.profile_steps = args.profile_steps if args.profile_steps is not None else (2 if args.tiny else 3)
    args.moe_options = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in args.moe_option)}
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" and not args.autocast else torch.float32
    if args.fsdp:
        import torch.distributed as dist

        quiet = start_process_group(device) != 0
        if quiet:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - rank 0 prints the table
    if args.kernel and device != "cuda":
        raise SystemExit("--kernel chooses CUDA kernels; this run is on the CPU")
    apply_kernel_args(args.kernel)
    info = versions(device)
    if args.fsdp:
        info["fsdp_ranks"] = dist.get_world_size()
    print("# " + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    for name in args.models:
        layers = args.layers or (TINY_SHAPE["layers"] if args.tiny else MODELS[name].layers)
        n = param_count(name, args.tiny, layers)
        per = 16 if dtype == torch.float32 else 8   # weight + gradient + two AdamW moments (fp32 moments)
        print(f"# {name}: {MODELS[name].label}, {layers} layers, {n / 1e6:.1f} M parameters, "
              f"~{n * per / 2 ** 30:.1f} GiB of {'fp32' if per == 16 else 'bf16'} weights + gradients + AdamW state",
              flush=True)
    results = []
    global CLOCKS
    with GpuClocks(torch.cuda.current_device()) if device == "cuda" else contextlib.nullcontext() as CLOCKS:
        _run_all(args, device, dtype, results)
    if args.json and not (args.fsdp and dist.get_rank() != 0):
        with open(args.json, "w") as f:
            json.dump(dict(info=info, argv=sys.argv, results=results), f, indent=1)
    print_table(results, info, args)
    if args.fsdp:
        dist.destroy_process_group()
    return results


def _run_all(args, device, dtype, results):
    for name in args.models:
        for form in args.forms:
            for variant in args.variants:
                if f"{form}_{variant}" in SLOW and not args.slow:
                    continue
                row = dict(model=name, form=form, variant=variant)
                if variant.endswith("_cg") and device != "cuda":
                    row["error"] = "skipped: CUDA graphs need a GPU"
                else:
                    try:
                        row = run_variant(name, form, variant, args, device, dtype)
                    except Exception as exc:  # one failing variant (e.g. out of memory) must not stop the table
                        traceback.print_exc()
                        msg = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
                        row["error"] = f"{type(exc).__name__}: {msg}"
                    finally:
                        torch._dynamo.reset()
                        gc.collect()
                        if device == "cuda":
                            torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)
                results.append(row)


def print_table(results, info, args):
    print(f"\n## {info['device']}: " + ", ".join(f"{k} {v}" for k, v in info.items() if k != "device")
          + f" ({'per-block' if args.per_block else 'whole-model'} compile{', FSDP2' if args.fsdp else ''}"
          + f"{', activation checkpointing' if args.act_ckpt else ''}"
          + f"{', fp32 parameters under torch.autocast(bfloat16)' if args.autocast else ''})")
    print("| model | form | variant | layers | tokens | step ms | tokens/s | TFLOP/s | host ms | peak GiB | compile s "
          "| regions rewritten | moe layers | loss | " + " | ".join(f"{p} ms" for p in PART_NAMES) + " | SM MHz |")
    print("|---" * (15 + len(PART_NAMES)) + "|")
    for r in results:
        head = f"| {r['model']} | {r['form']} | {r['variant']} |"
        if "error" in r:
            print(f"{head} {r['error']} |")
            continue

        def f(key, fmt):
            return fmt.format(r[key]) if key in r and r[key] is not None and not math.isnan(r[key]) else "-"

        split = r.get("split_ms", {})
        print(f"{head} {r['layers']} | {r['batch']}x{r['seq']} | {f('step_ms', '{:.1f}')} | {f('tokens_s', '{:.0f}')} "
              f"| {f('tflops', '{:.1f}')} | {f('host_ms', '{:.1f}')} | {f('peak_gib', '{:.1f}')} "
              f"| {f('compile_s', '{:.1f}')} | {r.get('rewritten', '-')} | {'-' if r.get('moe_layers') is None else r['moe_layers']} | {f('loss', '{:.4f}')} | "
              + " | ".join(f"{split[p]:.1f}" if p in split else "-" for p in PART_NAMES) + f" | {f('sm_mhz', '{:.0f}')} |")


if __name__ == "__main__":
    main()
