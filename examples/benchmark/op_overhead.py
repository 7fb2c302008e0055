"""Host cost of one call of each moe_compile op, as a compiled graph makes it (grad mode off).

    python examples/benchmark/op_overhead.py                  # CUDA, Qwen3-30B-A3B layer widths
    python examples/benchmark/op_overhead.py --device cpu     # tiny widths, reference kernels
    python examples/benchmark/op_overhead.py --kernel LEAN_LAUNCH=False   # Triton's own launch path

Per op, median µs of host time per call (the GPU is synchronised after every call, outside the timed
part, so a full launch queue never stalls the host; the five ways are called in turn):
- ``default``: ``torch.ops.moe_compile.<op>.default``, the ``torch.library.custom_op`` overload user
  code and Dynamo's graphs call (Python autograd kernel, backend wrapper, then the op's function);
- ``rt``: the twin ``torch.ops.moe_compile_rt.<op>`` compiled graphs call after
  ``lowering/runtime_ops.py`` (the same function registered straight with the dispatcher);
- ``function``: the op's Python function called directly (argument checks, kernel choice, launch);
- ``kernel``: the device implementation alone (``registry.implementation``), i.e. allocation and
  launch(es);
- ``kernel, Triton launch``: the same with ``kernels/cuda.LEAN_LAUNCH=False`` (each Triton kernel
  launched through ``kernel[grid](...)`` instead of ``kernels/_launch.py``).
The table is printed last, with the device and versions.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

QWEN3 = (8192, 2048, 768, 128, 8)   # T, H, I, E, k
TINY = (64, 32, 32, 8, 2)


def timed_interleaved(fns: dict, n: int, sync) -> dict:
    """Median host µs per call of each function, the functions called in turn (one call each per
    round), so that drift in the host's speed hits them alike."""
    for fn in fns.values():
        for _ in range(5):
            fn()
    sync()
    ts = {k: [] for k in fns}
    for _ in range(n):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
            sync()
    return {k: statistics.median(v) * 1e6 for k, v in ts.items()}


def _without_lean_launch(impl, args):
    from moe_compile.kernels import cuda

    cuda.LEAN_LAUNCH = False
    try:
        impl(*args)
    finally:
        cuda.LEAN_LAUNCH = True


def cases(device: str, shape):
    """(op name, args of the op, args of its device implementation) for one MoE layer's forward
    and backward ops, at ``shape``'s widths."""
    import moe_compile.kernels.ops  # noqa: F401

    m = torch.ops.moe_compile
    t, h, i, e, k = shape
    g = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(t, h, device=device, dtype=bf, generator=g)
    scores = torch.randn(t, e, device=device, generator=g)
    w13 = torch.randn(e, 2 * i, h, device=device, dtype=bf, generator=g)
    w2 = torch.randn(e, h, i, device=device, dtype=bf, generator=g)
    with torch.no_grad():
        topw, sel = m.router_topk(scores, k)
        perm, inv, offs = m.route_permute(sel, e)
        xp = m.permute_rows(x, perm, inv, offs, k)
        hh = m.grouped_mm(xp, w13.transpose(1, 2), offs, None)
        a = m.swiglu(hh)
        y = m.grouped_mm(a, w2.transpose(1, 2), offs, None)
    wt = topw.to(bf)
    return [
        ("router_topk", (scores, k), (scores, k)),
        ("route_permute", (sel, e), (sel, e)),
        ("permute_rows", (x, perm, inv, offs, k), (x, perm, offs, k)),
        ("grouped_mm", (xp, w13.transpose(1, 2), offs, None), (xp, w13.transpose(1, 2), offs, None)),
        ("swiglu", (hh,), (hh,)),
        ("unpermute_combine", (y, inv, wt, offs), (y, inv, wt, offs)),
        ("unpermute_combine_backward", (x, y, inv, wt, offs), (x, y, inv, wt, offs)),
        ("swiglu_backward", (hh, a), (hh, a)),
        ("grouped_mm_wgrad_lowp", (a, y, offs, e), (a, y, offs, e)),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--calls", type=int, default=200)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ab import add_kernel_arg, apply_kernel_args, versions

    add_kernel_arg(ap)
    args = ap.parse_args()
    apply_kernel_args(args.kernel)

    info = versions(args.device)
    print("# " + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    from moe_compile.kernels import registry
    from moe_compile.kernels.runtime_ops import NAMESPACE, OPS

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    shape = QWEN3 if args.device == "cuda" else TINY
    rows = []
    with torch.no_grad():
        for name, op_args, impl_args in cases(args.device, shape):
            packet = getattr(torch.ops.moe_compile, name)
            impl = registry.implementation(name, op_args[0])
            row = dict(op=name, **timed_interleaved(dict(
                default=lambda: packet.default(*op_args),
                rt=lambda: getattr(getattr(torch.ops, NAMESPACE), name).default(*op_args),
                function=lambda: OPS[name]._init_fn(*op_args),
                kernel=lambda: impl(*impl_args),
                kernel_triton=lambda: _without_lean_launch(impl, impl_args)), args.calls, sync))
            rows.append(row)
            print(row, flush=True)
    print(f"\n## host µs per call, {info.get('device', args.device)}, torch {torch.__version__}, T H I E k = {shape}")
    cols = ("default", "rt", "function", "kernel", "kernel_triton")
    print("| op | default (custom op) | rt | function | kernel | kernel, Triton launch | default - rt "
          "| Triton launch - kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | " + " | ".join(f"{r[c]:.1f}" for c in cols)
              + f" | {r['default'] - r['rt']:.1f} | {r['kernel_triton'] - r['kernel']:.1f} |")
    print("| sum | " + " | ".join(f"{sum(r[c] for r in rows):.0f}" for c in cols)
          + f" | {sum(r['default'] - r['rt'] for r in rows):.0f} | {sum(r['kernel_triton'] - r['kernel'] for r in rows):.0f} |")


if __name__ == "__main__":
    main()
