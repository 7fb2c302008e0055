"""A/B of the MoE glue kernels' launch choices: what backend="moe" runs now against what it ran
before, on the benchmark layers' shapes (bf16, H200-class GPU).

    python examples/benchmark/glue_ab.py            # 3 interleaved rounds

- gather (``permute_rows``): 16 rows x 256 columns per program now, 4 x 1024 before;
- combine (``unpermute_combine``): 1 token x 1024 columns now, 4 x 512 before;
- zeroing of empty experts after CUTLASS weight gradients (``zero_empty_groups``): one persistent
  launch sharing all empty experts' blocks now; before, 8 programs per expert (the kernel below).
Every "now" output is checked equal (``torch.equal``) to the "before" one first. Prints us per
call (median of rounds, each ``triton.testing.do_bench`` median, L2 flushed) and TB/s of the bytes
each moves, next to a plain copy's.
"""
from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl

from moe_compile.kernels import _triton_moe as M
from moe_compile.kernels.cuda import route_permute

# name: (tokens T, hidden H, experts E, top-k)
LAYERS = {"qwen3": (8192, 2048, 128, 8), "gptoss": (8192, 2880, 32, 4), "dsv3": (4096, 2048, 64, 6)}
# weight-gradient shapes [E, K, N] and how many experts are empty
ZEROING = {"qwen3_up": ((128, 2048, 1536), (1, 4, 32)), "qwen3_down": ((128, 768, 2048), (1, 4, 32)),
           "mixtral_up": ((8, 4096, 28672), (1, 4))}


@triton.jit
def _zero_before(dw_ptr, offs_ptr, KN, s_e, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """The zeroing kernel before: one program per (expert, slice of 8)."""
    e = tl.program_id(0)
    end = tl.load(offs_ptr + e)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    if end <= start:
        zero = tl.zeros((BLOCK,), dtype=dw_ptr.dtype.element_ty)
        for i0 in range(tl.program_id(1) * BLOCK, KN, SPLIT * BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            tl.store(dw_ptr + e.to(tl.int64) * s_e + i, zero, mask=i < KN)


def main():
    from ab import cuda_generator, interleave, parse_args, versions

    args = parse_args({**LAYERS, **ZEROING})
    print("# " + " ".join(f"{k}={v}" for k, v in versions("cuda").items()), flush=True)
    g = cuda_generator(0)
    rows = []  # (what, shape, before us, now us, MB moved)

    def ab(what, shape, before, now, mb):
        before(), now()
        times = interleave({"before": before, "now": now}, args.rounds, warmup=20, rep=100)
        rows.append((what, shape, *(statistics.median(times[k]) * 1e3 for k in ("before", "now")), mb))

    for name in (s for s in args.shapes if s in LAYERS):
        t, h, e, k = LAYERS[name]
        ids = torch.randn(t, e, device="cuda", generator=g).topk(k, dim=-1).indices
        w = torch.rand(t, k, device="cuda", generator=g).to(torch.bfloat16)
        perm, inv, offs = route_permute(ids, e)
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        y = torch.randn(t * k, h, device="cuda", dtype=torch.bfloat16, generator=g)
        xp = torch.empty(t * k, h, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)

        def gather_before():
            M._permute_rows_kernel[(triton.cdiv(t * k, 4), triton.cdiv(h, 1024))](
                x, perm, offs, xp, t * k, h, e, x.stride(0), TOP_K=k, BR=4, BH=1024, num_warps=4)
            return xp

        def combine_before():
            M._combine_kernel[(triton.cdiv(t, 4), triton.cdiv(h, 512))](
                y, inv, w, offs, out, t, h, e, y.stride(0), TOP_K=k, HAS_W=True, BT=4, BH=512, num_warps=4)
            return out

        assert torch.equal(gather_before(), M.permute_rows(x, perm, offs, k)), name
        assert torch.equal(combine_before(), M.unpermute_combine(y, inv, w, offs)), name
        ab("gather", name, gather_before, lambda: M.permute_rows(x, perm, offs, k), (x.numel() + xp.numel()) * 2e-6)
        ab("combine", name, combine_before, lambda: M.unpermute_combine(y, inv, w, offs),
           (y.numel() + out.numel()) * 2e-6)

    for name in (s for s in args.shapes if s in ZEROING):
        (e, kk, n), empties = ZEROING[name]
        dw = torch.randn(e, kk, n, device="cuda", dtype=torch.bfloat16, generator=g)
        for n_empty in empties:
            counts = torch.full((e,), 64, dtype=torch.int32, device="cuda")
            counts[torch.randperm(e, device="cuda", generator=g)[:n_empty]] = 0
            offs = torch.cumsum(counts, 0).to(torch.int32)
            a, b = dw.clone(), dw.clone()
            _zero_before[(e, 8)](a, offs, kk * n, a.stride(0), SPLIT=8, BLOCK=2048, num_warps=4)
            assert torch.equal(a, M.zero_empty_groups(b, offs)), (name, n_empty)
            ab("zero empty", f"{name} [{e}, {kk}, {n}], {n_empty} empty",
               lambda: _zero_before[(e, 8)](a, offs, kk * n, a.stride(0), SPLIT=8, BLOCK=2048, num_warps=4),
               lambda: M.zero_empty_groups(a, offs), n_empty * kk * n * 2e-6)

    src = torch.empty(2**30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = statistics.median(interleave({"copy": lambda: dst.copy_(src)}, args.rounds, 5, 50)["copy"])
    print(f"\ncopy: {4 * src.numel() / copy_ms / 1e9:.2f} TB/s")
    print("| kernel | shape | before us | now us | now / before | now TB/s |")
    print("|---|---|---|---|---|---|")
    for what, shape, before, now, mb in rows:
        print(f"| {what} | {shape} | {before:.1f} | {now:.1f} | {now / before:.2f}x | {mb / now:.2f} |")


if __name__ == "__main__":
    main()
