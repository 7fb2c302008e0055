"""quack-kernels' CuTe DSL varlen grouped GEMMs against the kernels backend="moe" ran before them,
on the six grouped GEMMs of one MoE layer's training step (issue 14 item 3; kernels/_quack.py).

    python examples/benchmark/quack_ab.py                      # needs the quack extra installed
    python examples/benchmark/quack_ab.py --shapes qwen3 --rounds 3 --configs pp128x192
    python examples/benchmark/quack_ab.py --shapes qwen3 --products up_wgrad down_wgrad --spread 1.5 \
        --configs pp128x192 pp128x192dyn      # uneven routing: static vs dynamic tile scheduler
    python examples/benchmark/quack_ab.py --gated --spread 1.0 --configs pp128x192 pp128x128 pp128x192dyn

Per layer shape: the forward products (up: K=H, N=2I; down: K=I, N=H, weights in nn.Linear's
[E, N, K] layout), the data-gradient products (the same weights read as [E, K, N]) and the weight
gradients (dw[e] = dy[rows e]^T x[rows e], [E, N, K]: the parameter's own layout).
Kernels: "ours" = what kernels/cuda.py ran before quack (TMA Triton for forward/dgrad on sm90; for
the weight gradient torch._grouped_mm + one pass zeroing empty experts, bf16 out:
grouped_mm_wgrad_lowp with WGRAD_BACKEND=cutlass); "cutlass" = torch._grouped_mm alone;
"quack[cfg]" = quack's GEMM with cu_seqlens_m (forward, dgrad) or cu_seqlens_k (weight gradient)
and a fixed GemmConfig (no autotuning: each config compiles once, seconds). Each result is checked
against torch._grouped_mm first; timings interleave the kernels per round (ab.interleave). Prints
TFLOP/s, then a per-layer table with the sum over the six GEMMs.

``--gated``: SwiGLU in quack's epilogues instead (its ``gemm_gated`` / ``gemm_dgated``, ping-pong
warp groups, so a tile's epilogue overlaps the other group's main loop), against what runs: the up
GEMM + ``swiglu`` -> one ``gemm_gated`` (the weight read as [gate; up] through ``concat_layout``,
h stored gate/up-interleaved); the down dgrad + ``swiglu_backward`` -> one ``gemm_dgated`` (reads
the interleaved h, writes the interleaved dh and recomputes a = swiglu(h)); and the two products
that then read the interleaved dh: the up dgrad (weight through ``concat_layout``) and the up
weight gradient (its output through ``concat_layout``). Values are checked against what runs; the
table gives both sums of the four per layer, and a control not in the sum: quack's up dgrad on dh as
it is now ([gate; up]), which tells the kernel's effect from the interleaved layout's.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

# name: (tokens T, top-k, experts E, hidden H, expert intermediate I)
LAYERS = {
    "qwen3": (8192, 8, 128, 2048, 768),
    "gptoss": (8192, 4, 32, 2880, 2880),
    "mixtral": (4096, 2, 8, 4096, 14336),
    "dsv3": (8192, 6, 64, 2048, 1408),   # model_step.py's DeepSeek-V3-like (Moonlight widths)
}
# quack GemmConfig fields (tile_m, tile_n, pingpong, cluster_m, cluster_n, is_dynamic_persistent)
CONFIGS = {
    "pp128x192": (128, 192, True, 2, 1, False),
    "pp128x192dyn": (128, 192, True, 2, 1, True),   # what kernels/_quack.py runs where static is unbalanced
    "pp128x128": (128, 128, True, 1, 2, False),
    "co256x128": (256, 128, False, 2, 1, False),
    "co256x192": (256, 192, False, 2, 1, False),
}


MAX_REL_ERR = 1e-2   # against the reference: bf16 outputs of fp32 accumulations in another order


def gemm_config(cname: str):
    """quack's GemmConfig for a CONFIGS entry (sm90)."""
    from quack.gemm_config import GemmConfig

    tm, tn, pp, cm, cn, dyn = CONFIGS[cname]
    return GemmConfig(tile_m=tm, tile_n=tn, pingpong=pp, cluster_m=cm, cluster_n=cn, is_dynamic_persistent=dyn,
                      device_capacity=9)


def _rnd(g, *shape):
    """bf16 normal values scaled by 1/sqrt(last dim) on the GPU."""
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * shape[-1] ** -0.5


def products(t, k, e, h, i, g, spread=0.0):
    """{name: (kind, a, b, offsets, flop)} for one layer; kind "m" = varlen rows, "k" = wgrad."""
    from ab import topk_offsets

    m = t * k
    offs = topk_offsets(t, k, e, g, spread)
    x, a, dy, dh = _rnd(g, m, h), _rnd(g, m, i), _rnd(g, m, h), _rnd(g, m, 2 * i)
    w_up, w_down = _rnd(g, e, 2 * i, h), _rnd(g, e, h, i)  # nn.Linear layout [E, N, K]
    return {
        "up": ("m", x, w_up.transpose(1, 2), offs, 2.0 * m * h * 2 * i),
        "down": ("m", a, w_down.transpose(1, 2), offs, 2.0 * m * i * h),
        "up_dgrad": ("m", dh, w_up, offs, 2.0 * m * 2 * i * h),
        "down_dgrad": ("m", dy, w_down, offs, 2.0 * m * h * i),
        # as grouped_mm_weight_grad computes them for nn.Linear-layout weights: dy^T x, [E, N, K]
        "up_wgrad": ("k", dh, x, offs, 2.0 * m * h * 2 * i),
        "down_wgrad": ("k", dy, a, offs, 2.0 * m * i * h),
    }


def gated_ab(layer, cfgs, rounds, spread, g) -> None:
    """--gated (module docstring): one layer's four products both ways, µs, and their sums."""
    from ab import interleave, rel_err, topk_offsets
    from quack.gemm_interface import gemm_dgated_tuned, gemm_gated_tuned, gemm_tuned

    from moe_compile.kernels import _quack, _triton_gmm, _triton_tma, cuda

    t, k, e, h, i = LAYERS[layer]
    m = t * k
    offs = topk_offsets(t, k, e, g, spread)
    cu = _quack.cu_seqlens(offs)
    x, dy = _rnd(g, m, h), _rnd(g, m, h)
    w_up, w_down = _rnd(g, e, 2 * i, h), _rnd(g, e, h, i)  # nn.Linear layout [E, N, K]
    hh = _triton_tma.grouped_mm(x, w_up.transpose(1, 2), offs)
    dh = cuda.swiglu_backward(hh, _triton_tma.grouped_mm(dy, w_down, offs))
    # what runs: kernels/cuda.py's choices (the weight gradient: quack, static or dynamic scheduler by its rule)
    fns = {"now up+swiglu": lambda: cuda.swiglu(_triton_tma.grouped_mm(x, w_up.transpose(1, 2), offs)),
           "now down dgrad+dswiglu": lambda: cuda.swiglu_backward(hh, _triton_tma.grouped_mm(dy, w_down, offs)),
           "now up dgrad": lambda: _triton_tma.grouped_mm(dh, w_up, offs),
           "now up wgrad": lambda: cuda.grouped_mm_wgrad_lowp(dh, x, offs, e)}
    refs = {"a": cuda.swiglu(hh), "dh": dh, "dx": fns["now up dgrad"](), "dw": fns["now up wgrad"]()}
    # the same scheduler rule for quack's weight gradient from the interleaved dh
    wgrad_cfg = _quack._STATE["config"][not _quack.static_is_balanced(2 * i, h, _triton_gmm.num_sms(x.device))]

    def gated(cfg):   # the four products through quack's gated epilogues, with their own outputs
        h_il, a = torch.empty(m, 2 * i, device="cuda", dtype=x.dtype), torch.empty(m, i, device="cuda", dtype=x.dtype)
        dh_il, a2, dx, dw = torch.empty_like(h_il), torch.empty_like(a), torch.empty_like(x), torch.empty_like(w_up)
        dx_c = torch.empty_like(x)
        fns = {
            "up+swiglu": lambda: gemm_gated_tuned.fn(x, w_up.transpose(1, 2), h_il, a, activation="swiglu",
                                                     cu_seqlens_m=cu, config=cfg, concat_layout=("B",)),
            # also writes a = swiglu(h) again (what the down weight gradient reads), which "now" does not
            "down dgrad+dswiglu": lambda: gemm_dgated_tuned.fn(dy, w_down, h_il, dh_il, a2, activation="swiglu",
                                                               cu_seqlens_m=cu, config=cfg,
                                                               dynamic_scheduler=cfg.is_dynamic_persistent),
            "up dgrad": lambda: gemm_tuned.fn(dh_il, w_up, dx, cu_seqlens_m=cu, config=cfg, concat_layout=("B",)),
            "up wgrad": lambda: gemm_tuned.fn(dh_il.t(), x, dw, cu_seqlens_k=cu, config=wgrad_cfg,
                                              concat_layout=("out",)),
            # control, not summed: the same quack up dgrad on dh as it is now ([gate; up]): kernel vs layout
            "(control) up dgrad, dh [gate; up]": lambda: gemm_tuned.fn(dh, w_up, dx_c, cu_seqlens_m=cu, config=cfg)}
        for fn in fns.values():
            fn()
        dh_concat = torch.cat([dh_il[:, 0::2], dh_il[:, 1::2]], 1)
        return fns, (("a", a, refs["a"]), ("dh", dh_concat, refs["dh"]), ("recomputed a", a2, refs["a"]),
                     ("dx", dx, refs["dx"]), ("dw", dw, refs["dw"]), ("dx (control)", dx_c, refs["dx"]))

    for cname in cfgs:
        mine, checks = gated(gemm_config(cname))
        bad = [(what, err) for what, got, ref in checks if (err := rel_err(got, ref)) > MAX_REL_ERR]
        if bad:   # every routed row is checked (topk_offsets routes all T k rows)
            print(f"# {layer} quack[{cname}]: relative error against what runs {bad}, not timed", flush=True)
            continue
        fns.update({f"quack[{cname}] {n}": fn for n, fn in mine.items()})
    times = {n: statistics.median(v) * 1e3 for n, v in interleave(fns, rounds, warmup=20, rep=60).items()}
    now = sum(v for n, v in times.items() if n.startswith("now"))
    print(f"\n| {layer} | " + " | ".join(f"{n} µs" for n in times) + " |")
    print("|---|" + "---|" * len(times))
    print(f"| {layer} | " + " | ".join(f"{v:.0f}" for v in times.values()) + " |")
    print(f"(quack's up wgrad runs its 128 x 192 config, {'dynamic' if wgrad_cfg.is_dynamic_persistent else 'static'}"
          " scheduler, in every column: kernels/_quack.py's)")
    for cname in cfgs:
        mine = {n: v for n, v in times.items() if n.startswith(f"quack[{cname}]") and "(control)" not in n}
        if mine:
            print(f"{layer}: the four products {now:.0f} µs as they run, {sum(mine.values()):.0f} µs with "
                  f"quack[{cname}]'s gated epilogues ({sum(mine.values()) / now:.3f}x)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spread", type=float, default=0.0,
                    help="std of a per-expert logit bias: uneven routing (ab.topk_offsets)")
    ap.add_argument("--products", nargs="+", default=None,
                    choices=["up", "down", "up_dgrad", "down_dgrad", "up_wgrad", "down_wgrad"])
    ap.add_argument("--gated", action="store_true", help="SwiGLU in quack's epilogues (module docstring)")
    args = ap.parse_args()
    import quack
    import triton
    from ab import cuda_generator, interleave, rel_err, with_attr
    from quack.gemm_interface import gemm_tuned

    from moe_compile.kernels import _quack, _triton_tma, cuda

    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
          f"quack {quack.__version__}", flush=True)
    g = cuda_generator(0)
    if args.gated:
        for layer in args.shapes:
            gated_ab(layer, args.configs, args.rounds, args.spread, g)
        return
    table, compile_s, flops = {}, {}, {}
    for layer in args.shapes:
        for pname, (kind, a, b, offs, flop) in products(*LAYERS[layer], g, args.spread).items():
            if args.products and pname not in args.products:
                continue
            flops.setdefault(layer, {})[pname] = flop
            cu = _quack.cu_seqlens(offs)
            e = offs.numel()
            if kind == "m":
                ref = torch._grouped_mm(a, b, offs=offs)
                fns = {"ours": lambda a=a, b=b, o=offs: _triton_tma.grouped_mm(a, b, o),
                       "cutlass": lambda a=a, b=b, o=offs: torch._grouped_mm(a, b, offs=o)}
                out = torch.empty(a.shape[0], b.shape[-1], device="cuda", dtype=a.dtype)
                qkw = dict(cu_seqlens_m=cu)
                qa, qb = a, b
            else:
                ref = torch._grouped_mm(a.t(), b, offs=offs)
                fns = {"ours": with_attr(cuda, "WGRAD_BACKEND", "cutlass",
                                         lambda a=a, b=b, o=offs, e=e: cuda.grouped_mm_wgrad_lowp(a, b, o, e)),
                       "cutlass": lambda a=a, b=b, o=offs: torch._grouped_mm(a.t(), b, offs=o)}
                out = torch.empty(e, a.shape[1], b.shape[1], device="cuda", dtype=a.dtype)
                qkw = dict(cu_seqlens_k=cu)
                qa, qb = a.t(), b
            for cname in args.configs:
                cfg = gemm_config(cname)

                def q(qa=qa, qb=qb, out=out, cfg=cfg, qkw=qkw):
                    gemm_tuned.fn(qa, qb, out, config=cfg, **qkw)
                    return out
                t0 = time.perf_counter()
                try:
                    q()
                    torch.cuda.synchronize()
                except Exception as exc:  # a config quack cannot build for this shape: say so, go on
                    print(f"# {layer} {pname} quack[{cname}]: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                compile_s[(layer, pname, cname)] = time.perf_counter() - t0
                fns[f"quack[{cname}]"] = q
            for kname, fn in fns.items():  # same values before timing
                err = rel_err(fn(), ref)
                if err > MAX_REL_ERR:
                    print(f"# {layer} {pname} {kname}: relative error {err:.3g}, dropped", flush=True)
                    fns[kname] = None
            fns = {k: v for k, v in fns.items() if v is not None}
            times = interleave(fns, args.rounds, warmup=25, rep=100)
            for kname, ms in times.items():
                table[(layer, pname, kname)] = statistics.median(ms)
                print(f"{layer} {pname} {kname}: {flop / statistics.median(ms) / 1e9:.0f} TFLOP/s "
                      f"({', '.join(f'{flop / x / 1e9:.0f}' for x in ms)})", flush=True)
    kernels = sorted({k for (_, _, k) in table}, key=lambda k: (k != "ours", k != "cutlass", k))
    print("\n| layer | GEMM | " + " | ".join(f"{k} TFLOP/s" for k in kernels) + " | best quack / ours |")
    print("|---|---|" + "---|" * (len(kernels) + 1))
    for layer in args.shapes:
        sums = {k: 0.0 for k in kernels}
        best_sum = 0.0
        for pname, flop in flops[layer].items():
            row = {k: table.get((layer, pname, k)) for k in kernels}
            qs = [v for k, v in row.items() if k.startswith("quack") and v is not None]
            best_sum += min(qs) if qs else float("nan")
            for k, v in row.items():
                sums[k] += v if v is not None else float("nan")
            cells = [f"{flop / v / 1e9:.0f}" if v else "-" for v in row.values()]
            ratio = f"{row['ours'] / min(qs):.2f}x" if qs else "-"
            print(f"| {layer} | {pname} | " + " | ".join(cells) + f" | {ratio} |")
        print(f"| {layer} | all six, ms | " + " | ".join(f"{v:.3f}" for v in sums.values())
              + f" | {sums['ours'] / best_sum:.2f}x (best per GEMM {best_sum:.3f} ms) |")
    if compile_s:
        print(f"\nquack compile per config and shape: median {statistics.median(compile_s.values()):.1f} s, "
              f"max {max(compile_s.values()):.1f} s")


if __name__ == "__main__":
    main()
