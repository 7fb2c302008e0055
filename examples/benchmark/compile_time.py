"""Compile time against depth: whole-model ``torch.compile(model, backend="moe")`` vs per-block
``moe_compile.compile_blocks(model)``, on a small-width Hugging Face Qwen3-MoE (or its plain-loop
form) with 1, 8, 48 layers. Host work only: CPU figures are meaningful.

    python examples/benchmark/compile_time.py                          # 1 8 48 layers, whole + per-block
    python examples/benchmark/compile_time.py --layers 1 8 --form loop --moe-option moe.inductor=False
    python examples/benchmark/compile_time.py --layers 1 8 --modes block --warm --backends moe inductor

Each measurement runs in a fresh process with a fresh Inductor cache (a cold start); compile s = the
first training step (forward + backward, which compiles both) minus the median of --steps later
steps. "graphs" = the graphs Dynamo compiled (1 for per-block: every layer reuses the first
layer's code); "moe layers" = MoE layers running rewritten code in one forward (calls of
moe_compile::route_permute). One compute thread (OMP_NUM_THREADS=1). Widths: hidden 64, 8 experts of 32, top-2, 4 heads, vocab 512, 2 x 64 tokens.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(layers: int, mode: str, form: str, options: dict, steps: int, backend: str = "moe") -> dict:
    """One cold compile in this process (called in a child process)."""
    import torch
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    sys.path.insert(0, HERE)
    import model_step

    import moe_compile

    torch.manual_seed(0)
    model = model_step.build("qwen3", form, True, layers, "cpu", torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    if backend != "moe":   # stock torch.compile: the Inductor options only
        options = {k: v for k, v in options.items() if not k.startswith("moe.")}
    kw = {"options": options} if options else {}
    if mode == "whole":
        fn = torch.compile(model, backend=backend, **kw)
    else:
        moe_compile.compile_blocks(model, backend=backend, **kw)
        fn = model

    def step():
        for p in model.parameters():
            p.grad = None
        fn(input_ids=ids, labels=ids).loss.backward()

    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(input_ids=ids, labels=ids)
    from moe_compile.kernels.runtime_ops import count_calls

    moe_layers = count_calls(prof.events(), "route_permute")
    step_s = statistics.median(times)
    cache = "/".join(str(counters["inductor"].get(f"fxgraph_cache_{k}", 0)) for k in ("hit", "miss", "bypass"))
    return dict(layers=layers, mode=mode, form=form, backend=backend, cache=cache, compile_s=first - step_s,
                step_ms=step_s * 1e3,
                graphs=counters["stats"]["unique_graphs"], moe_layers=moe_layers,
                rewritten_records=moe_compile.counters["rewritten"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", nargs="+", type=int, default=[1, 8, 48])
    ap.add_argument("--modes", nargs="+", default=["whole", "block"], choices=["whole", "block"])
    ap.add_argument("--form", default="hf", choices=["hf", "loop"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="cold compiles per cell (the minimum is kept)")
    ap.add_argument("--moe-option", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--backends", nargs="+", default=["moe"], choices=["moe", "inductor"])
    ap.add_argument("--warm", action="store_true", help="also compile each cell again in a new process, same cache")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    options = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in args.moe_option)}
    if args.child:
        layers, mode, backend = args.child.split(":")
        print("RESULT " + json.dumps(measure(int(layers), mode, args.form, options, args.steps, backend)), flush=True)
        return
    import platform

    import torch

    print(f"# CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"form {args.form}, options {options or '{}'}", flush=True)
    rows = []
    for layers in args.layers:
        for mode in args.modes:
            for backend in args.backends:
                rows += _cell(args, layers, mode, backend)
    one = {(r["mode"], r["backend"], r["start"]): r["compile_s"] for r in rows if r["layers"] == min(args.layers)}
    print("\n| layers | compile | backend | start | compile s | x of 1 layer | FX cache hit/miss/bypass | graphs "
          "| moe layers rewritten | step ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = one.get((r["mode"], r["backend"], r["start"]))
        ratio = r["compile_s"] / base if base else float("nan")
        print(f"| {r['layers']} | {'whole-model' if r['mode'] == 'whole' else 'per-block'} | {r['backend']} "
              f"| {r['start']} | {r['compile_s']:.1f} | {ratio:.2f}x | {r['cache']} | {r['graphs']} | {r['moe_layers']} "
              f"| {r['step_ms']:.0f} |")


def _cell(args, layers: int, mode: str, backend: str) -> list:
    """Cold compiles (--repeats, the fastest kept), each in a fresh process with a fresh Inductor
    cache; with --warm, then one more process on the last cold run's cache."""
    runs = {"cold": [], "warm": []}
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            runs["cold"].append(_child(args, layers, mode, backend, cache))
            if args.warm and repeat == args.repeats - 1:
                runs["warm"].append(_child(args, layers, mode, backend, cache))
    rows = []
    for start in ("cold", "warm"):
        if runs[start]:
            row = min(runs[start], key=lambda r: r["compile_s"])
            row.update(start=start, compile_runs=[round(r["compile_s"], 1) for r in runs[start]])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _child(args, layers: int, mode: str, backend: str, cache: str) -> dict:
    """One compile in a new process whose Inductor cache is ``cache``: its measure() row."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{layers}:{mode}:{backend}", "--form",
           args.form, "--steps", str(args.steps)] + [a for o in args.moe_option for a in ("--moe-option", o)]
    # one compute thread: spinning OpenMP threads on a shared machine made steps of the
    # 48-layer model take 2-27 s, and the first step is measured against them
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"})
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"layers={layers} mode={mode} backend={backend}: the child failed (rc {out.returncode})")
    return json.loads(line[0][len("RESULT "):])


if __name__ == "__main__":
    main()
