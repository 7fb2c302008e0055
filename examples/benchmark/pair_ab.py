"""torchtitan's w1 / w3 (two [E, I, H] Parameters of one input): what grouped_mm_cat runs, against what it
replaced and against one weight.

    python examples/benchmark/pair_ab.py                  # all shapes, 3 interleaved rounds
    python examples/benchmark/pair_ab.py --shapes gptoss --rounds 5

Per shape, the first projection's forward ([M, H] rows -> [M, 2I]) and its input gradient ([M, 2I] ->
[M, H]), each three ways, timed one right after the other per round (ab.interleave):

- "ours": what ``cuda.grouped_mm_cat`` / ``grouped_mm_cat_dx`` run on sm90: the forward as two TMA
  launches writing the halves of one [M, 2I] output (``_triton_tma.grouped_mm_halves``), the input
  gradient as one launch over both weights (a 4-D descriptor [2, E, I, H] across the two allocations,
  K = 2I: ``_triton_tma.grouped_mm_cat_dx``);
- "two": two TMA grouped GEMMs of width I into two outputs (the input gradient: two and their sum),
  what the lowering emitted before grouped_mm_cat;
- "one": one TMA grouped GEMM over a concatenated [E, 2I, H] weight (the Hugging Face layout): the
  ceiling.

TFLOP/s of the same FLOPs (2 * M * H * 2I) for all three. Values are checked against "one" before
timing (the forward bit-equal, the input gradient within bf16 rounding: one fp32 sum there against two
rounded products added). Until commit e6f6130 the forward also ran as one launch over both weights
(N tiles that divide I): on an H200 0.48x of "two" at GPT-OSS-20B widths (64-column tiles), 0.80x at
Moonlight widths, 0.92-1.00x elsewhere, so it went.
"""
from __future__ import annotations

import torch

# name: (tokens T, top-k, experts E, hidden H, expert width I)
SHAPES = {
    "qwen3": (8192, 8, 128, 2048, 768),
    "gptoss": (8192, 4, 32, 2880, 2880),
    "mixtral": (4096, 2, 8, 4096, 14336),
    "moonlight": (8192, 6, 64, 2048, 1408),
    "dsv3": (4096, 8, 256, 7168, 2048),
}
DX_REL = 1e-2   # dx: one fp32 sum of K = 2I against two bf16 products added (each ~4e-3 relative)


def _runs(x, dy, w1, w3, offs) -> dict:
    from ab import rel_err

    from moe_compile.kernels import _triton_tma

    w13 = torch.cat([w1, w3], dim=1)                  # [E, 2I, H]: the Hugging Face layout
    w1t, w3t, w13t = (w.transpose(1, 2) for w in (w1, w3, w13))
    i = w1.shape[1]
    dy1, dy3 = dy[:, :i].contiguous(), dy[:, i:].contiguous()   # two buffers, as two GEMMs' gradients were
    assert _triton_tma.halves_supported(x, w1t, w3t) and _triton_tma.pair_supported(dy, w1t, w3t)
    runs = {
        "fwd ours": lambda: _triton_tma.grouped_mm_halves(x, w1t, w3t, offs),
        "fwd two": lambda: (_triton_tma.grouped_mm(x, w1t, offs), _triton_tma.grouped_mm(x, w3t, offs)),
        "fwd one": lambda: _triton_tma.grouped_mm(x, w13t, offs),
        "dx ours": lambda: _triton_tma.grouped_mm_cat_dx(dy, w1t, w3t, offs),
        "dx two": lambda: _triton_tma.grouped_mm(dy1, w1, offs) + _triton_tma.grouped_mm(dy3, w3, offs),
        "dx one": lambda: _triton_tma.grouped_mm(dy, w13, offs),
    }
    assert torch.equal(runs["fwd ours"](), runs["fwd one"]()), "forward != one"
    err = rel_err(runs["dx ours"](), runs["dx one"]())
    assert err < DX_REL, ("dx", err)
    return runs


def main():
    from ab import cell, cuda_generator, header, interleave, parse_args, topk_offsets

    args = parse_args(SHAPES)
    header()
    g = cuda_generator(0)
    rows = []
    for name in args.shapes:
        t, top_k, e, h, i = SHAPES[name]
        m = t * top_k
        offs = topk_offsets(t, top_k, e, g)
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(m, 2 * i, device="cuda", dtype=torch.bfloat16, generator=g)
        w1, w3 = (torch.randn(e, i, h, device="cuda", dtype=torch.bfloat16, generator=g) * h**-0.5 for _ in range(2))
        runs = _runs(x, dy, w1, w3, offs)
        flop = 2.0 * m * h * 2 * i
        times = interleave(runs, args.rounds, warmup=25, rep=150)
        for step in ("fwd", "dx"):
            meds = {way: cell([flop / r / 1e9 for r in times[f"{step} {way}"]]) for way in ("ours", "two", "one")}
            rows.append((name, step, meds))
    print("\n| shape | product | ours TFLOP/s (rounds) | two | one | ours / two | ours / one |")
    print("|---|---|---|---|---|---|---|")
    for name, step, meds in rows:
        cells = [f"**{meds[w][0]:.0f}** ({meds[w][1]})" for w in ("ours", "two", "one")]
        ratio = [f"{meds['ours'][0] / meds[w][0]:.2f}x" for w in ("two", "one")]
        print(f"| {name} | {step} | " + " | ".join(cells + ratio) + " |")


if __name__ == "__main__":
    main()
