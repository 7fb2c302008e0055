"""A/B of the grouped GEMM kernels on the forward and dgrad products of the benchmark layers.

    python examples/benchmark/gmm_ab.py                 # all shapes, 3 interleaved rounds
    python examples/benchmark/gmm_ab.py --rounds 5 --shapes qwen3_down mixtral_down

Per shape and round, each kernel is timed right after the other (triton.testing.do_bench, median,
L2 flushed), so clock drift between kernels is small; kernel-to-kernel differences of a few percent
are below run-to-run noise otherwise. Kernels: "tma" = kernels/_triton_tma.py (what backend="moe"
runs on sm90), "cutlass" = torch._grouped_mm, "pointer" = kernels/_triton_gmm.py. Routing is top-k
of random logits (group sizes vary around T*k/E), operands bf16 random normal, fan-in scaled.
Prints TFLOP/s per round and the median over rounds.

``--floors``: what the TMA kernel loses against two floors instead of the other kernels, on the same
operands and in the same rounds: "routed" (the routing above), "even" (every group M/E rows: on
these shapes a multiple of 128, so no group has a partly filled last 128-row tile) and "dense" (one
cuBLAS GEMM of the same M, K, N with one expert's weight: no per-group tiles, one weight read).
routed / even is the cost of the groups' partial last tiles; even / dense the cost of grouping.

    python examples/benchmark/gmm_ab.py --floors --shapes qwen3_up qwen3_down moonlight_up moonlight_down

``--tma-from FILE``: also time another revision of the TMA kernel ("tma_file", ratios "tma" / "tma_file"),
e.g. ``git show REV:kernels/_triton_tma.py > /tmp/tma_rev.py`` then ``--tma-from /tmp/tma_rev.py``
(the file is loaded as a module of moe_compile.kernels: its relative imports resolve to the installed
tree, so the tile schedule it inlines from ``_triton_gmm`` is the installed one).
"""
from __future__ import annotations

import torch

# name: (tokens T, top-k, experts E, contraction K, output N, weight storage); routed rows M = T*k.
# "nk": the nn.Linear layout [E, N, K] seen as [E, K, N] (forward); "kn": row-major [E, K, N] (dgrad)
SHAPES = {
    "qwen3_up": (8192, 8, 128, 2048, 1536, "nk"),
    "qwen3_down": (8192, 8, 128, 768, 2048, "nk"),
    "qwen3_up_dgrad": (8192, 8, 128, 1536, 2048, "kn"),
    "qwen3_down_dgrad": (8192, 8, 128, 2048, 768, "kn"),
    "gptoss_up": (8192, 4, 32, 2880, 5760, "nk"),
    "gptoss_up_dgrad": (8192, 4, 32, 5760, 2880, "kn"),
    "mixtral_up": (4096, 2, 8, 4096, 28672, "nk"),
    "mixtral_down": (4096, 2, 8, 14336, 4096, "nk"),
    # model_step.py's DeepSeek-V3-like model (Moonlight-16B-A3B widths: 64 experts, ~768 rows each)
    "moonlight_up": (8192, 6, 64, 2048, 2816, "nk"),
    "moonlight_down": (8192, 6, 64, 1408, 2048, "nk"),
    "moonlight_up_dgrad": (8192, 6, 64, 2816, 2048, "kn"),
    "moonlight_down_dgrad": (8192, 6, 64, 2048, 1408, "kn"),
    # moe_layer.py's DeepSeek-V3-like layer (256 experts, ~128 rows each)
    "dsv3_up": (4096, 8, 256, 7168, 4096, "nk"),
    "dsv3_down": (4096, 8, 256, 2048, 7168, "nk"),
}


def _load_tma_revision(path: str):
    """Another revision of kernels/_triton_tma.py, as the module moe_compile.kernels._triton_tma_file."""
    import importlib.util
    import sys

    name = "moe_compile.kernels._triton_tma_file"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _kernel_runs(x, w, offs, tma_file=None) -> dict:
    """The three kernels on the routed groups (and a TMA kernel revision), each checked against
    torch._grouped_mm first."""
    from ab import rel_err

    from moe_compile.kernels import _triton_gmm, _triton_tma

    runs = {
        "tma": lambda: _triton_tma.grouped_mm(x, w, offs),
        "cutlass": lambda: torch._grouped_mm(x, w, offs=offs),
        "pointer": lambda: _triton_gmm.grouped_mm(x, w, offs),
    }
    if tma_file is not None:
        runs["tma_file"] = lambda: tma_file.grouped_mm(x, w, offs)
    ref = runs["cutlass"]()
    for kname, fn in runs.items():
        err = rel_err(fn(), ref)
        assert err < 1e-2, (kname, err)
    return runs


def _floor_runs(x, w, offs) -> dict:
    """--floors: the TMA kernel on the routed groups, on even groups, and one dense GEMM."""
    from moe_compile.kernels import _triton_tma

    e, m = w.shape[0], x.shape[0]
    even = torch.arange(1, e + 1, device=x.device, dtype=torch.int32) * (m // e)
    return {
        "routed": lambda: _triton_tma.grouped_mm(x, w, offs),
        "even": lambda: _triton_tma.grouped_mm(x, w, even),
        "dense": lambda: x @ w[0],
    }


def main():
    from ab import cell, cuda_generator, header, interleave, parse_args, topk_offsets

    def extra(ap):
        ap.add_argument("--floors", action="store_true", help="routed vs even groups vs one dense GEMM (module docstring)")
        ap.add_argument("--tma-from", default=None, metavar="FILE",
                        help="also time this revision of kernels/_triton_tma.py (module docstring)")

    args = parse_args(SHAPES, extra=extra)
    header()
    tma_file = _load_tma_revision(args.tma_from) if args.tma_from else None
    g = cuda_generator(0)
    table, names = {}, []
    for name in args.shapes:
        t, top_k, e, k, n, layout = SHAPES[name]
        m = t * top_k
        offs = topk_offsets(t, top_k, e, g)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        if layout == "nk":
            w = (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5).transpose(1, 2)
        else:
            w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5
        runs = _floor_runs(x, w, offs) if args.floors else _kernel_runs(x, w, offs, tma_file)
        names = list(runs)
        flop = 2.0 * m * k * n
        for kname, ms in interleave(runs, args.rounds, warmup=25, rep=150).items():
            table[(name, kname)] = [flop / r / 1e9 for r in ms]
    ratios = list(zip(names, names[1:])) if args.floors else [("tma", "cutlass")] + [("tma", "tma_file")] * bool(tma_file)
    print("\n| GEMM | " + " | ".join(f"{k} TFLOP/s (rounds)" for k in names)
          + "".join(f" | {a} / {b}" for a, b in ratios) + " |")
    print("|---|" + "---|" * (len(names) + len(ratios)))
    for name in args.shapes:
        meds = {kname: cell(table[(name, kname)]) for kname in names}
        cells = [f"**{med:.0f}** ({rounds})" for med, rounds in meds.values()]
        print(f"| {name} | " + " | ".join(cells)
              + "".join(f" | {meds[a][0] / meds[b][0]:.2f}x" for a, b in ratios) + " |")


if __name__ == "__main__":
    main()
