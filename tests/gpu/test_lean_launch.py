"""kernels/_launch.py on the real Triton: every @lean kernel of one MoE layer's forward and backward
runs its cached compiled kernel on the second call (lean did not quietly fall back), and gives
bit-for-bit what Triton's own launch gives (LEAN_LAUNCH=False), inside a CUDA-graph capture too."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from moe_compile.kernels import _launch, _triton_act, _triton_moe, _triton_tma  # noqa: E402
from moe_compile.kernels import cuda as kcuda  # noqa: E402

pytestmark = pytest.mark.gpu

T, H, I, E, K = 300, 256, 128, 8, 2


def _layer(gen):
    """The layer's kernel calls, in order; returns every output (flattened to a list)."""
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    scores = torch.randn(T, E, device="cuda", generator=gen)
    w13 = torch.randn(E, H, 2 * I, device="cuda", dtype=torch.bfloat16, generator=gen) / H ** 0.5
    dout = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)

    def run():
        vals, ids = kcuda.router_topk(scores, K)
        perm, inv, offs = kcuda.route_permute(ids, E)
        xp = kcuda.permute_rows(x, perm, offs, K)
        h = kcuda.grouped_mm(xp, w13, offs)
        a = kcuda.swiglu(h)
        y = torch.cat([a, a], dim=1)
        w = vals.to(torch.bfloat16)
        out = kcuda.unpermute_combine(y, inv, w, offs)
        dy, dw = kcuda.unpermute_combine_backward(dout, y, inv, w, offs)
        dh = kcuda.swiglu_backward(h, dy[:, :I].contiguous())
        aw = kcuda.weighted_swiglu(h, w, perm, offs)
        dhw, dww = kcuda.weighted_swiglu_backward(h, w, perm, offs, dy[:, :I].contiguous())
        summed = kcuda.unpermute_sum(y, perm, inv, offs, K)
        return [vals, ids, perm, inv, offs, xp, h, a, out, dy, dw, dh, aw, dhw, dww, summed]
    return run


def _lean_kernels():
    mods = (_triton_act, _triton_moe, _triton_tma)
    return {name: k for m in mods for name, k in vars(m).items() if isinstance(k, _launch.LeanKernel)}


def test_every_layer_kernel_launches_lean_and_matches_tritons_launch(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(0)
    run = _layer(gen)
    monkeypatch.setattr(kcuda, "LEAN_LAUNCH", False)
    ref = run()
    monkeypatch.setattr(kcuda, "LEAN_LAUNCH", True)
    run()                      # first lean call per key: kernel[grid](...) compiles and caches
    got = run()                # second: the cached kernel, launched directly
    torch.cuda.synchronize()
    for i, (g, r) in enumerate(zip(got, ref)):
        assert torch.equal(g, r), f"output {i} differs from Triton's own launch"
    used = ("_router_topk_kernel", "_route_permute_count_kernel", "_route_permute_place_kernel",
            "_permute_rows_kernel", "_swiglu_kernel", "_combine_kernel", "_combine_bwd_kernel", "_swiglu_bwd_kernel",
            "_weighted_swiglu_bwd_kernel")
    if torch.cuda.get_device_capability()[0] == 9:
        used += ("_tma_gmm_kernel",)
    kernels = _lean_kernels()
    for name in used:
        k = kernels[name]
        assert not k.broken and k.kernels, f"{name}: lean launch fell back to kernel[grid](...)"


def test_lean_launch_inside_a_cuda_graph_replays_exactly():
    gen = torch.Generator(device="cuda").manual_seed(1)
    run = _layer(gen)
    ref = run()
    run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    for i, (g, r) in enumerate(zip(out, ref)):
        assert torch.equal(g, r), f"output {i} differs after a CUDA-graph replay"
