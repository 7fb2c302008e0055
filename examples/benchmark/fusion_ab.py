"""A/B of a kernel fusion against the unfused pair the rewrite runs, on the benchmark layers' shapes (GPU, sm90).

    python examples/benchmark/fusion_ab.py                  # 3 interleaved rounds, all shapes
    python examples/benchmark/fusion_ab.py --rounds 5 --shapes gptoss

Each row times a fused kernel right after the unfused pair it would replace (triton.testing.do_bench,
median, L2 flushed), round after round, so clock drift hits both:

    gather + up      permute_rows (a gather kernel), then the TMA up GEMM       (what runs)
                     vs the pointer grouped GEMM gathering A rows in its loads (ScatterMoE style;
                     TMA cannot gather rows on Hopper)

Before timing, every fused kernel is checked against its unfused pair. Prints ms per round, the
median, and fused / unfused (< 1: the fusion is faster). docs/benchmarks.md records the result and
why the rewrite keeps the unfused kernels. (SwiGLU in the TMA GEMM's epilogue, forward and dgrad, was
measured here too and removed after it did not pay: docs/benchmarks.md, section 0.)
"""
from __future__ import annotations

import statistics

import torch

# name: (tokens T, top-k, experts E, hidden H, expert intermediate I)
SHAPES = {"qwen3": (8192, 8, 128, 2048, 768), "gptoss": (8192, 4, 32, 2880, 2880),
          "mixtral": (4096, 2, 8, 4096, 14336)}
TOLERANCE = 2e-2  # relative Frobenius error between bf16 paths that round at different points


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
    assert err < TOLERANCE, f"fusion_ab: {what} differs from its unfused pair (relative error {err:.3g})"


def cases(name: str, g: torch.Generator) -> dict:
    from moe_compile.kernels import _triton_gmm, _triton_moe, _triton_tma as tma, cuda

    t, k, e, hd, i = SHAPES[name]
    dev, bf = "cuda", torch.bfloat16
    ids = torch.randn(t, e, device=dev, generator=g).topk(k, dim=-1).indices
    perm, _, off = cuda.route_permute(ids, e)
    x = torch.randn(t, hd, device=dev, dtype=bf, generator=g)
    xp = _triton_moe.permute_rows(x, perm, off, k)
    w_up = (torch.randn(e, 2 * i, hd, device=dev, dtype=bf, generator=g) * hd**-0.5).transpose(1, 2)  # nn.Linear
    yg = _triton_gmm.grouped_mm(x, w_up, off, gather_idx=perm, top_k=k, num_rows=perm.numel())
    n_routed = int(off[-1])  # setup only: rows past the last group are not written by this kernel
    _close(yg[:n_routed], tma.grouped_mm(xp, w_up, off)[:n_routed], "gather-fused up GEMM")
    up_flop = 2.0 * t * k * hd * 2 * i
    return {  # product: (FLOP, what runs, {fused variant: fn})
        "gather + up": (up_flop, lambda: tma.grouped_mm(_triton_moe.permute_rows(x, perm, off, k), w_up, off),
                        {"pointer, gather in A-load": lambda: _triton_gmm.grouped_mm(
                            x, w_up, off, gather_idx=perm, top_k=k, num_rows=perm.numel())}),
    }


def main():
    from ab import cell, cuda_generator, header, interleave, parse_args

    args = parse_args(SHAPES)
    header()
    g = cuda_generator(0)
    rows = []
    for name in args.shapes:
        cs = cases(name, g)
        fns = {(op, label): fn for op, (_, base, fused) in cs.items()
               for label, fn in [("unfused", base), *fused.items()]}
        times = interleave(fns, args.rounds, warmup=10, rep=100)
        for op, (flop, _, fused) in cs.items():
            base = statistics.median(times[(op, "unfused")])
            for label in ["unfused", *fused]:
                med, rounds = cell(times[(op, label)], ".3f")
                rows.append((name, op, label, med, rounds, flop / med / 1e9, med / base))
    print("\n| shape | product | kernel | ms (median) | rounds | TFLOP/s | vs unfused |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]} | {r[5]:.0f} | {r[6]:.2f}x |")

if __name__ == "__main__":
    main()
