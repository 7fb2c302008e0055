"""Helpers shared by the interleaved A/B benchmarks (``gmm_ab.py``, ``fusion_ab.py``) and
``moe_kernels.py``: one argument parser, one header line, one timing loop, one attribute patch."""
from __future__ import annotations

import argparse
import statistics
from typing import Callable


def parse_args(shapes, default_rounds: int = 3) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(shapes), choices=list(shapes))
    ap.add_argument("--rounds", type=int, default=default_rounds)
    return ap.parse_args()


def header() -> None:
    import torch
    import triton

    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")


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
