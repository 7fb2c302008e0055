"""One MoE layer, side by side: plain-loop eager / + Inductor, HF grouped_mm eager / + Inductor,
torchtitan's layer as written (up to v0.2.0: gather + scatter_add; since v0.2.1: ``titan2``, the unsort combine)
eager / + Inductor, torch.compile(..., backend="moe") on each, and
the moe_compile ops called by hand (what the backend should emit). One process, one GPU, bf16 parameters with random init, median of --steps steps.

    python examples/benchmark/moe_layer.py --shapes qwen3 gptoss mixtral --json out.json
    python examples/benchmark/moe_layer.py --shapes qwen3 --variants hf_inductor loop_moe --slow
    python examples/benchmark/moe_layer.py --micro --shapes qwen3        # per-kernel times vs floors
    python examples/benchmark/moe_layer.py --shapes qwen3 --variants hf_inductor hf_moe --memory-peak
                                          # what is alive at one step's memory peak, and where it came from
    python examples/benchmark/moe_layer.py --shapes qwen3 --variants hf_inductor hf_moe --host-profile prof/
                                          # where the host's time to issue a step goes (cProfile, .pstats files)
    python examples/benchmark/moe_layer.py --shapes qwen3 --variants hf_moe loop_moe --ab-kernel LEAN_LAUNCH=False
                                          # a runtime kernel choice A/B, interleaved in one process

TFLOP/s use 3 x (T*k*6*H*I + 2*T*H*E) for forward+backward and 1x for the forward ("fwd" is the
training forward: autograd on, no backward). "vs best" divides by the fastest anchor (variants a-d)
measured in the same run. The table is printed last.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SHAPES = {  # name: (T, H, I, E, k)
    "qwen3": (8192, 2048, 768, 128, 8),
    "gptoss": (8192, 2880, 2880, 32, 4),
    "mixtral": (4096, 4096, 14336, 8, 2),
    "dsv3": (4096, 7168, 2048, 256, 8),
}
LABELS = {"qwen3": "Qwen3-30B-A3B", "gptoss": "GPT-OSS-20B-like", "mixtral": "Mixtral-8x7B", "dsv3": "DeepSeek-V3-like"}
ANCHORS = ("loop_eager", "loop_inductor", "hf_eager", "hf_inductor", "titan_eager", "titan_inductor",
           "titan2_eager", "titan2_inductor")
VARIANTS = ANCHORS + ("loop_moe", "hf_moe", "titan_moe", "titan_moe_cg", "titan2_moe", "titan2_moe_cg", "ops_eager", "ops_inductor", "ops_lowp_inductor", "loop_moe_cg", "hf_moe_cg", "loop_moe_ca")
SLOW = ("loop_inductor",)  # stock Inductor on the per-expert loop: minutes of compile, graph breaks


# ------------------------------------------------------------------------------------ models
class Expert(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.w1 = nn.Linear(h, i, bias=False)
        self.w3 = nn.Linear(h, i, bias=False)
        self.w2 = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PlainLoopMoE(nn.Module):
    """Mixtral-reference style: softmax top-k router (renormalised), torch.where + index_add_."""

    def __init__(self, h, i, e, k):
        super().__init__()
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(Expert(h, i) for _ in range(e))
        self.k = k

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        topw, sel = torch.topk(probs, self.k, dim=-1)
        topw = (topw / topw.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(sel == i)
            out.index_add_(0, tok, expert(x[tok]) * topw[tok, slot, None])
        return out


def hf_block(h, i, e, k):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k,
                         norm_topk_prob=True, experts_implementation="grouped_mm")
    cfg._experts_implementation = "grouped_mm"
    return Qwen3MoeSparseMoeBlock(cfg)


class TitanLayer(nn.Module):
    """torchtitan's MoE layer as it is written (models/moe: TokenChoiceTopKRouter, TokenReorderer,
    GroupedExperts with torch._grouped_mm), softmax router with renormalised top-k as Qwen3, its default
    score_before_experts=True (the weights scale the expert input rows in fp32), no shared expert."""

    def __init__(self, h, i, e, k):
        super().__init__()
        self.gate = nn.Linear(h, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self.w3 = nn.Parameter(torch.empty(e, i, h))
        self.e, self.k = e, k

    def forward(self, x):
        t, dim = x.shape
        scores = F.softmax(self.gate(x).to(torch.float32), dim=1)
        top, sel = torch.topk(scores, k=self.k, dim=1)
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        counts = torch.histc(sel.view(-1).float(), bins=self.e, min=0, max=self.e)
        order = torch.argsort(sel.view(-1), stable=True)
        top_sorted = top.view(-1)[order]
        tok = order // self.k
        rows = torch.gather(x, dim=0, index=tok.reshape(-1, 1).expand(-1, dim))
        rows = (rows.to(torch.float32) * top_sorted.reshape(-1, 1)).to(x.dtype)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(rows.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(rows.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(rows)
        return torch.zeros_like(x).scatter_add(dim=0, index=tok.reshape(-1, 1).expand(-1, dim), src=y)


class TitanV2Layer(TitanLayer):
    """torchtitan's MoE layer since v0.2.1 (models/moe/moe.py): the router picks on the scores plus its
    ``expert_bias`` (auxiliary-loss-free balancing; a zeros buffer here) with ``topk(sorted=False)``,
    takes the weights as ``scores.gather(1, ids)`` and counts ``tokens_per_expert`` under no_grad; rows
    ``x[order // k]``; the combine unsorts the expert rows into a zeros buffer by the sort's order
    (``buf[order] = y``), viewed [T, k, H] and summed over k (score_before_experts=True, its default;
    with False a bmm with the top-k scores in fp32)."""

    def __init__(self, h, i, e, k, score_before=True):
        super().__init__(h, i, e, k)
        self.score_before = score_before
        self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(e, dtype=torch.float32), persistent=False)

    def forward(self, x):
        t, dim = x.shape
        scores = F.softmax(self.gate(x).to(torch.float32), dim=1)
        _, sel = torch.topk(scores + self.expert_bias, k=self.k, dim=-1, sorted=False)
        top = scores.gather(dim=1, index=sel)
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        counts = torch.histc(sel.view(-1).float(), bins=self.e, min=0, max=self.e)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        order = torch.argsort(sel.view(-1), stable=True)
        rows = x[order // self.k]
        if self.score_before:
            rows = (rows.to(torch.float32) * top.view(-1)[order].reshape(-1, 1)).to(x.dtype)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(rows.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(rows.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(rows)
        unsorted = torch.zeros((t * self.k, dim), dtype=y.dtype, device=y.device)
        unsorted[order] = y
        unsorted = unsorted.reshape(-1, self.k, dim)
        if self.score_before:
            return unsorted.sum(dim=1)
        return torch.bmm(top.reshape(-1, 1, self.k), unsorted.float()).to(x.dtype).squeeze(1)


class _GmmLowp(torch.autograd.Function):
    """grouped_mm whose weight gradient is rounded once to bf16 inside the GEMM and produced in the
    parameter's own layout (fused.grouped_mm_weight_grad): what ops.py's backward could do."""

    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return torch.ops.moe_compile.grouped_mm(x, w, offsets, None)

    @staticmethod
    def backward(ctx, dy):
        from moe_compile.kernels import ops as fused

        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.ops.moe_compile.grouped_mm(dy, w.transpose(1, 2), offsets, None)
        dw = fused.grouped_mm_weight_grad(x, dy, offsets, w.shape[0], w.dtype, w.stride(-2) == 1)
        return dx, dw, None


class OpsMoE(nn.Module):
    """The lowering's target, written by hand: router, route_permute, permute_rows, grouped_mm on
    stacked weights in HF layout (w13 [E, 2I, H], w2 [E, H, I], used as transposed views), SwiGLU,
    grouped_mm, unpermute_combine."""

    def __init__(self, h, i, e, k, lowp_wgrad=False):
        super().__init__()
        from moe_compile.kernels import ops  # noqa: F401  (registers the ops)

        self.gate = nn.Linear(h, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self.e, self.k, self.i, self.lowp = e, k, i, lowp_wgrad

    def forward(self, x):
        moe = torch.ops.moe_compile
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        topw, sel = torch.topk(probs, self.k, dim=-1)
        topw = (topw / topw.sum(-1, keepdim=True)).to(x.dtype)
        perm, inv, offs = moe.route_permute(sel, self.e)
        xp = moe.permute_rows(x, perm, inv, offs, self.k)
        gmm = _GmmLowp.apply if self.lowp else (lambda a, w, o: moe.grouped_mm(a, w, o, None))
        hh = gmm(xp, self.w13.transpose(1, 2), offs)
        a = F.silu(hh[:, :self.i]) * hh[:, self.i:]
        y = gmm(a, self.w2.transpose(1, 2), offs)
        return moe.unpermute_combine(y, inv, topw, offs)


def _hf_call(m):
    def call(x):  # HF blocks take [B, S, H]; some versions also return router logits
        out = m(x.view(1, *x.shape))
        return (out[0] if isinstance(out, tuple) else out).view(x.shape)
    return call


def build(variant, shape, moe_options=None):
    t, h, i, e, k = shape
    # torch 2.11 reuses a code object's compiled entry across backends: without a reset, hf_moe ran
    # hf_inductor's compiled code (0 regions rewritten, 0.1 s "compile")
    torch._dynamo.reset()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build bf16 parameters directly on the GPU
    try:
        with torch.device("cuda"):
            if variant.startswith("loop"):
                model = PlainLoopMoE(h, i, e, k)
            elif variant.startswith("hf"):
                model = hf_block(h, i, e, k)
            elif variant.startswith("titan2"):
                model = TitanV2Layer(h, i, e, k)
            elif variant.startswith("titan"):
                model = TitanLayer(h, i, e, k)
            else:
                model = OpsMoE(h, i, e, k, lowp_wgrad="lowp" in variant)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)  # random (never zeros), fan-in scaled
    model = model.to(device="cuda", dtype=torch.bfloat16)
    wrap = _hf_call if variant.startswith("hf") else (lambda m: m)
    if variant.endswith("_inductor"):
        return model, torch.compile(wrap(model))
    if variant.endswith(("_moe", "_moe_ca")):  # _ca: + compiled_backward (run_variant)
        return model, torch.compile(wrap(model), backend="moe", options=moe_options)
    if variant.endswith("_moe_cg"):  # + CUDA graphs (Inductor cudagraph trees): no per-kernel launch cost
        return model, torch.compile(wrap(model), backend="moe", options={**(moe_options or {}), "triton.cudagraphs": True})
    return model, wrap(model)


# ------------------------------------------------------------------------------------ timing
def _events_median(fn, steps):
    """(median GPU ms per step between CUDA events, median host ms to issue one step). A host time
    close to the GPU time means the step is host-bound: the GPU waits for the next launch."""
    pairs, host = [], []
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in pairs)
    return ts[len(ts) // 2], sorted(host)[len(host) // 2]


def _profile(fn, label):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    avg = prof.key_averages()
    print(f"### profile {label} (3 steps)")
    print(avg.table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))
    print(f"### host side {label} (3 steps)")
    print(avg.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))


def _host_profile(fn, label, steps, out_dir, top=30):
    """cProfile of the host issuing ``steps`` steps (no sync inside): the functions with the most own
    time, per step; the whole profile goes to ``out_dir/<label>.pstats`` (``python -m pstats``)."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, label.replace(" ", "_").replace("+", "") + ".pstats")
    prof.dump_stats(path)
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    total = st.total_tt / steps * 1e3
    st.sort_stats("tottime").print_stats(top)
    print(f"### host profile {label}: {total:.2f} ms per step under cProfile ({steps} steps, {path})")
    lines = buf.getvalue().splitlines()
    start = next((n for n, line in enumerate(lines) if "ncalls" in line), 0)
    print("\n".join(line for line in lines[start:] if line.strip()))


def _frame_site(frames) -> str:
    """Where a block was allocated: the innermost frames of the compiled graph's code or moe_compile
    (else the innermost frame outside torch's own files), with the generated line of Inductor's code."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    generated = cache_dir()
    keep = [f for f in frames if f["filename"].startswith(generated) or "moe_compile" in f["filename"]
            or "/kernels/" in f["filename"] or "/lowering/" in f["filename"]]
    keep = keep or [f for f in frames if "/torch/" not in f["filename"]] or frames
    site = " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in keep[:3])
    if keep and keep[0]["filename"].startswith(generated):  # which buffer of the compiled graph
        import linecache

        site += "  [" + linecache.getline(keep[0]["filename"], keep[0]["line"]).strip()[:120] + "]"
    return site


def peak_live(trace) -> tuple[int, dict]:
    """(bytes, {address: (size, frames)}) of the blocks allocated in an allocator trace and alive at
    its highest point; frees of blocks allocated before the trace started are ignored."""
    live, total, best, at_peak = {}, 0, 0, {}
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            total += ev["size"]
            if total > best:
                best, at_peak = total, dict(live)
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    return best, at_peak


def _memory_peak(fn, label, top=12):
    """Blocks allocated during one step and alive at its peak, largest first, with where they were
    allocated (torch.cuda.memory._record_memory_history; CUDA-graph variants: not visible)."""
    torch.cuda.synchronize()
    entries = 500_000
    torch.cuda.memory._record_memory_history(max_entries=entries, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    if len(trace) >= entries:
        print(f"### memory {label}: the step made more than {entries} allocator events; the trace lost its "
              "start and the figure below is too low")
    best, at_peak = peak_live(trace)
    print(f"### memory {label}: {best / 2**20:.1f} MiB allocated in the step and alive at its peak")
    sites: dict = {}
    for size, frames in at_peak.values():
        key = (size, _frame_site(frames))
        sites[key] = sites.get(key, 0) + 1
    for (size, site), n in sorted(sites.items(), key=lambda kv: -kv[0][0] * kv[1])[:top]:
        print(f"  {n} x {size / 2**20:8.2f} MiB  {site}")


def _ab_kernel(fn, steps, pair, rounds=6):
    """Interleaved A/B of a kernels/cuda.py choice read at run time (e.g. LEAN_LAUNCH): ``rounds``
    rounds of ``steps`` steps with the current value (A) and with ``pair``'s (B), same compiled code.
    Returns {a_ms, a_host_ms, b_ms, b_host_ms}: medians over the rounds of each round's medians."""
    import ast
    import statistics

    from moe_compile.kernels import cuda

    name, value = pair.split("=", 1)
    a_value = getattr(cuda, name)
    b_value = value if isinstance(a_value, str) else type(a_value)(ast.literal_eval(value))
    got = {"a": [], "b": []}
    try:
        for _ in range(rounds):
            for side, v in (("a", a_value), ("b", b_value)):
                setattr(cuda, name, v)
                fn()  # one step to settle (e.g. a new compiled-kernel key)
                got[side].append(_events_median(fn, steps))
    finally:
        setattr(cuda, name, a_value)
    out = {}
    for side, pairs in got.items():
        out[f"{side}_ms"] = statistics.median(p[0] for p in pairs)
        out[f"{side}_host_ms"] = statistics.median(p[1] for p in pairs)
    return out


CLOCKS = None   # ab.GpuClocks while main() runs the variants: the SM clock, power and throttle of each timed window


def run_variant(variant, shape, steps, warmup, profile=False, moe_options=None, memory_peak=False, host_profile=None,
                ab_kernel=None):
    t, h, i, e, k = shape
    torch.manual_seed(0)
    model, fn = build(variant, shape, moe_options)
    params = list(model.parameters())
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    import moe_compile

    # _ca: the backward through compiled autograd (one compiled graph instead of an engine node per parameter)
    backward_ctx = moe_compile.compiled_backward if variant.endswith("_ca") else contextlib.nullcontext

    def fwd_bwd():
        for p in params:  # what optimizer.zero_grad() does (model.zero_grad() walks every submodule)
            p.grad = None
        x.grad = None
        torch.compiler.cudagraph_mark_step_begin()
        y = fn(x)
        with backward_ctx():
            y.backward(g)

    def fwd():
        torch.compiler.cudagraph_mark_step_begin()
        fn(x)

    res = {}
    rewritten0 = moe_compile.counters["rewritten"]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fwd_bwd()  # compiles forward + backward for compiled variants
    res["rewritten"] = moe_compile.counters["rewritten"] - rewritten0  # MoE regions the backend rewrote
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        fwd_bwd()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    res["fwdbwd_ms"], res["host_ms"] = _events_median(fwd_bwd, steps)   # ends with a synchronize
    if CLOCKS is not None:
        res.update(CLOCKS.window(t0, time.time()))
    res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["act_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    model.zero_grad(set_to_none=True)
    x.grad = None
    for _ in range(warmup):
        fwd()
    res["fwd_ms"] = _events_median(fwd, steps)[0]
    if profile:
        _profile(fwd_bwd, f"{variant} fwd+bwd")
    if memory_peak:
        _memory_peak(fwd_bwd, f"{variant} fwd+bwd")
    if host_profile:
        _host_profile(fwd_bwd, f"{variant} fwd+bwd", steps, host_profile)
    if ab_kernel and not variant.endswith(("eager", "_inductor")):
        res["ab"] = _ab_kernel(fwd_bwd, steps, ab_kernel)
        a = res["ab"]
        print(f"### A/B {variant}: as is: fwd+bwd ms {a['a_ms']:.2f}, host ms {a['a_host_ms']:.2f}; "
              f"with {ab_kernel}: fwd+bwd ms {a['b_ms']:.2f}, host ms {a['b_host_ms']:.2f}", flush=True)
    res["compile_s"] = max(0.0, first - res["fwdbwd_ms"] / 1e3) if not variant.endswith("eager") else 0.0
    del model, fn, x, g
    return res


def flops(shape):
    t, h, i, e, k = shape
    return t * k * 6 * h * i + 2 * t * h * e


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=None, choices=VARIANTS)
    ap.add_argument("--slow", action="store_true", help=f"also run {SLOW} (stock Inductor on the loop)")
    ap.add_argument("--tokens", type=int, default=None, help="override T for every shape")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--micro", action="store_true", help="per-kernel micro-benchmark instead of layers")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of each variant's step")
    ap.add_argument("--memory-peak", action="store_true",
                    help="print the blocks alive at one step's memory peak and where they were allocated")
    ap.add_argument("--host-profile", default=None, metavar="DIR",
                    help="cProfile the host issuing --steps steps of each variant; print the top functions, "
                         "write DIR/<variant>.pstats")
    ap.add_argument("--ab-kernel", default=None, metavar="NAME=VALUE",
                    help="also time each moe variant with this kernels/cuda.py choice, interleaved with the "
                         "current one in one process (choices read at run time, e.g. LEAN_LAUNCH=False)")
    ap.add_argument("--no-clocks", action="store_true",
                    help="no nvidia-smi sampling (SM MHz / W / throttle columns empty)")
    ap.add_argument("--moe-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option for the backend='moe' variants, e.g. moe.debug=True (value parsed as Python)")
    from ab import GpuClocks, add_kernel_arg, apply_kernel_args, versions

    add_kernel_arg(ap)
    args = ap.parse_args()
    apply_kernel_args(args.kernel)
    info = versions("cuda")
    print("# " + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    if args.micro:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import moe_kernels
        rows = [r for name in args.shapes for r in moe_kernels.run(name, _shape(name, args), args.steps)]
        if args.json:
            json.dump(dict(info=info, micro=rows), open(args.json, "w"), indent=1)
        moe_kernels.print_table(rows)
        return
    variants = args.variants or [v for v in VARIANTS if args.slow or v not in SLOW]
    moe_options = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in args.moe_option)} or None
    results = []
    global CLOCKS
    with contextlib.nullcontext() if args.no_clocks else GpuClocks(torch.cuda.current_device()) as CLOCKS:
        _run_all(args, variants, moe_options, results)
    _finish(args, info, results)


def _run_all(args, variants, moe_options, results):
    for name in args.shapes:
        shape = _shape(name, args)
        for v in variants:
            row = dict(shape=name, variant=v, T=shape[0])
            try:
                row.update(run_variant(v, shape, args.steps, args.warmup, args.profile, moe_options, args.memory_peak,
                                       args.host_profile and os.path.join(args.host_profile, name),
                                       args.ab_kernel))
            except Exception as exc:  # one broken variant must not stop the table
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
            finally:
                torch._dynamo.reset()
                gc.collect()
                torch.cuda.empty_cache()
            for mode, mult in (("fwdbwd", 3), ("fwd", 1)):
                if f"{mode}_ms" in row:
                    row[f"{mode}_tflops"] = mult * flops(shape) / (row[f"{mode}_ms"] * 1e-3) / 1e12
            print(json.dumps(row), flush=True)
            results.append(row)


def _finish(args, info, results):
    for r in results:
        for mode in ("fwdbwd", "fwd"):
            best = [a[f"{mode}_ms"] for a in results if a["shape"] == r["shape"] and a["variant"] in ANCHORS
                    and f"{mode}_ms" in a]
            if best and f"{mode}_ms" in r:
                r[f"{mode}_vs_best"] = min(best) / r[f"{mode}_ms"]
    if args.json:
        json.dump(dict(info=info, argv=sys.argv, results=results), open(args.json, "w"), indent=1)
    print_table(results, info)


def _shape(name, args):
    t, h, i, e, k = SHAPES[name]
    return (args.tokens or t, h, i, e, k)


def print_table(results, info):
    print(f"\n## {info['device']} torch {info['torch']} triton {info['triton']} transformers {info['transformers']}")
    print("| shape | T | variant | fwd+bwd ms | TFLOP/s | vs best | host ms | fwd ms | TFLOP/s | vs best | peak GiB "
          "| act GiB | compile s | regions rewritten | SM MHz (median) | W (max) | throttle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['shape']} | {r['T']} | {r['variant']} | error: {r['error']} |")
            continue
        f = lambda key, fmt: (fmt.format(r[key]) if key in r and not math.isnan(r[key]) else "-")  # noqa: E731
        print(f"| {r['shape']} | {r['T']} | {r['variant']} | {f('fwdbwd_ms', '{:.2f}')} | {f('fwdbwd_tflops', '{:.0f}')} "
              f"| {f('fwdbwd_vs_best', '{:.2f}x')} | {f('host_ms', '{:.2f}')} | {f('fwd_ms', '{:.2f}')} | {f('fwd_tflops', '{:.0f}')} "
              f"| {f('fwd_vs_best', '{:.2f}x')} | {f('peak_gib', '{:.1f}')} | {f('act_gib', '{:.1f}')} "
              f"| {f('compile_s', '{:.1f}')} | {r.get('rewritten', '-')} | {f('sm_mhz', '{:.0f}')} | {f('power_w', '{:.0f}')} "
              f"| {r.get('throttle', '-')} |")


if __name__ == "__main__":
    main()
