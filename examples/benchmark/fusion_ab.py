"""A/B of the fusions issue 3 asks about, on the benchmark layers' shapes (GPU, sm90).

    python examples/benchmark/fusion_ab.py                  # 3 interleaved rounds, all shapes
    python examples/benchmark/fusion_ab.py --rounds 5 --shapes gptoss

Each row times a fused kernel right after the unfused pair it would replace (triton.testing.do_bench,
median, L2 flushed), round after round, so clock drift hits both:

    up + SwiGLU      TMA up GEMM, then moe_compile's one-pass swiglu            (what runs)
                     vs the TMA GEMM with SwiGLU in its epilogue (writes h and a; ``sub2``: the
                     epilogue in two column halves)
    down dgrad +     TMA dgrad GEMM da = dy @ W_down^T, then swiglu_backward    (what runs)
    dSwiGLU          vs the dgrad GEMM with dSwiGLU in its epilogue (reads h there, writes dh)
    gather + up      permute_rows (a gather kernel), then the TMA up GEMM       (what runs)
                     vs the pointer grouped GEMM gathering A rows in its loads (ScatterMoE style;
                     TMA cannot gather rows on Hopper)

Before timing, every fused kernel is checked against its unfused pair. Prints ms per round, the
median, and fused / unfused (< 1: the fusion is faster). docs/benchmarks.md records the result and
why the rewrite keeps the unfused kernels.
"""
from __future__ import annotations

import argparse
import statistics

import torch

# name: (tokens T, top-k, experts E, hidden H, expert intermediate I)
SHAPES = {"qwen3": (8192, 8, 128, 2048, 768), "gptoss": (8192, 4, 32, 2880, 2880),
          "mixtral": (4096, 2, 8, 4096, 14336)}
TOLERANCE = 2e-2  # relative Frobenius error between bf16 paths that round at different points


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
    assert err < TOLERANCE, f"fusion_ab: {what} differs from its unfused pair (relative error {err:.3g})"


def _with_sub(tma, sub, fn):
    def run():
        old, tma.EPI_SUB = tma.EPI_SUB, sub
        try:
            return fn()
        finally:
            tma.EPI_SUB = old
    return run


def cases(name: str, g: torch.Generator) -> dict:
    from moe_compile.kernels import _triton_gmm, _triton_moe, _triton_tma as tma, cuda

    t, k, e, hd, i = SHAPES[name]
    dev, bf = "cuda", torch.bfloat16
    ids = torch.randn(t, e, device=dev, generator=g).topk(k, dim=-1).indices
    perm, _, off = cuda.route_permute(ids, e)
    x = torch.randn(t, hd, device=dev, dtype=bf, generator=g)
    xp = _triton_moe.permute_rows(x, perm, off, k)
    w_up = (torch.randn(e, 2 * i, hd, device=dev, dtype=bf, generator=g) * hd**-0.5).transpose(1, 2)  # nn.Linear
    w_dn_t = torch.randn(e, hd, i, device=dev, dtype=bf, generator=g) * i**-0.5  # W_down storage: dgrad operand
    dy = torch.randn(t * k, hd, device=dev, dtype=bf, generator=g)
    a, h = tma.grouped_mm_swiglu(xp, w_up, off)
    _close(a, _triton_moe.swiglu(tma.grouped_mm(xp, w_up, off)), "up + SwiGLU epilogue")
    dh = tma.grouped_mm_dswiglu(dy, w_dn_t, off, h)
    _close(dh, _triton_moe.swiglu_backward(h, tma.grouped_mm(dy, w_dn_t, off)), "dgrad + dSwiGLU epilogue")
    yg = _triton_gmm.grouped_mm(x, w_up, off, gather_idx=perm, top_k=k, num_rows=perm.numel())
    n_routed = int(off[-1])  # setup only: rows past the last group are not written by this kernel
    _close(yg[:n_routed], tma.grouped_mm(xp, w_up, off)[:n_routed], "gather-fused up GEMM")
    up_flop, dn_flop = 2.0 * t * k * hd * 2 * i, 2.0 * t * k * hd * i
    return {
        "up + SwiGLU": (up_flop, lambda: _triton_moe.swiglu(tma.grouped_mm(xp, w_up, off)),
                        {"epilogue": _with_sub(tma, 1, lambda: tma.grouped_mm_swiglu(xp, w_up, off)),
                         "epilogue sub2": _with_sub(tma, 2, lambda: tma.grouped_mm_swiglu(xp, w_up, off))}),
        "down dgrad + dSwiGLU": (dn_flop, lambda: _triton_moe.swiglu_backward(h, tma.grouped_mm(dy, w_dn_t, off)),
                                 {"epilogue": _with_sub(tma, 1, lambda: tma.grouped_mm_dswiglu(dy, w_dn_t, off, h)),
                                  "epilogue sub2": _with_sub(tma, 2, lambda: tma.grouped_mm_dswiglu(dy, w_dn_t, off,
                                                                                                   h))}),
        "gather + up": (up_flop, lambda: tma.grouped_mm(_triton_moe.permute_rows(x, perm, off, k), w_up, off),
                        {"pointer, gather in A-load": lambda: _triton_gmm.grouped_mm(
                            x, w_up, off, gather_idx=perm, top_k=k, num_rows=perm.numel())}),
    }


def main():
    import triton.testing as tt

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import triton

    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    rows = []
    for name in args.shapes:
        cs = cases(name, g)
        times: dict = {}
        for _ in range(args.rounds):
            for op, (_, base, fused) in cs.items():
                for label, fn in [("unfused", base), *fused.items()]:
                    ms = tt.do_bench(fn, warmup=10, rep=100, return_mode="median")
                    times.setdefault((op, label), []).append(ms)
        for op, (flop, _, fused) in cs.items():
            base = statistics.median(times[(op, "unfused")])
            for label in ["unfused", *fused]:
                v = times[(op, label)]
                med = statistics.median(v)
                rows.append((name, op, label, med, ", ".join(f"{x:.3f}" for x in v), flop / med / 1e9, med / base))
    print("\n| shape | product | kernel | ms (median) | rounds | TFLOP/s | vs unfused |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]} | {r[5]:.0f} | {r[6]:.2f}x |")


if __name__ == "__main__":
    main()
