"""Helpers shared by the benchmarks: for the interleaved A/B ones (``gmm_ab.py``, ``fusion_ab.py``,
``quack_ab.py``, ``glue_ab.py``) and ``moe_kernels.py`` one argument parser, one header line, one seeded
generator, one timing loop, one attribute patch, one relative error; for ``moe_layer.py`` and ``model_step.py`` one device/versions record; for
``ep.py`` and ``model_step.py`` the interval arithmetic of profiler timelines (``merge``, ``length``,
``uncovered``)."""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable


def parse_args(shapes, default_rounds: int = 3, extra=None) -> argparse.Namespace:
    """--shapes and --rounds; ``extra(ap)`` adds a script's own arguments."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(shapes), choices=list(shapes))
    ap.add_argument("--rounds", type=int, default=default_rounds)
    if extra is not None:
        extra(ap)
    return ap.parse_args()


def header() -> None:
    import torch
    import triton

    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")


def cuda_generator(seed: int = 0):
    """A CUDA random generator seeded ``seed``: every run of a benchmark draws the same inputs."""
    import torch

    return torch.Generator(device="cuda").manual_seed(seed)


def interleave(fns: dict, rounds: int, warmup: int, rep: int) -> dict:
    """{key: [ms per round]}: every function timed once per round, in order, so that clock drift
    between them stays small (triton.testing.do_bench, median, L2 flushed)."""
    import triton.testing as tt

    times: dict = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            times[key].append(tt.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    return times


def cell(values, fmt: str = ".0f") -> tuple[float, str]:
    """(median, "v1, v2, ...") of one row's rounds."""
    return statistics.median(values), ", ".join(format(v, fmt) for v in values)


def rel_err(got, ref) -> float:
    """|got - ref| / |ref| (Frobenius norms, fp32): the A/B scripts' check that a kernel computes the
    reference's values before it is timed."""
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def with_attr(mod, attr: str, value, fn: Callable) -> Callable:
    """``fn`` run with ``mod.attr = value`` (a kernel choice or tile option), restored after."""
    def run(*args):
        old = getattr(mod, attr)
        setattr(mod, attr, value)
        try:
            return fn(*args)
        finally:
            setattr(mod, attr, old)
    return run


def topk_offsets(t: int, k: int, e: int, g, spread: float = 0.0):
    """Group ends (int32 [E], cumulative row counts) of T tokens routed top-k of random logits to E
    experts: group sizes vary around T*k/E, as a router's would. ``spread``: the std of a per-expert
    bias added to the logits (uneven routing: for T=8192, k=8, E=128, 1.5 leaves ~1/3 of the experts
    empty, as the fresh routers of model_step.py do; 0: max / mean rows ~1.1)."""
    import torch

    logits = torch.randn(t, e, device=g.device, generator=g)
    if spread:
        logits = logits + torch.randn(e, device=g.device, generator=g) * spread
    ids = logits.topk(k, dim=-1).indices.reshape(-1)
    return torch.cumsum(torch.bincount(ids, minlength=e), 0).to(torch.int32)


def add_kernel_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kernel", action="append", default=[], metavar="NAME=VALUE",
                    help="a kernel choice of moe_compile.kernels.cuda for this run, e.g. WGRAD_BACKEND=cutlass "
                         "or GMM_BACKEND=triton (set before anything runs; printed with the versions)")


def apply_kernel_args(pairs: list[str]) -> None:
    """Set each NAME=VALUE of --kernel on moe_compile.kernels.cuda (a module-level choice that exists)."""
    if not pairs:
        return
    import ast

    from moe_compile.kernels import cuda

    for pair in pairs:
        name, value = pair.split("=", 1)
        if not hasattr(cuda, name):
            raise SystemExit(f"--kernel {pair}: moe_compile.kernels.cuda has no {name}")
        old = getattr(cuda, name)
        setattr(cuda, name, value if isinstance(old, str) else type(old)(ast.literal_eval(value)))


def versions(device: str = "cuda") -> dict:
    """Device and library versions for a result table: on "cuda" the GPU (name, SMs) and CUDA, else the CPU."""
    import torch
    import transformers

    info = dict(torch=torch.__version__, transformers=transformers.__version__)
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info = dict(device=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda, **info)
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = "missing"
        from moe_compile.kernels import _quack, cuda

        info["wgrad"] = cuda.WGRAD_BACKEND
        info["lean launch"] = cuda.LEAN_LAUNCH
        if p.major == 9:  # where kernels/cuda.py would run quack's weight gradient
            if _quack.available():
                import quack
                info["quack"] = quack.__version__
                info["quack scheduler"] = cuda.WGRAD_SCHEDULER
            else:
                info["quack"] = "missing"
    else:
        import platform
        info = dict(device=f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                           f"{torch.get_num_threads()} threads)", **info)
    return info


class GpuClocks:
    """SM clock, power and throttle reasons of GPU ``index``, from ``nvidia-smi`` sampled every
    ``period_ms`` in a child process inside a ``with`` block; ``window(t0, t1)`` sums up
    the samples stamped between two ``time.time()`` readings. Without nvidia-smi every figure is NaN.
    The H200 runs these layers at its power cap (docs/benchmarks.md section 8): a variant's clock says
    how much of a ratio is the kernels and how much the power they draw. Short windows hold few samples
    (``samples``): time more steps for a steady figure.

        with GpuClocks() as clocks:
            t0 = time.time(); ...timed steps...; torch.cuda.synchronize(); t1 = time.time()
            clocks.window(t0, t1)   # {"sm_mhz": median, "power_w": max, "throttle": OR of reasons, "samples": n}
    """

    QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"

    def __init__(self, index: int = 0, period_ms: int = 50):
        self.index, self.period_ms, self.proc, self.samples = index, period_ms, None, []

    def __enter__(self) -> "GpuClocks":
        import shutil
        import subprocess
        import threading

        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "-i", str(self.index), f"--query-gpu={self.QUERY}",
                                          "--format=csv,noheader,nounits", f"-lms={self.period_ms}"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        import datetime

        for line in self.proc.stdout:
            try:
                stamp, mhz, watts, reasons = (x.strip() for x in line.split(","))
                t = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time, as time.time()
                self.samples.append((t, float(mhz), float(watts), int(reasons, 16)))
            except ValueError:
                continue

    def window(self, t0: float, t1: float) -> dict:
        time.sleep(2 * self.period_ms / 1e3)   # the samples of the window's end
        got = [s for s in list(self.samples) if t0 <= s[0] <= t1]
        nan = float("nan")
        if not got:
            return dict(sm_mhz=nan, power_w=nan, throttle="-", samples=0)
        reasons = 0
        for s in got:
            reasons |= s[3]
        return dict(sm_mhz=statistics.median(s[1] for s in got), power_w=max(s[2] for s in got),
                    throttle=hex(reasons), samples=len(got))

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


# ------------------------------------------------------------------------------------------ timelines
def merge(intervals):
    """Union of [start, end) intervals as a sorted, disjoint list."""
    out = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [tuple(i) for i in out]


def length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def uncovered(a, b) -> float:
    """|union(a) minus union(b)|: the time in a's intervals during which no interval of b is running."""
    a, b = merge(a), merge(b)
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total
