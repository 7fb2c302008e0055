"""A/B of the weighted SwiGLU kernels (forward and backward) at expert parallelism's receive-buffer
shapes: M = ep*T*k rows, about T*k of them routed (balanced), the rest zero padding. Compares the
kernels of this tree with those of another git revision (its kernels/_triton_act.py, imported beside
this one), checks that their outputs are bit-identical, and prints a table (triton.testing.do_bench).

    python examples/benchmark/swiglu_padded_ab.py --against 5277b0e      # on a GPU
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = {"qwen3": (8192, 8, 128, 768), "dsv3": (4096, 8, 256, 2048)}   # T, k, E, I


def kernels_of(rev: str):
    """kernels/_triton_act.py of git revision ``rev`` (or the file at that path), imported as a module
    of its own."""
    if os.path.isfile(rev):
        with open(rev) as f:
            src = f.read()
    else:
        src = subprocess.run(["git", "show", f"{rev}:kernels/_triton_act.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
    src = src.replace("from ._launch import lean", "from moe_compile.kernels._launch import lean")
    path = os.path.join(tempfile.mkdtemp(), "act_at_rev.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("act_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def operands(t, k, e, n, ep, device):
    m, routed, local = ep * t * k, t * k, e // ep
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(m, 2 * n, device=device, dtype=torch.bfloat16, generator=g)
    h[routed:] = 0                                   # padded rows are zero (the grouped GEMM's contract)
    da = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=g)
    weights = torch.rand(m // k, k, device=device, generator=g)
    perm = torch.randperm(m, device=device, generator=g)
    offsets = torch.full((local,), routed // local, device=device).cumsum(0).to(torch.int32)
    return m, routed, (h, weights, perm, offsets), da


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="git revision (or file) whose kernels are 'old'")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--ep", nargs="+", type=int, default=[1, 2, 4, 8])
    args = ap.parse_args(argv)
    import triton
    import triton.testing

    from moe_compile.kernels import _triton_act as new

    old = kernels_of(args.against)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"old = {args.against}")
    print("| layer | ep | rows (routed) | identical | fwd us old -> new | bwd us old -> new | saved us |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes:
        for ep in args.ep:
            m, routed, ops, da = operands(*SHAPES[name], ep, "cuda")
            same = torch.equal(old.weighted_swiglu(*ops), new.weighted_swiglu(*ops)) and all(
                torch.equal(a, b) for a, b in zip(old.weighted_swiglu_backward(*ops, da),
                                                  new.weighted_swiglu_backward(*ops, da)))
            us = {(tag, d): triton.testing.do_bench(fn, rep=200) * 1e3
                  for tag, mod in (("old", old), ("new", new))
                  for d, fn in (("fwd", lambda mod=mod: mod.weighted_swiglu(*ops)),
                                ("bwd", lambda mod=mod: mod.weighted_swiglu_backward(*ops, da)))}
            saved = sum(us["old", d] - us["new", d] for d in ("fwd", "bwd"))
            print(f"| {name} | {ep} | {m} ({routed}) | {same} | {us['old', 'fwd']:.0f} -> {us['new', 'fwd']:.0f} | "
                  f"{us['old', 'bwd']:.0f} -> {us['new', 'bwd']:.0f} | {saved:.0f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
