"""Host cost of ModuleList experts (3 x E separate Parameters) under backend="moe", on the CPU.

    python examples/benchmark/host_cost.py                              # E = 8 32 128, list vs 3-D, Inductor on/off
    python examples/benchmark/host_cost.py --experts 128 --inductor False --profile   # where the time goes
    python examples/benchmark/host_cost.py --experts 32 128 --try compiled_backward guard_filter

One MoE layer, forward + backward (``p.grad = None`` for every parameter first, as optimizers do),
compiled with ``torch.compile(layer, backend="moe")``. ``list``: a ModuleList of E SwiGLU experts
of nn.Linear (w1, w3, w2: 3 x E Parameters); ``3d``: the same loop over three [E, ...] Parameters
(``F.linear(x[tok], self.w1[e])``). Both are rewritten into the same ops. Widths are tiny (H 32,
I 32, 64 tokens, top-2) and the grouped-GEMM kernels are replaced by no-op kernels that only
allocate their outputs (their CPU reference loops over experts, work a GPU does not do on the host),
so a step is the host work a GPU step would also have: Dynamo's guards, AOTAutograd's runtime
wrapper, the custom ops' Python wrappers, the autograd engine (one AccumulateGrad per Parameter).

Times are CPU time of this process (``time.process_time``, one compute thread): host work, not
the time spent waiting for a shared machine's cores. Reported: the fastest step of --rounds interleaved rounds of --steps steps (every case of one E is
compiled first, then timed round by round, so that load from other work on a shared machine hits
them alike; each round's median is in the JSON lines), the forward alone likewise; guards µs = the cache entry's guard check alone
(``guard_manager.check`` on the call's frame locals); per expert parameter µs = (list - 3d) / (3 E).
``--try``: the same measurement with one change that keeps the user's Parameters (same objects, no
new state): ``compiled_backward`` (the backward through ``moe_compile.compiled_backward()``),
``guard_filter`` (``options={"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}``: no
TENSOR_MATCH guards on Parameters), ``unstacked`` (``moe.stack_expert_params=False``: one graph input
and autograd leaf per Parameter, as before lowering/expert_stack.py), ``no_grad_reset`` (the step without setting 3E grads to None:
the part of the cost that is the benchmark's own loop).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import time
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

H, I, T, K = 32, 32, 64, 2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False), nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ListMoE(nn.Module):
    def __init__(self, e):
        super().__init__()
        self.gate = nn.Linear(H, e, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(e))

    def forward(self, x):
        w, ids = F.softmax(self.gate(x), dim=-1).topk(K, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


class StackedMoE(nn.Module):
    def __init__(self, e):
        super().__init__()
        self.e = e
        self.gate = nn.Linear(H, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(e, I, H) / H ** 0.5)
        self.w3 = nn.Parameter(torch.randn(e, I, H) / H ** 0.5)
        self.w2 = nn.Parameter(torch.randn(e, H, I) / I ** 0.5)

    def forward(self, x):
        w, ids = F.softmax(self.gate(x), dim=-1).topk(K, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            xe = x[tok]
            y = F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e])
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out


def install_noop_kernels() -> None:
    """No-op CPU kernels for the grouped GEMMs (outputs allocated, nothing computed)."""
    from moe_compile.kernels import registry

    registry.register("grouped_mm", "cpu", lambda x, w, offsets, bias=None: x.new_zeros(x.shape[0], w.shape[-1]))
    registry.register("grouped_mm_list", "cpu",
                      lambda x, ws, offsets, biases: x.new_zeros(x.shape[0], ws[0].shape[-1]))
    registry.register("grouped_mm_wgrad", "cpu", lambda x, dy, offsets, e: x.new_zeros(
        e, x.shape[1], dy.shape[1], dtype=torch.float32))
    registry.register("grouped_mm_wgrad_lowp", "cpu", lambda x, dy, offsets, e: x.new_zeros(e, x.shape[1], dy.shape[1]))
    registry.register("grouped_bias_grad", "cpu", lambda dy, offsets, e: dy.new_zeros(e, dy.shape[1], dtype=torch.float32))


def _guard_us(fn_code, f_locals, reps=200) -> float:
    """Time of the guard check of the compiled frame's (first) cache entry, µs."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return float("nan")
    entries = _debug_get_cache_entry_list(fn_code)
    if not entries:
        return float("nan")
    gm = entries[0].guard_manager
    if not gm.check(f_locals):
        return float("nan")
    t0 = time.process_time()
    for _ in range(reps):
        gm.check(f_locals)
    return (time.process_time() - t0) / reps * 1e6


def _own_code(cls, tag):
    """A subclass whose forward has its own code object: Dynamo keeps compiled code per code
    object, and the cases must not share (or walk) each other's cache entries."""
    code = cls.forward.__code__
    forward = types.FunctionType(code.replace(co_name=f"forward_{tag or 'plain'}"), cls.forward.__globals__)
    return type(f"{cls.__name__}_{tag or 'plain'}", (cls,), {"forward": forward})


class Case:
    """One compiled layer and its step: built, compiled and checked once, timed in rounds."""

    def __init__(self, form: str, e: int, inductor: bool, change: str | None):
        import moe_compile

        torch.manual_seed(0)
        self.layer = layer = _own_code((ListMoE if form == "list" else StackedMoE), change)(e)
        self.params = params = list(layer.parameters())
        options = {"moe.inductor": inductor}
        if change == "guard_filter":
            options["guard_filter_fn"] = torch.compiler.keep_tensor_guards_unsafe
        if change == "unstacked":
            options["moe.stack_expert_params"] = False
        self.fn = fn = torch.compile(layer, backend="moe", options=options)
        self.x = x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
        g = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
        bwd_ctx = moe_compile.compiled_backward if change == "compiled_backward" else contextlib.nullcontext
        reset = change != "no_grad_reset"

        def step():
            if reset:
                for p in params:
                    p.grad = None
            y = fn(x)
            with bwd_ctx():
                y.backward(g)

        self.step = step
        rewritten0 = moe_compile.counters["rewritten"]
        step()
        self.row = dict(form=form, experts=e, params=len(params), inductor=inductor, change=change or "-",
                        rewritten=moe_compile.counters["rewritten"] - rewritten0, step_us=float("inf"),
                        fwd_us=float("inf"), rounds=[])
        step()
        # the newest cache entry of the layer's forward is this case's (Dynamo puts new entries first)
        self.row["guard_us"] = _guard_us(type(layer).forward.__code__, {"self": layer, "x": x})  # own code: one entry

    def time(self, steps: int) -> None:
        """One round: ``steps`` steps and ``steps`` forwards; keeps the fastest of each."""
        times, fwd = [], []
        for _ in range(steps):
            t0 = time.process_time()
            self.step()
            times.append((time.process_time() - t0) * 1e6)
        for _ in range(steps):
            t0 = time.process_time()
            y = self.fn(self.x)
            fwd.append((time.process_time() - t0) * 1e6)
            del y
        self.row["rounds"].append(round(statistics.median(times)))
        self.row["step_us"] = min(self.row["step_us"], min(times))
        self.row["fwd_us"] = min(self.row["fwd_us"], min(fwd))

    def profile(self, steps: int = 20) -> None:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            self.step()
        pr.disable()
        self.row["profile"] = _profile_by_area(pr, steps)


AREAS = (  # (area, substring of the function's file) in order; first match wins
    ("moe_compile ops (wrappers, layout)", "/kernels/"),
    ("torch.library custom-op dispatch", "torch/_library/"),
    ("AOTAutograd runtime wrappers", "torch/_functorch/"),
    ("Dynamo frame entry (eval_frame, guards)", "torch/_dynamo/"),
    ("Inductor / compiled graph code", "torch/_inductor/"),
    ("autograd engine (backward, AccumulateGrad)", "torch/autograd/"),
    ("op overload calls (torch/_ops.py)", "torch/_ops.py"),
    ("moe_compile backend scope", "/moe_compile/"),
    ("benchmark loop", "host_cost.py"),
)


def _profile_by_area(pr: cProfile.Profile, steps: int) -> dict:
    """Own (tottime) µs per step of every function, summed per area of the code base."""
    stats = pstats.Stats(pr, stream=io.StringIO())
    out: dict = {}
    for (file, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():
        area = next((a for a, key in AREAS if key in file), None)
        if area is None:
            area = f"C / builtins: {name}" if file == "~" else "other Python"
            if file == "~" and not any(k in name for k in ("run_backward", "torch._C", "method")):
                area = "C / builtins (other)"
        out[area] = out.get(area, 0.0) + tottime * 1e6 / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", nargs="+", type=int, default=[8, 32, 128])
    ap.add_argument("--forms", nargs="+", default=["list", "3d"], choices=["list", "3d"])
    ap.add_argument("--inductor", nargs="+", default=["True", "False"], choices=["True", "False"])
    ap.add_argument("--try", dest="changes", nargs="*", default=[],
                    choices=["compiled_backward", "guard_filter", "unstacked", "no_grad_reset"])
    ap.add_argument("--steps", type=int, default=10, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile the list form: own time per area of code")
    ap.add_argument("--real-kernels", action="store_true", help="keep the CPU reference kernels (not host cost)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.real_kernels:
        install_noop_kernels()
    print(f"# CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores (1 thread), torch "
          f"{torch.__version__}, H {H} I {I} T {T} top-{K}, {'CPU reference' if args.real_kernels else 'no-op'} "
          "grouped GEMMs", flush=True)
    rows = []
    for inductor in [a == "True" for a in args.inductor]:
        for e in args.experts:
            torch._dynamo.reset()
            cases = [Case(form, e, inductor, change) for form in args.forms
                     for change in [None] + (args.changes if form == "list" else [])]
            for c in cases:  # warm up
                for _ in range(args.warmup):
                    c.step()
            for _ in range(args.rounds):  # interleaved: load from other work hits every case alike
                for c in cases:
                    c.time(args.steps)
            for c in cases:
                if args.profile and c.row["form"] == "list":
                    c.profile()
                print(json.dumps(c.row), flush=True)
                rows.append(c.row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    base = {(r["experts"], r["inductor"]): r for r in rows if r["form"] == "3d"}
    print("\n| experts | Parameters | moe.inductor | form | change | step µs (fwd+bwd, min) | fwd µs | guards µs "
          "| µs per expert parameter (vs 3-D) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = base.get((r["experts"], r["inductor"]))
        per = (f"{(r['step_us'] - b['step_us']) / (3 * r['experts']):.1f}" if b and r["form"] == "list" else "-")
        print(f"| {r['experts']} | {r['params']} | {r['inductor']} | {r['form']} | {r['change']} | {r['step_us']:.0f} "
              f"| {r['fwd_us']:.0f} | {r['guard_us']:.0f} | {per} |")
    for r in rows:
        if "profile" in r:
            print(f"\n### own time per step by area: E={r['experts']} {r['form']} inductor={r['inductor']} "
                  f"change={r['change']} (µs; cProfile inflates Python-heavy areas)")
            for area, us in r["profile"].items():
                if us >= 5:
                    print(f"  {us:8.0f}  {area}")


if __name__ == "__main__":
    main()
