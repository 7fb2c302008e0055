"""Per-kernel micro-benchmark of the moe_compile CUDA path for one MoE layer shape (used by
``moe_layer.py --micro``). Each op is timed alone (triton.testing.do_bench, median, L2 flushed
between runs) and set against its floor: max(FLOP / measured dense-bf16 rate, bytes / measured copy
bandwidth), where bytes count each input once and each output once.

Ops of one layer step (N = T*k routed rows): route, permute, up GEMM [N,H]x[H,2I], SwiGLU (not ours),
down GEMM [N,I]x[I,H], combine; backward: combine bwd, two dgrad GEMMs, two wgrad GEMMs.
"""
from __future__ import annotations

import torch

_PEAK: dict[str, float] = {}


def peaks():
    """Measured ceilings on this device: dense bf16 matmul FLOP/s and device copy bytes/s."""
    import triton.testing as tt

    if not _PEAK:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        ms = tt.do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median")
        _PEAK["flops"] = 2 * 8192**3 / (ms * 1e-3)
        src = torch.randn(2**28, device="cuda", dtype=torch.float32)  # 1 GiB
        dst = torch.empty_like(src)
        ms = tt.do_bench(lambda: dst.copy_(src), warmup=20, rep=100, return_mode="median")
        _PEAK["bytes"] = 2 * src.numel() * 4 / (ms * 1e-3)
        del a, b, src, dst
    return _PEAK


def run(name: str, shape, steps: int = 10):
    import triton.testing as tt
    from ab import cuda_generator

    from moe_compile.kernels import cuda as kcuda
    from moe_compile.kernels import ops, reference
    fused = ops

    t, h, i, e, k = shape
    n = t * k
    pk = peaks()
    g = cuda_generator(0)
    ids = torch.rand(t, e, generator=g, device="cuda").topk(k, dim=-1).indices
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) * h**-0.5)
    w2 = (torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g) * i**-0.5)
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, H, 2I], [E, I, H] column-major views
    topw = torch.rand(t, k, device="cuda", generator=g).to(torch.bfloat16)
    perm, inv, offs = kcuda.route_permute(ids, e)
    xp = kcuda.permute_rows(x, perm, offs, k)
    hh = kcuda.grouped_mm(xp, w13t, offs)
    a = torch.randn(n, i, device="cuda", dtype=torch.bfloat16, generator=g)
    y = kcuda.grouped_mm(a, w2t, offs)
    dy_h = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g)
    dy_2i = torch.randn(n, 2 * i, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
    B = 2  # bytes per bf16 element

    from ab import with_attr

    def gmm(xx, ww):
        return kcuda.grouped_mm(xx, ww, offs)

    gmm_triton = with_attr(kcuda, "GMM_BACKEND", "triton", gmm)
    gmm_tma = with_attr(kcuda, "GMM_BACKEND", "tma", gmm)  # the TMA kernel whatever the group size

    cases = [  # (op, fn, flop, bytes)
        ("route_permute", lambda: kcuda.route_permute(ids, e), 0, n * 8 + 2 * n * 8 + e * 4),
        ("route_permute (torch reference)", lambda: reference.route_permute(ids, e), 0, n * 8 + 2 * n * 8 + e * 4),
        ("permute_rows", lambda: kcuda.permute_rows(x, perm, offs, k), 0, (t + n) * h * B),
        ("up   gmm [N,H]x[H,2I]", lambda: kcuda.grouped_mm(xp, w13t, offs), 2 * n * h * 2 * i,
         (n * h + e * h * 2 * i + n * 2 * i) * B),
        ("up   torch._grouped_mm alone", lambda: torch._grouped_mm(xp, w13t, offs=offs), 2 * n * h * 2 * i,
         (n * h + e * h * 2 * i + n * 2 * i) * B),
        ("up   triton gmm", lambda: gmm_triton(xp, w13t), 2 * n * h * 2 * i, (n * h + e * h * 2 * i + n * 2 * i) * B),
        ("down gmm [N,I]x[I,H]", lambda: kcuda.grouped_mm(a, w2t, offs), 2 * n * i * h, (n * i + e * h * i + n * h) * B),
        ("up   tma gmm", lambda: gmm_tma(xp, w13t), 2 * n * h * 2 * i, (n * h + e * h * 2 * i + n * 2 * i) * B),
        ("down triton gmm", lambda: gmm_triton(a, w2t), 2 * n * i * h, (n * i + e * h * i + n * h) * B),
        ("down torch._grouped_mm alone", lambda: torch._grouped_mm(a, w2t, offs=offs), 2 * n * i * h,
         (n * i + e * h * i + n * h) * B),
        ("down tma gmm", lambda: gmm_tma(a, w2t), 2 * n * i * h, (n * i + e * h * i + n * h) * B),
        ("combine", lambda: kcuda.unpermute_combine(y, inv, topw, offs), 0, (n + t) * h * B),
        ("combine bwd", lambda: kcuda.unpermute_combine_backward(dout, y, inv, topw, offs), 0, (t + 2 * n) * h * B),
        ("down dgrad [N,H]x[H,I]", lambda: kcuda.grouped_mm(dy_h, w2t.transpose(1, 2), offs), 2 * n * i * h,
         (n * i + e * h * i + n * h) * B),
        ("down dgrad torch._grouped_mm alone", lambda: torch._grouped_mm(dy_h, w2t.transpose(1, 2), offs=offs),
         2 * n * i * h, (n * i + e * h * i + n * h) * B),
        ("up   dgrad [N,2I]x[2I,H]", lambda: kcuda.grouped_mm(dy_2i, w13t.transpose(1, 2), offs), 2 * n * h * 2 * i,
         (n * h + e * h * 2 * i + n * 2 * i) * B),
        ("up   dgrad torch._grouped_mm alone", lambda: torch._grouped_mm(dy_2i, w13t.transpose(1, 2), offs=offs),
         2 * n * h * 2 * i, (n * h + e * h * 2 * i + n * 2 * i) * B),
        ("down wgrad fp32 out (contract)", lambda: kcuda.grouped_mm_wgrad(a, dy_h, offs, e), 2 * n * i * h,
         (n * i + n * h) * B + e * h * i * 4),
        ("down wgrad fp32 + .to(bf16)", lambda: kcuda.grouped_mm_wgrad(a, dy_h, offs, e).to(torch.bfloat16),
         2 * n * i * h, (n * i + n * h + e * h * i) * B),
        ("down wgrad lowp (fused.py)", lambda: fused.grouped_mm_wgrad_lowp(a, dy_h, offs, e), 2 * n * i * h,
         (n * i + n * h + e * h * i) * B),
        ("up   wgrad fp32 + .to(bf16)", lambda: kcuda.grouped_mm_wgrad(xp, dy_2i, offs, e).to(torch.bfloat16),
         2 * n * h * 2 * i, (n * h + n * 2 * i + e * h * 2 * i) * B),
        ("up   wgrad lowp (fused.py)", lambda: fused.grouped_mm_wgrad_lowp(xp, dy_2i, offs, e), 2 * n * h * 2 * i,
         (n * h + n * 2 * i + e * h * 2 * i) * B),
    ]
    from moe_compile.kernels import _triton_gmm

    def swept(cfg):
        def fn():
            _triton_gmm.CONFIG_OVERRIDE = cfg
            try:
                return gmm_triton(xp, w13t)
            finally:
                _triton_gmm.CONFIG_OVERRIDE = None
        return fn

    for cfg in (dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3),
                dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=4),
                dict(BM=64, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=4)):
        cases.append((f"up   triton gmm {cfg['BM']}x{cfg['BN']}x{cfg['BK']} w{cfg['num_warps']} s{cfg['num_stages']}",
                      swept(cfg), 2 * n * h * 2 * i, (n * h + e * h * 2 * i + n * 2 * i) * B))
    sep = [torch.randn(2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g).t() for _ in range(e)]
    cases.append(("up   grouped_mm_list, separate weights (address table)",
                  lambda: kcuda.grouped_mm_list(xp, sep, offs, []), 2 * n * h * 2 * i,
                  (n * h + e * h * 2 * i + n * 2 * i) * B))
    cases.append(("up   torch.stack(separate) + gmm", lambda: kcuda.grouped_mm(xp, torch.stack(sep), offs),
                  2 * n * h * 2 * i, (n * h + e * h * 2 * i + n * 2 * i) * B))
    del ops, hh
    rows = []
    for op, fn, fl, by in cases:
        try:
            ms = tt.do_bench(fn, warmup=25, rep=max(50, steps * 5), return_mode="median")
        except Exception as exc:  # report, keep going
            rows.append(dict(shape=name, op=op, error=f"{type(exc).__name__}: {str(exc)[:80]}"))
            continue
        floor = max(fl / pk["flops"], by / pk["bytes"]) * 1e3
        rows.append(dict(shape=name, op=op, ms=ms, tflops=fl / (ms * 1e-3) / 1e12, gbps=by / (ms * 1e-3) / 1e9,
                         floor_ms=floor, of_floor=floor / ms, peak_tflops=pk["flops"] / 1e12,
                         peak_gbps=pk["bytes"] / 1e9))
    return rows


def print_table(rows):
    if rows and "peak_tflops" in rows[0]:
        print(f"\n## ceilings measured here: dense bf16 {rows[0]['peak_tflops']:.0f} TFLOP/s, "
              f"copy {rows[0]['peak_gbps']:.0f} GB/s")
    print("| shape | op | ms | TFLOP/s | GB/s | floor ms | floor/ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['op']} | error: {r['error']} |")
        else:
            print(f"| {r['shape']} | {r['op']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['gbps']:.0f} "
                  f"| {r['floor_ms']:.3f} | {r['of_floor']:.2f} |")
