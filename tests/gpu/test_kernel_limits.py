"""CUDA kernels at their limits (a review of the kernels' limits; the CPU side: tests/test_op_limits.py):
address tables read in place outlive the kernels queued to read them, index tensors may be strided,
pointer kernels address past 2^31 elements, wide weight gradients launch, broadcast rows do not reach
CUTLASS. Each test failed on the code before it (one H200, torch 2.11, triton 3.6)."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from moe_compile.kernels import cuda as kcuda  # noqa: E402  (registers the CUDA impls)
from moe_compile.kernels import ops, reference, weight_tables  # noqa: E402,F401

pytestmark = pytest.mark.gpu
OPS = torch.ops.moe_compile
DEV = "cuda"
# bf16 / fp16 outputs of fp32-accumulated products against an fp32 reference: one 16-bit rounding
# (2^-8 relative) of each output element, on the largest element's scale, 4x margin
LOWP_MAX_REL = 1.6e-2


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEV)


def _max_rel(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def test_address_tables_outlive_the_kernels_queued_to_read_them(monkeypatch):
    """Past 256 cached plans the cache was cleared and the pinned tables freed while their kernels
    were still queued; the next tables took the same blocks: 43 of 300 lists were computed with other
    experts' weights. 300 lists of 8 experts placed apart, queued behind a 2 s GPU sleep."""
    e, k, n, m, lists = 8, 64, 64, 256, 300
    pool = torch.randn(3 * lists * e, k, n, device=DEV, dtype=torch.bfloat16) * 0.1
    gen = torch.Generator().manual_seed(0)
    idx = (torch.randperm(lists * e, generator=gen) + lists * e).view(lists, e)
    weight_lists = [[pool[i] for i in row.tolist()] for row in idx]
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    offsets = _offsets([m // e] * e)
    OPS.grouped_mm_list(x, weight_lists[0], offsets, [])  # compiles the kernel outside the window
    torch.cuda.synchronize()
    # pinned blocks of the tables' size in the host allocator's free list, as in a process that has
    # run a while (no allocation in the window waits for the device)
    warm = [torch.empty(e, dtype=torch.int64).pin_memory() for _ in range(256)]
    del warm
    monkeypatch.setattr(weight_tables, "_PLANS", {})
    torch.cuda._sleep(int(4e9))
    outs = [OPS.grouped_mm_list(x, ws, offsets, []) for ws in weight_lists]
    assert any(p[0] == "table" for p in weight_tables._PLANS.values()), "the lists must take the table path"
    torch.cuda.synchronize()
    wrong = [i for i, (ws, out) in enumerate(zip(weight_lists, outs))
             if _max_rel(out, reference.grouped_mm(x.float(), torch.stack(ws).float(), offsets)) > LOWP_MAX_REL]
    assert not wrong, f"{len(wrong)} of {lists} lists wrong, first {wrong[:5]}"


def test_index_tensors_may_be_strided():
    """perm, inv and offsets were read as flat arrays: a strided view (same values) read other entries."""
    t, k, e, h = 256, 4, 8, 64
    ids = torch.randint(0, e, (t, k), device=DEV)
    perm, inv, offsets = OPS.route_permute(ids, e)

    def strided(v):
        return torch.stack([v, torch.zeros_like(v)], 1)[:, 0]

    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(t * k, h, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(t, k, device=DEV)
    dout = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(OPS.permute_rows(x, strided(perm), inv, strided(offsets), k),
                       OPS.permute_rows(x, perm, inv, offsets, k))
    assert torch.equal(OPS.unpermute_combine(y, strided(inv), w, strided(offsets)),
                       OPS.unpermute_combine(y, inv, w, offsets))
    assert torch.equal(OPS.unpermute_sum(y, perm, strided(inv), strided(offsets), k),
                       OPS.unpermute_sum(y, perm, inv, offsets, k))
    for got, ref in zip(OPS.unpermute_combine_backward(dout, y, strided(inv), w, strided(offsets)),
                        OPS.unpermute_combine_backward(dout, y, inv, w, offsets)):
        assert torch.equal(got, ref)
    xs = torch.randn(t * k, h, device=DEV, dtype=torch.bfloat16)
    ws = torch.randn(e, h, 128, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(OPS.grouped_mm(xs, ws, strided(offsets)), OPS.grouped_mm(xs, ws, offsets))
    assert torch.equal(OPS.grouped_mm_wgrad(xs, y, strided(offsets), e), OPS.grouped_mm_wgrad(xs, y, offsets, e))


def test_weight_gradient_of_a_column_major_x_past_2_31_elements():
    """ks * stride in int32: x [M, K] column-major (stride M) with K * M > 2^31 (fp16: the pointer kernel)
    read out of bounds (illegal address)."""
    e, k, n, m = 4, 7168, 256, 320 * 1024
    x = torch.randn(k, m, device=DEV, dtype=torch.float16).t()
    dy = torch.randn(m, n, device=DEV, dtype=torch.float16) * 0.01
    offsets = _offsets([m // e] * e)
    dw = OPS.grouped_mm_wgrad(x, dy, offsets, e)
    for i in (0, e - 1):
        rows = slice(i * m // e, (i + 1) * m // e)
        assert _max_rel(dw[i], x[rows].float().t() @ dy[rows].float()) < LOWP_MAX_REL


def test_grouped_mm_of_an_n_strided_weight_past_2_31_elements(monkeypatch):
    """cols * stride in int32: w [E, K, N] whose N stride is E * K with N * E * K > 2^31, on the
    pointer kernel, read out of bounds (illegal address)."""
    e, k, n, per = 128, 7168, 4096, 32
    w = (torch.randn(n, e, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5).permute(1, 2, 0)
    x = torch.randn(per * e, k, device=DEV, dtype=torch.bfloat16)
    offsets = _offsets([per] * e)
    for backend in ("triton", "auto"):
        monkeypatch.setattr(kcuda, "GMM_BACKEND", backend)
        y = OPS.grouped_mm(x, w, offsets)
        for i in (0, e - 1):
            rows = slice(i * per, (i + 1) * per)
            assert _max_rel(y[rows], x[rows].float() @ w[i].float()) < LOWP_MAX_REL, backend


def test_weight_gradient_wider_than_the_second_grid_dimension(monkeypatch):
    """The fp32 weight gradient after CUTLASS launched (E, K*N / 4096) programs: past 65535 in the
    second dimension (K * N > 268M, a Grok-1-like fused up projection) the launch failed."""
    monkeypatch.setattr(kcuda, "WGRAD_BACKEND", "cutlass")
    e, k, n, m = 2, 6144, 65536, 256
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=DEV, dtype=torch.bfloat16) * 0.05
    dw = OPS.grouped_mm_wgrad(x, dy, _offsets([m // 2, m // 2]), e)
    for i in range(e):
        rows = slice(i * m // 2, (i + 1) * m // 2)
        assert _max_rel(dw[i], x[rows].float().t() @ dy[rows].float()) < LOWP_MAX_REL


def test_broadcast_rows_do_not_reach_cutlass(monkeypatch):
    """x with row stride 0 (an expanded row) passed the layout check and CUTLASS refused it
    ("Invalid strides/sizes")."""
    monkeypatch.setattr(kcuda, "GMM_BACKEND", "cutlass")
    x = torch.randn(1, 512, device=DEV, dtype=torch.bfloat16).expand(1024, 512)
    w = torch.randn(8, 512, 512, device=DEV, dtype=torch.bfloat16) * 512 ** -0.5
    offsets = _offsets([128] * 8)
    y = OPS.grouped_mm(x, w, offsets)
    assert _max_rel(y, reference.grouped_mm(x.float(), w.float(), offsets)) < LOWP_MAX_REL


def test_address_tables_read_by_cuda_graphs_are_kept():
    """ModuleList experts read in place through their address tables (not re-homed, not stacked, placed
    apart) under Inductor's CUDA graphs: the tables a captured graph reads are kept for good, and
    replays on fresh inputs match eager in the output and every gradient."""
    import copy

    from helpers import BF16_GRAD_REL, BF16_REL, assert_close_rel, make_input, make_model

    from moe_compile import records

    model = make_model(torch.bfloat16, h=64, i=48, e=8, k=2, spelling="index_add").cuda()
    ref = copy.deepcopy(model)
    spacers = []
    for name in ("w1", "w2", "w3"):  # each expert's weight in a block of its own, out of expert order
        for i in torch.randperm(8).tolist():
            lin = getattr(model.experts.experts[i], name)
            spacers.append(torch.empty(4096 * (i + 1), device=DEV))
            lin.weight.data = lin.weight.data.clone()
    torch._dynamo.reset()
    before, graph_tables = dict(records.counters), len(weight_tables._READ_BY_GRAPHS)
    compiled = torch.compile(model, backend="moe", options={
        "triton.cudagraphs": True, "moe.rehome_weights": False, "moe.stack_expert_params": False})
    for step in range(4):
        x = make_input((37, 64), torch.bfloat16, seed=step).cuda().detach().requires_grad_()
        xr = x.detach().clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(x)
        out.float().sum().backward()
        expected = ref(xr)
        expected.float().sum().backward()
        assert_close_rel(out.detach(), expected.detach(), BF16_REL, f"step {step}: output")
        assert_close_rel(x.grad, xr.grad, BF16_GRAD_REL, f"step {step}: input grad")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close_rel(p.grad, q.grad, BF16_GRAD_REL, f"step {step}: grad of {name}")
    assert records.counters["rewritten"] - before.get("rewritten", 0) == 1
    assert len(weight_tables._READ_BY_GRAPHS) > graph_tables, "the experts must be read through tables in a graph"
