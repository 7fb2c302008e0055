"""GPU kernels (kernels/cuda.py) against the pure-torch references, on fresh random data.

Every output is checked for (a) closeness to the reference, (b) no NaN: the caching allocator is
poisoned with NaN blocks of each output's size right before the call, so an unwritten row reads
NaN, and (c) exact zeros in the rows past offsets[-1] ("dropped").
"""
from __future__ import annotations

import contextlib
import os
import zlib

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from moe_compile.kernels import cuda as kcuda  # noqa: E402  (registers the CUDA impls)
from moe_compile.kernels import ops, reference, registry  # noqa: E402

pytestmark = pytest.mark.gpu

# --- tolerances: relative Frobenius error ||out - ref|| / ||ref|| ---------------------------------
# bf16 outputs of fp32-accumulated GEMMs: both sides round the fp32 result once to bf16 (2^-8
# relative); a different fp32 summation order flips some roundings by one ulp (<= 2^-7).
BF16_GEMM_REL = 8e-3
# fp32 GEMM: tf32x3 (get_float32_matmul_precision "highest") vs a true-fp32 reference: ~1e-6
# measured-class error from the split products, 50x margin.
FP32_GEMM_REL = 5e-5
# fp32-accumulated sums (combine, bias grad, dot products over H) that differ from the reference
# only in summation order, on fp32 data: 2^-24 per add, amplified by cancellation when a single
# dot product (T=1) is checked (seen: 1.9e-6 for one 72-term dot).
FP32_SUM_REL = 2e-5
# the same sums rounded to a bf16 output: one bf16 rounding (2^-8) plus order flips.
BF16_SUM_REL = 8e-3
# end-to-end gradients of a small MoE layer (route -> permute -> GEMM -> SwiGLU -> GEMM -> combine)
# against the reference ops: bf16 roundings of 4 chained intermediates compound (~4 x 2^-8).
BF16_E2E_REL = 3e-2
FP32_E2E_REL = 2e-4  # tf32x3 GEMMs chained twice in forward and backward

DEV = "cuda"

# (T, K, E, H, N): sizes not multiple of any tile; M=1; a case with more tiles than programs.
SHAPES = [(1, 1, 4, 72, 200), (37, 2, 5, 72, 200), (37, 4, 8, 64, 128), (2048, 8, 16, 136, 392)]
ROUTINGS = ["uniform", "empty", "hot", "dropped", "all_dropped"]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


def make_ids(t: int, k: int, e: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """Distinct experts per token (like top-k), in [0, e) unless dropped."""
    scores = torch.rand(t, e, generator=gen, device=DEV)
    if routing == "empty":  # only every other expert is ever chosen (needs k <= ceil(e/2))
        scores[:, 1::2] -= 2.0
    ids = scores.topk(min(k, e), dim=-1).indices
    if ids.shape[1] < k:
        ids = torch.cat([ids, ids[:, :k - ids.shape[1]]], 1)
    if routing == "hot":
        ids[:] = e // 2
    elif routing == "dropped":
        drop = torch.rand(t, k, generator=gen, device=DEV) < 0.3
        ids = torch.where(drop, torch.where(torch.rand(t, k, generator=gen, device=DEV) < 0.5, e + 2, -1), ids)
    elif routing == "all_dropped":
        ids[:] = e
    return ids


def poison(*shapes_dtypes):
    """Leave NaN-filled blocks of these sizes in the caching allocator for the next allocations."""
    blocks = [torch.full(s, float("nan"), dtype=d, device=DEV) for s, d in shapes_dtypes]
    del blocks


def total_rows(offsets: torch.Tensor) -> int:
    return int(offsets[-1])  # test-side only; the kernels never sync


def count_calls(monkeypatch, module, name: str) -> list:
    """The calls of ``module.name`` for the rest of the test, one entry each (the real one still runs):
    a test of one kernel fails when another one ran instead."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or real(*a))
    return calls


@contextlib.contextmanager
def gmm_backend(name: str):
    old, kcuda.GMM_BACKEND = kcuda.GMM_BACKEND, name
    try:
        yield
    finally:
        kcuda.GMM_BACKEND = old


@contextlib.contextmanager
def wgrad_backend(name: str):
    """The weight-gradient kernel: "cutlass", "triton", "quack" (quack's default tile scheduler) or
    "quack:static" / "quack:dynamic". quack's calls are counted with the scheduler each one ran: a test
    of quack's path fails when the kernel (or scheduler) was not the one that ran."""
    from moe_compile.kernels import _quack

    name, _, scheduler = name.partition(":")
    if name == "quack" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("quack's weight gradient is used on sm90 only")
    if name == "quack" and not _quack.available():
        pytest.skip(f"quack-kernels not usable here: {_quack.why_not()}")
    calls = []
    real = _quack.grouped_mm_wgrad

    def counted(*args, dynamic=False):
        calls.append("dynamic" if dynamic else "static")
        return real(*args, dynamic=dynamic)

    old = kcuda.WGRAD_BACKEND, kcuda.WGRAD_SCHEDULER
    kcuda.WGRAD_BACKEND = "quack" if name == "quack" else "cutlass"
    kcuda.WGRAD_SCHEDULER = scheduler or kcuda.WGRAD_SCHEDULER
    _quack.grouped_mm_wgrad = counted
    try:
        with gmm_backend("triton" if name == "triton" else "auto"):
            yield calls
    finally:
        kcuda.WGRAD_BACKEND, kcuda.WGRAD_SCHEDULER = old
        _quack.grouped_mm_wgrad = real


reference_impls = registry.reference_only


@pytest.fixture
def gen(request):
    g = torch.Generator(device=DEV)
    # fresh random data per test, reproducible: MOE_TEST_SEED=<n> varies every draw
    g.manual_seed(zlib.crc32(request.node.name.encode()) + int(os.environ.get("MOE_TEST_SEED", "0")))
    return g


def rand(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=DEV) * scale).to(dtype)


# ------------------------------------------------------------------------------- routing ops
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_route_permute_and_permute_rows(shape, routing, gen):
    t, k, e, h, _ = shape
    ids = make_ids(t, k, e, routing, gen)
    perm, inv, offsets = kcuda.route_permute(ids, e)
    rp, ri, ro = reference.route_permute(ids, e)
    assert perm.dtype == inv.dtype == torch.long and offsets.dtype == torch.int32
    assert torch.equal(perm, rp) and torch.equal(inv, ri) and torch.equal(offsets, ro)
    for dtype in (torch.bfloat16, torch.float32):
        x = rand((t, h), dtype, gen)
        poison(((t * k, h), dtype))
        xp = kcuda.permute_rows(x, perm, offsets, k)
        assert torch.equal(xp, reference.permute_rows(x, perm, offsets, k))


@pytest.mark.parametrize("t,k,e,triton_path", [(8192, 8, 128, True), (4097, 6, 64, True), (333, 2, 4, True),
                                                 (3000, 1, 1, True), (8192, 8, 256, True), (8193, 8, 256, False),
                                                 (40000, 8, 128, False)])
def test_route_permute_sizes(t, k, e, triton_path, gen, monkeypatch):
    """Many blocks (a layer's 65,536 rows), a partial last block, one expert, the Triton kernel's
    register budget exactly (256 experts, 65,536 ids: 32,768 counts) and one block past it (the torch
    sort runs): the same stable permutation as the reference, dropped ids included. The outputs'
    memory is poisoned first: offsets are written by the kernel's first block only."""
    from moe_compile.kernels import _triton_moe

    calls = count_calls(monkeypatch, _triton_moe, "route_permute")
    ids = make_ids(t, k, e, "dropped", gen)
    assert (_triton_moe.route_permute_counts(t * k, e) <= kcuda.ROUTE_PERMUTE_MAX_COUNTS) == triton_path
    poison(((t * k,), torch.float64), ((t * k,), torch.float64), ((e,), torch.float32))  # perm, inv, offsets
    got = kcuda.route_permute(ids, e)
    for g_, r_ in zip(got, reference.route_permute(ids, e)):
        assert g_.dtype == r_.dtype and torch.equal(g_, r_)
    assert len(calls) == (1 if triton_path else 0)


# ------------------------------------------------------------------------------- router top-k
def _topk_rule(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices router_topk's kernel promises: descending in the bit order torch.topk's CUDA radix
    select ranks by (every NaN first, -0 just below +0), ties to the lower index (a stable
    descending sort of the keys)."""
    xf = x.float().reshape(-1, x.shape[-1])
    bits = torch.where(xf.isnan(), torch.full_like(xf, float("nan")), xf).view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k].reshape(*x.shape[:-1], k)


@pytest.mark.parametrize("shape,k", [((8192, 128), 8), ((4096, 1, 64), 2), ((4096, 8, 32), 2), ((300, 64), 6),
                                     ((37, 1024), 64), ((5, 1), 1), ((0, 16), 2), ((33, 3), 3), ((19, 160), 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_router_topk_matches_torch_topk(shape, k, dtype, ties, gen, monkeypatch):
    """Same values and the same chosen set as torch.topk on CUDA, ties at the k-th place included
    (both take the lower indices), in the promised order; outputs poisoned first."""
    from moe_compile.kernels import _triton_moe

    x = rand(shape, dtype, gen)
    if ties:  # few distinct scores: equal values inside the top k and at its boundary
        x = (x * 2).round() / 2
    calls = count_calls(monkeypatch, _triton_moe, "router_topk")
    poison(((max(x.numel() // x.shape[-1], 1), k), dtype))
    v, i = ops.router_topk(x, k)
    assert calls == [1], "the Triton kernel did not run"
    rv, ri = torch.topk(x, k, dim=-1)
    assert v.shape == rv.shape and i.dtype == torch.long
    assert torch.equal(v, rv), "values differ from torch.topk"
    assert torch.equal(i.sort(-1).values, ri.sort(-1).values), "a different set of entries than torch.topk"
    assert torch.equal(i, _topk_rule(x, k))
    assert torch.equal(torch.gather(x, -1, i), v)
    if ties and i.numel():  # torch.topk does not specify the order of equal entries: reported, not asserted
        print(f"router_topk order == torch.topk order on {(i == ri).all(-1).float().mean().item():.3f} of rows")


def test_router_topk_special_values(gen, monkeypatch):
    """NaN ranks above +inf, -inf below every number, -0 just below +0 (as torch.topk ranks them on
    CUDA: the same set chosen, zeros of both signs at the k-th place included); rows read through a
    stride (a transposed view)."""
    from moe_compile.kernels import _triton_moe

    x = rand((64, 48), torch.float32, gen)
    x[::3, 5] = float("nan")
    x[::2, 7] = float("inf")
    x[:, 9] = float("-inf")
    x[:, 11], x[:, 12] = -0.0, 0.0
    x[1::2, :20] = -0.0
    xt = x.t().contiguous().t()  # same values, column-major rows
    calls = count_calls(monkeypatch, _triton_moe, "router_topk")
    ref = torch.topk(x, 24)
    for inp in (x, xt):
        v, i = ops.router_topk(inp, 24)
        assert torch.equal(i, _topk_rule(x, 24))
        assert torch.equal(v.nan_to_num(7.0), ref.values.nan_to_num(7.0))
        assert torch.equal(i.sort(-1).values, ref.indices.sort(-1).values), "a different set than torch.topk"
    # a row of +-0 only: torch.topk takes every +0 before any -0
    z = torch.zeros(3, 16, device=DEV)
    z[:, ::2] = -0.0
    v, i = ops.router_topk(z, 8)
    assert torch.equal(i.sort(-1).values, torch.topk(z, 8).indices.sort(-1).values)
    assert not torch.signbit(v).any(), "+0 ranks above -0"
    assert calls == [1, 1, 1]


def test_router_topk_past_the_kernel_uses_torch(gen, monkeypatch):
    """Rows wider than ROUTER_TOPK_MAX_E (or k past ROUTER_TOPK_MAX_K) go to torch.topk, same results."""
    from moe_compile.kernels import _triton_moe

    calls = count_calls(monkeypatch, _triton_moe, "router_topk")
    for shape, k in (((7, _triton_moe.ROUTER_TOPK_MAX_E + 1), 4), ((7, 256), _triton_moe.ROUTER_TOPK_MAX_K + 1)):
        x = rand(shape, torch.float32, gen)
        v, i = ops.router_topk(x, k)
        rv, ri = torch.topk(x, k)
        assert torch.equal(v, rv) and torch.equal(i, ri)
    assert calls == []


# ------------------------------------------------------------------------------- grouped GEMM
@pytest.mark.parametrize("backend", ["tma", "cutlass", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_mm(shape, routing, dtype, backend, gen, monkeypatch):
    t, k, e, h, n = shape
    ids = make_ids(t, k, e, routing, gen)
    _, _, offsets = kcuda.route_permute(ids, e)
    m, total = t * k, total_rows(offsets)
    x = rand((m, h), dtype, gen)
    # fp16 has 3 more mantissa bits than bf16: the bf16 bound holds with room
    tol = FP32_GEMM_REL if dtype == torch.float32 else BF16_GEMM_REL
    w_plain = rand((e, h, n), dtype, gen, h ** -0.5)
    w_trans = rand((e, n, h), dtype, gen, h ** -0.5).transpose(1, 2)  # the backward's layout
    # experts not N*K apart (a padded buffer): the TMA kernel's 3-D weight descriptor
    w_padded = rand((e, n + 8, h), dtype, gen, h ** -0.5)[:, :n].transpose(1, 2)
    bias = rand((e, n), dtype, gen)
    tma_calls = []
    if backend == "tma":
        if torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("the TMA grouped GEMM runs on sm90 only")
        from moe_compile.kernels import _triton_tma
        tma_calls = count_calls(monkeypatch, _triton_tma, "grouped_mm")
    with gmm_backend(backend):
        for w in (w_plain, w_trans, w_padded):
            for b in (None, bias):
                poison(((m, n), dtype))
                y = kcuda.grouped_mm(x, w, offsets, b)
                ref = reference.grouped_mm(x, w, offsets, b)
                assert y.shape == (m, n) and y.dtype == dtype and y.is_contiguous()
                assert not y.isnan().any(), "unwritten rows"
                assert torch.all(y[total:] == 0), "dropped rows must be zero"
                assert rel(y, ref) <= tol, (rel(y, ref), b is None, w.stride())
        if backend == "tma":  # every 16-bit case here is TMA-legal: a silent fallback must fail
            assert len(tma_calls) == (0 if dtype == torch.float32 or m == 0 else 6), len(tma_calls)
        # grouped_mm_list: ModuleList-style separate tensors (nn.Linear [N, K] viewed .t()), read
        # in place through the address table, and evenly spaced views of one buffer (zero-copy)
        separate = [rand((n, h), dtype, gen, h ** -0.5).t() for _ in range(e)]
        for ws in (separate, list(w_trans.unbind(0))):
            for b in ([], list(bias.unbind(0))):
                poison(((m, n), dtype))
                y = kcuda.grouped_mm_list(x, ws, offsets, b)
                ref = reference.grouped_mm(x, torch.stack(ws), offsets, torch.stack(b) if b else None)
                assert not y.isnan().any() and torch.all(y[total:] == 0)
                assert rel(y, ref) <= tol, ("list", rel(y, ref), len(b))


@pytest.mark.parametrize("backend", ["tma", "cutlass", "triton"])
def test_grouped_mm_empty_contraction(backend, gen, monkeypatch):
    """K = 0 (a zero-width input): y = bias of each row's expert, dropped rows 0. The TMA kernel
    writes a tile after its last k-step, so it must not take K = 0 (it would leave y unwritten)."""
    t, k, e, n = 37, 2, 5, 200
    _, _, offsets = kcuda.route_permute(make_ids(t, k, e, "dropped", gen), e)
    m, total = t * k, total_rows(offsets)
    # zero-width, but with 16-byte row strides: every other TMA condition holds, so only the K > 0
    # check keeps it off the TMA kernel
    x = torch.empty(m, 8, dtype=torch.bfloat16, device=DEV)[:, :0]
    w = torch.empty(e, 0, n, dtype=torch.bfloat16, device=DEV)
    bias = rand((e, n), torch.bfloat16, gen)
    from moe_compile.kernels import _triton_tma

    tma_calls = count_calls(monkeypatch, _triton_tma, "grouped_mm")
    with gmm_backend(backend):
        for b in (None, bias):
            poison(((m, n), torch.bfloat16))
            y = kcuda.grouped_mm(x, w, offsets, b)
            assert torch.equal(y, reference.grouped_mm(x, w, offsets, b)), b is None
            assert torch.all(y[total:] == 0) and (b is not None or torch.all(y == 0))
    assert not tma_calls


@pytest.mark.parametrize("h,n", [(64, 136), (128, 264), (136, 64), (64, 128), (128, 5760)])
@pytest.mark.parametrize("routing", ["uniform", "hot"])
def test_tma_tile_edges(h, n, routing, gen, monkeypatch):
    """The TMA kernel's tile edges, with more tiles than programs (each program runs several tiles
    through its flat (tile, k-step) loop): 1, 2 and 3 k-steps (the last one partial); each block
    size of N (64, 128, 256 columns); full tiles whose right half-tile store lies wholly past N
    (N mod BN in (0, BN/2]: 136, 264 and GPT-OSS's 5760) or partly past it, and both weight layouts."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA grouped GEMM runs on sm90 only")
    from moe_compile.kernels import _triton_tma

    t, k, e, dtype = 4096, 8, 16, torch.bfloat16
    _, _, offsets = kcuda.route_permute(make_ids(t, k, e, routing, gen), e)
    m, total = t * k, total_rows(offsets)
    x = rand((m, h), dtype, gen)
    calls = count_calls(monkeypatch, _triton_tma, "grouped_mm")
    layouts = (rand((e, h, n), dtype, gen, h ** -0.5), rand((e, n, h), dtype, gen, h ** -0.5).transpose(1, 2))
    with gmm_backend("tma"):
        for w in layouts:
            poison(((m, n), dtype))
            y = kcuda.grouped_mm(x, w, offsets)
            assert not y.isnan().any(), "unwritten rows"
            assert torch.all(y[total:] == 0), "dropped rows must be zero"
            assert rel(y, reference.grouped_mm(x, w, offsets)) <= BF16_GEMM_REL, w.stride()
    assert len(calls) == len(layouts)


def _sibling_weights(e, nh, h, dtype, gen, order):
    """torchtitan's w1, w3 ([E, NH, H] each, two allocations) as grouped_mm takes them ([E, H, NH] views):
    "ab" w1 at the lower address, "ba" w3 there (the descriptor's FLIP), "apart" with other memory between."""
    first = rand((e, nh, h), dtype, gen, h ** -0.5)
    between = torch.empty(1 << 20, dtype=dtype, device=DEV) if order == "apart" else None
    second = rand((e, nh, h), dtype, gen, h ** -0.5)
    del between
    lo, hi = sorted((first, second), key=lambda w: w.data_ptr())
    w1, w3 = (hi, lo) if order == "ba" else (lo, hi)
    return w1.transpose(1, 2), w3.transpose(1, 2)


@pytest.mark.parametrize("order", ["ab", "ba", "apart"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("t,e,h,nh", [(1, 4, 64, 64), (37, 5, 72, 128), (2048, 16, 136, 192), (4096, 8, 256, 768),
                                      (300, 4, 64, 2880)])
def test_grouped_mm_cat_halves_and_one_launch_dx(t, e, h, nh, routing, order, gen, monkeypatch):
    """grouped_mm_cat over two separate [E, NH, H] weights: two TMA launches writing the halves of one
    output, bit-equal to two grouped_mm side by side; its dx in one launch (one descriptor [2, E, NH, H]
    spanning both weights, one fp32 sum over K = 2 NH) against the reference; rows past the last group
    are 0. NH 2880 (GPT-OSS-20B): no 128- or 256-column tile divides it."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA grouped GEMM runs on sm90 only")
    from moe_compile.kernels import _triton_tma

    k, dtype = 2, torch.bfloat16
    _, _, offsets = kcuda.route_permute(make_ids(t, k, e, routing, gen), e)
    m, total = t * k, total_rows(offsets)
    wa, wb = _sibling_weights(e, nh, h, dtype, gen, order)
    x, dy = rand((m, h), dtype, gen), rand((m, 2 * nh), dtype, gen)
    assert _triton_tma.halves_supported(x, wa, wb) and _triton_tma.pair_supported(dy, wa, wb)
    halves = count_calls(monkeypatch, _triton_tma, "grouped_mm_halves")
    pairs = count_calls(monkeypatch, _triton_tma, "grouped_mm_cat_dx")
    poison(((m, 2 * nh), dtype), ((m, h), dtype))
    y = kcuda.grouped_mm_cat(x, wa, wb, offsets)
    dx = kcuda.grouped_mm_cat_dx(dy, wa, wb, offsets)
    assert (len(halves), len(pairs)) == (1, 1), "a silent fallback must fail"
    assert torch.equal(y, torch.cat([kcuda.grouped_mm(x, wa, offsets), kcuda.grouped_mm(x, wb, offsets)], 1))
    assert not dx.isnan().any() and torch.all(dx[total:] == 0), "unwritten or dropped rows"
    assert rel(dx, reference.grouped_mm_cat_dx(dy, wa, wb, offsets)) <= BF16_GEMM_REL


def test_grouped_mm_cat_falls_back_where_one_descriptor_cannot_serve(gen, monkeypatch):
    """Weights that one descriptor cannot address (overlapping views of one buffer, NH not a multiple of
    the k-step, row-major [E, K, N] storage, fp32) take two grouped GEMMs and their sum for the input
    gradient, with the same values; the forward writes its halves in place wherever the TMA kernel takes
    each weight (not fp32)."""
    from moe_compile.kernels import _triton_tma

    t, k, e, h = 64, 2, 4, 64
    _, _, offsets = kcuda.route_permute(make_ids(t, k, e, "uniform", gen), e)
    x = rand((t * k, h), torch.bfloat16, gen)
    both = rand((e, 2 * 128, h), torch.bfloat16, gen, h ** -0.5)
    cases = {"interleaved": (both[:, :128].transpose(1, 2), both[:, 128:].transpose(1, 2)),
             "nh_40": tuple(rand((e, 40, h), torch.bfloat16, gen, h ** -0.5).transpose(1, 2) for _ in range(2)),
             "row_major": tuple(rand((e, h, 128), torch.bfloat16, gen, h ** -0.5) for _ in range(2)),
             "fp32": tuple(rand((e, 128, h), torch.float32, gen, h ** -0.5).transpose(1, 2) for _ in range(2))}
    halves = count_calls(monkeypatch, _triton_tma, "grouped_mm_halves")
    pairs = count_calls(monkeypatch, _triton_tma, "grouped_mm_cat_dx")
    for name, (wa, wb) in cases.items():
        xx = x.to(wa.dtype)
        dy = rand((t * k, 2 * wa.shape[2]), wa.dtype, gen)
        tol = FP32_GEMM_REL if wa.dtype == torch.float32 else BF16_GEMM_REL
        y = kcuda.grouped_mm_cat(xx, wa, wb, offsets)
        assert rel(y, reference.grouped_mm_cat(xx, wa, wb, offsets)) <= tol, name
        assert rel(kcuda.grouped_mm_cat_dx(dy, wa, wb, offsets),
                   reference.grouped_mm_cat_dx(dy, wa, wb, offsets)) <= 2 * tol, name   # two roundings, then a sum
    assert not pairs and len(halves) == (3 if torch.cuda.get_device_capability()[0] == 9 else 0), halves


@pytest.mark.parametrize("backend", ["cutlass", "triton", "quack:dynamic", "quack:static", "quack:auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_mm_wgrad_and_bias_grad(shape, routing, dtype, backend, gen):
    t, k, e, h, n = shape
    if backend.startswith("quack") and dtype != torch.bfloat16:
        pytest.skip("quack's kernel is used for 16-bit operands only")
    ids = make_ids(t, k, e, routing, gen)
    _, _, offsets = kcuda.route_permute(ids, e)
    m = t * k
    x, dy = rand((m, h), dtype, gen), rand((m, n), dtype, gen)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    ref = reference.grouped_mm_wgrad(x, dy, offsets, e)
    with wgrad_backend(backend) as calls:
        poison(((e, h, n), dtype), ((e, h, n), torch.float32))
        dw = kcuda.grouped_mm_wgrad(x, dy, offsets, e)
        poison(((e, h, n), dtype), ((e, h, n), dtype))
        dw_lp = ops.grouped_mm_wgrad_lowp(x, dy, offsets, e)
        again = ops.grouped_mm_wgrad_lowp(x, dy, offsets, e)
    # the same tiles whichever SM runs them (no split over K): a dynamic schedule is still deterministic
    assert torch.equal(again, dw_lp), "two calls on the same inputs must agree bit for bit"
    from moe_compile.kernels import _quack

    scheduler = backend.partition(":")[2]
    if scheduler == "auto":  # these small shapes are never balanced under a static schedule
        assert not _quack.static_is_balanced(h, n, torch.cuda.get_device_properties(0).multi_processor_count)
        scheduler = "dynamic"
    want = [scheduler] * 3 if backend.startswith("quack") else []
    assert calls == want, f"the weight-gradient kernel under test did not run as asked: {calls}"
    assert dw.shape == (e, h, n) and dw.dtype == torch.float32 and dw_lp.dtype == dtype
    for out, tol in ((dw, FP32_GEMM_REL if dtype == torch.float32 else BF16_GEMM_REL),
                     (dw_lp, BF16_GEMM_REL if dtype == torch.bfloat16 else FP32_GEMM_REL)):
        assert not out.isnan().any()
        assert torch.all(out[counts == 0] == 0), "empty experts must get zero gradient"
        assert rel(out, ref) <= tol
    poison(((e, n), torch.float32))
    db = kcuda.grouped_bias_grad(dy, offsets, e)
    assert db.dtype == torch.float32 and not db.isnan().any()
    assert rel(db, reference.grouped_bias_grad(dy, offsets, e)) <= FP32_SUM_REL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("routing", ["uniform", "empty", "dropped"])
def test_weight_grad_in_parameter_layout(routing, dtype, gen):
    """ops.grouped_mm_weight_grad returns w's dtype and strides (no copy when accumulating)."""
    t, k, e, h, n = 37, 4, 8, 72, 200
    ids = make_ids(t, k, e, routing, gen)
    _, _, offsets = kcuda.route_permute(ids, e)
    x, dy = rand((t * k, h), dtype, gen), rand((t * k, n), dtype, gen)
    ref = reference.grouped_mm_wgrad(x, dy, offsets, e)
    for w in (torch.empty(e, h, n, dtype=dtype, device=DEV), torch.empty(e, n, h, dtype=dtype, device=DEV).transpose(1, 2)):
        dw = ops.grouped_mm_weight_grad(x, dy, offsets, e, w.dtype, w.stride(-2) == 1)
        assert dw.dtype == dtype and dw.shape == w.shape and dw.stride() == w.stride()
        assert rel(dw, ref) <= (BF16_GEMM_REL if dtype == torch.bfloat16 else FP32_GEMM_REL)


# ------------------------------------------------------------------------------- combine
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_unpermute_combine_and_backward(shape, routing, dtype, gen):
    """Also unpermute_sum: the same kernel with the weights' loads left out (bit-equal to weight 1)."""
    t, k, e, h, _ = shape
    ids = make_ids(t, k, e, routing, gen)
    perm, inv, offsets = kcuda.route_permute(ids, e)
    y = rand((t * k, h), dtype, gen)
    weights = torch.rand(t, k, generator=gen, device=DEV).to(dtype)
    tol = BF16_SUM_REL if dtype == torch.bfloat16 else FP32_SUM_REL
    poison(((t, h), dtype))
    out = kcuda.unpermute_combine(y, inv, weights, offsets)
    assert not out.isnan().any()
    assert rel(out, reference.unpermute_combine(y, inv, weights, offsets)) <= tol
    poison(((t, h), dtype))
    summed = kcuda.unpermute_sum(y, perm, inv, offsets, k)
    assert torch.equal(summed, kcuda.unpermute_combine(y, inv, torch.ones(t, k, device=DEV), offsets))
    assert rel(summed, reference.unpermute_sum(y, perm, inv, offsets, k)) <= tol
    dout = rand((t, h), dtype, gen)
    poison(((t * k, h), dtype), ((t, k), dtype))
    dy, dw = kcuda.unpermute_combine_backward(dout, y, inv, weights, offsets)
    rdy, rdw = reference.unpermute_combine_backward(dout, y, inv, weights, offsets)
    assert not dy.isnan().any() and not dw.isnan().any()
    assert torch.all(dy[total_rows(offsets):] == 0)
    assert rel(dy, rdy) <= tol and rel(dw, rdw) <= tol


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_combine_into_a_wider_output(shape, routing, gen):
    """bf16 rows, fp32 weights and out_dtype=fp32: the same values as the kernels on y.float() (rows
    widened exactly on load, the same fp32 sum in the same order); the backward takes the fp32
    gradient and gives dy in bf16, rounded once, and the weights' gradient in fp32."""
    t, k, e, h, _ = shape
    ids = make_ids(t, k, e, routing, gen)
    perm, inv, offsets = kcuda.route_permute(ids, e)
    y = rand((t * k, h), torch.bfloat16, gen)
    weights = torch.rand(t, k, generator=gen, device=DEV)
    poison(((t, h), torch.float32))
    out = kcuda.unpermute_combine(y, inv, weights, offsets, torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, kcuda.unpermute_combine(y.float(), inv, weights, offsets))
    poison(((t, h), torch.float32))
    summed = kcuda.unpermute_sum(y, perm, inv, offsets, k, torch.float32)
    assert summed.dtype == torch.float32 and torch.equal(summed, kcuda.unpermute_sum(y.float(), perm, inv, offsets, k))
    dout = rand((t, h), torch.float32, gen)
    dy, dw = kcuda.unpermute_combine_backward(dout, y, inv, weights, offsets)
    wdy, wdw = kcuda.unpermute_combine_backward(dout, y.float(), inv, weights, offsets)
    assert dy.dtype == torch.bfloat16 and torch.equal(dy, wdy.to(torch.bfloat16))
    # dw's sum over H: Triton may lay out the fp32 reduction differently for 2- and 4-byte rows (the
    # same products, another order: differed on the 64-column shape on an H200)
    assert rel(dw, wdw) <= FP32_SUM_REL


_SCALE_DTYPES = [(torch.bfloat16, torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
                 (torch.float32, torch.float32, torch.float32), (torch.bfloat16, torch.float32, torch.float32)]


@pytest.mark.parametrize("dtypes", _SCALE_DTYPES, ids=["bf16_fp32w_to_bf16", "bf16", "fp32", "bf16_fp32_product"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_permute_scale_and_backward(shape, routing, dtypes, gen, monkeypatch):
    """The gather times each row's weight (torchtitan's expert-input scale): bit-equal to the reference
    (one fp32 product, rounded once); the backward's dx and dw sums in fp32 over another order."""
    from moe_compile.kernels import _triton_scale

    x_dtype, w_dtype, out_dtype = dtypes
    t, k, e, h, _ = shape
    ids = make_ids(t, k, e, routing, gen)
    perm, inv, offsets = kcuda.route_permute(ids, e)
    x = rand((t, h), x_dtype, gen)
    weights = torch.rand(t, k, generator=gen, device=DEV).to(w_dtype)
    fwd, bwd = (count_calls(monkeypatch, _triton_scale, n) for n in ("permute_scale", "permute_scale_backward"))
    poison(((t * k, h), out_dtype))
    xp = kcuda.permute_scale(x, perm, offsets, weights, out_dtype)
    assert xp.dtype == out_dtype and torch.equal(xp, reference.permute_scale(x, perm, offsets, weights, out_dtype))
    assert torch.all(xp[total_rows(offsets):] == 0)
    dxp = rand((t * k, h), out_dtype, gen)
    poison(((t, h), x_dtype), ((t, k), w_dtype))
    dx, dw = kcuda.permute_scale_backward(dxp, x, inv, weights, offsets)
    rdx, rdw = reference.permute_scale_backward(dxp, x, inv, weights, offsets)
    assert not dx.isnan().any() and not dw.isnan().any()
    assert (dx.dtype, dw.dtype) == (x_dtype, w_dtype)
    assert rel(dx, rdx) <= (BF16_SUM_REL if x_dtype == torch.bfloat16 else FP32_SUM_REL)
    assert rel(dw, rdw) <= (BF16_SUM_REL if w_dtype == torch.bfloat16 else FP32_SUM_REL)
    assert (len(fwd), len(bwd)) == (1, 1)   # the Triton kernels ran, not the reference


# ------------------------------------------------------------------------------- end to end
def _moe_layer(x, ids, topw, w13, b13, w2, e, k, as_list):
    moe = torch.ops.moe_compile
    perm, inv, offsets = moe.route_permute(ids, e)
    xp = moe.permute_rows(x, perm, inv, offsets, k)
    if isinstance(w13, list):  # separate per-expert leaves in nn.Linear layout [2I, H]
        h = moe.grouped_mm_list(xp, [w.t() for w in w13], offsets, list(b13.unbind(0)))
    elif as_list:
        h = moe.grouped_mm_list(xp, list(w13.unbind(0)), offsets, list(b13.unbind(0)))
    else:
        h = moe.grouped_mm(xp, w13, offsets, b13)
    inter = h.shape[1] // 2
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = moe.grouped_mm(a, w2, offsets, None)
    return moe.unpermute_combine(y, inv, topw, offsets)


@pytest.fixture
def weight_grads():
    yield "ops_bwd"  # ops.py's backward (weight grads in the parameter layout, rounded once)


@pytest.mark.parametrize("as_list", [False, True, "separate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("routing", ["uniform", "empty", "hot", "dropped"])
def test_layer_gradients_match_reference(routing, dtype, as_list, weight_grads, gen):
    t, k, e, h, inter = 37, 4, 8, 72, 40
    ids = make_ids(t, k, e, routing, gen)
    leaves = dict(x=rand((t, h), dtype, gen), topw=torch.rand(t, k, generator=gen, device=DEV).to(dtype),
                  w13=rand((e, h, 2 * inter), dtype, gen, h ** -0.5), b13=rand((e, 2 * inter), dtype, gen, 0.1),
                  w2=rand((e, inter, h), dtype, gen, inter ** -0.5))
    dout = rand((t, h), dtype, gen)

    def run():
        ts = {n: v.detach().clone().requires_grad_(True) for n, v in leaves.items()}
        w13 = ts["w13"]
        if as_list == "separate":
            w13 = [w.t().contiguous().detach().requires_grad_(True) for w in leaves["w13"].unbind(0)]
        out = _moe_layer(ts["x"], ids, ts["topw"], w13, ts["b13"], ts["w2"], e, k, as_list)
        out.backward(dout)
        grads = {n: v.grad for n, v in ts.items()}
        if as_list == "separate":
            grads["w13"] = torch.stack([w.grad.t() for w in w13])
        return out.detach(), grads

    out, grads = run()
    with reference_impls():
        rout, rgrads = run()
    tol = BF16_E2E_REL if dtype == torch.bfloat16 else FP32_E2E_REL
    assert rel(out, rout) <= tol
    for name in grads:
        assert grads[name] is not None and not grads[name].isnan().any(), name
        assert rel(grads[name], rgrads[name]) <= tol, (name, rel(grads[name], rgrads[name]))


def captured(step):
    """(graph, its static outputs): ``step`` run once to warm up (kernels compile, handles are made
    outside the capture), once on a side stream, then captured there (a host sync inside, or a launch
    on another stream, raises during capture)."""
    step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def test_layer_is_cuda_graph_safe(gen):
    """Capture route -> permute -> GEMM -> combine in a CUDA graph (a host sync inside would raise
    during capture), replay it on new routing, compare with eager."""
    t, k, e, h, n = 64, 2, 8, 64, 128
    dtype = torch.bfloat16
    ids = make_ids(t, k, e, "uniform", gen)
    x, topw = rand((t, h), dtype, gen), torch.rand(t, k, generator=gen, device=DEV).to(dtype)
    w = rand((e, h, n), dtype, gen, h ** -0.5)
    w2 = rand((e, n, h), dtype, gen, n ** -0.5)
    moe = torch.ops.moe_compile

    w2_list = [rand((h, n), dtype, gen, n ** -0.5).t() for _ in range(e)]  # ModuleList-style, read in place

    def step():
        perm, inv, offsets = moe.route_permute(ids, e)
        y = moe.grouped_mm(moe.permute_rows(x, perm, inv, offsets, k), w, offsets)
        y = moe.grouped_mm(y, w2, offsets) + moe.grouped_mm_list(y, w2_list, offsets, [])
        return moe.unpermute_combine(y, inv, topw, offsets)

    graph, static_out = captured(step)
    ids.copy_(make_ids(t, k, e, "dropped", gen))
    graph.replay()
    torch.cuda.synchronize()
    assert rel(static_out, step()) == 0.0


def test_quack_auto_scheduler_is_static_where_balanced(gen):
    """WGRAD_SCHEDULER="auto" runs the static schedule on a shape whose tiles per expert are a
    multiple of the SM count (Qwen3-30B-A3B's up projection on an H100 / H200), on uneven routing."""
    from moe_compile.kernels import _quack

    p, q = 1536, 2048
    balanced = _quack.static_is_balanced(p, q, torch.cuda.get_device_properties(0).multi_processor_count)
    ids = make_ids(96, 2, 4, "empty", gen)
    _, _, offsets = kcuda.route_permute(ids, 4)
    x, dy = rand((192, p), torch.bfloat16, gen), rand((192, q), torch.bfloat16, gen)
    with wgrad_backend("quack:auto") as calls:
        dw = ops.grouped_mm_wgrad_lowp(x, dy, offsets, 4)
    assert calls == ["static" if balanced else "dynamic"]
    assert rel(dw, reference.grouped_mm_wgrad(x, dy, offsets, 4)) <= BF16_GEMM_REL


@pytest.mark.parametrize("scheduler", ["dynamic", "static"])
def test_quack_wgrad_in_cuda_graph(scheduler, gen):
    """quack's weight gradient launches on the current stream (capture on a side stream would fail
    otherwise), needs no host sync, and a replay on new routing (empty experts included) matches;
    the dynamic scheduler's tile counter is zeroed inside the graph, so a replay starts from tile 0."""
    t, k, e, h, n = 256, 4, 16, 136, 392
    dtype = torch.bfloat16
    ids = make_ids(t, k, e, "uniform", gen)
    x, dy = rand((t * k, h), dtype, gen), rand((t * k, n), dtype, gen)
    with wgrad_backend(f"quack:{scheduler}") as calls:
        def step():
            _, _, offsets = kcuda.route_permute(ids, e)
            return ops.grouped_mm_wgrad_lowp(x, dy, offsets, e), offsets

        graph, (static_dw, static_offsets) = captured(step)
        ids.copy_(make_ids(t, k, e, "empty", gen))
        for _ in range(2):  # a second replay: a tile counter left at its end would write nothing
            static_dw.fill_(float("nan"))  # an expert the replay does not write stays NaN
            graph.replay()
            torch.cuda.synchronize()
            counts = torch.diff(static_offsets, prepend=static_offsets.new_zeros(1))
            assert (counts == 0).any(), "the replayed routing must leave experts empty"
            assert torch.all(static_dw[counts == 0] == 0)
            assert rel(static_dw, reference.grouped_mm_wgrad(x, dy, static_offsets, e)) <= BF16_GEMM_REL
    assert calls == [scheduler] * 3


def test_opcheck_cuda(gen):
    t, k, e, h, n = 19, 2, 4, 32, 48
    ids = make_ids(t, k, e, "dropped", gen)
    perm, inv, offsets = torch.ops.moe_compile.route_permute(ids, e)
    x = rand((t * k, h), torch.float32, gen)
    w = rand((e, h, n), torch.float32, gen)
    torch.library.opcheck(torch.ops.moe_compile.grouped_mm, (x, w, offsets, None))
    torch.library.opcheck(torch.ops.moe_compile.grouped_mm_wgrad_lowp, (x, rand((t * k, n), torch.float32, gen),
                                                                         offsets, e))
    torch.library.opcheck(torch.ops.moe_compile.route_permute, (ids, e))


# bf16 SwiGLU: the kernel and the reference both compute in fp32 and round once; fp32 math in a
# different order (sigmoid via exp2 in Triton) flips a few roundings by one ulp (2^-8).
BF16_ACT_REL = 4e-3
FP32_ACT_REL = 1e-6  # fp32 sigmoid implementations differ by a few ulp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n", [(1, 8), (37, 200), (4099, 768)])
def test_swiglu_kernels(m, n, dtype, gen):
    h = rand((m, 2 * n), dtype, gen, 3.0)
    da = rand((m, n), dtype, gen)
    poison(((m, n), dtype), ((m, 2 * n), dtype))
    a, dh = kcuda.swiglu(h), kcuda.swiglu_backward(h, da)
    tol = BF16_ACT_REL if dtype == torch.bfloat16 else FP32_ACT_REL
    assert not a.isnan().any() and not dh.isnan().any()
    assert rel(a, reference.swiglu(h)) <= tol
    assert rel(dh, reference.swiglu_backward(h, da)) <= tol
    hs = rand((m, 4 * n), dtype, gen)[:, ::2]  # a strided h is accepted (copied once)
    assert rel(kcuda.swiglu(hs), reference.swiglu(hs)) <= tol


# the weight's gradient sums N products per row in fp32, in column order in both (chunks of 128 in the
# kernel, torch's reduction order in the reference): a few fp32 ulps, far below bf16's inputs
WEIGHT_GRAD_REL = 1e-5


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("t,k,e,n", [(1, 1, 4, 8), (37, 2, 6, 200), (1029, 8, 32, 768), (0, 2, 4, 64)])
def test_weighted_swiglu_kernels(t, k, e, n, routing, dtype, wdtype, gen):
    """Rows past offsets[-1] (dropped ids) get weight 0 in a, dh and their pair's dweights."""
    ids = make_ids(t, k, e, routing, gen) if t else torch.zeros(0, k, dtype=torch.long, device=DEV)
    perm, inv, offsets = kcuda.route_permute(ids, e)
    m = t * k
    h = rand((m, 2 * n), dtype, gen, 3.0)
    da = rand((m, n), dtype, gen)
    weights = torch.rand(t, k, generator=gen, device=DEV).to(wdtype)
    poison(((m, n), dtype), ((m, 2 * n), dtype), ((t, k), wdtype))
    a = kcuda.weighted_swiglu(h, weights, perm, offsets)
    dh, dw = kcuda.weighted_swiglu_backward(h, weights, perm, offsets, da)
    tol = BF16_ACT_REL if dtype == torch.bfloat16 else FP32_ACT_REL
    assert not a.isnan().any() and not dh.isnan().any() and not dw.isnan().any()
    assert dw.dtype == wdtype and dw.shape == weights.shape
    assert rel(a, reference.weighted_swiglu(h, weights, perm, offsets)) <= tol
    rdh, rdw = reference.weighted_swiglu_backward(h, weights, perm, offsets, da)
    assert rel(dh, rdh) <= tol
    assert rel(dw, rdw) <= (BF16_ACT_REL if wdtype == torch.bfloat16 else WEIGHT_GRAD_REL)
    dropped = total_rows(offsets)
    assert torch.all(a[dropped:] == 0) and torch.all(dh[dropped:] == 0)


def test_dropped_pairs_are_never_read_cuda():
    """The CUDA ops with inf / NaN in dropped pairs' weights and rows (tests/helpers.py)."""
    from helpers import check_dropped_pairs_unread

    check_dropped_pairs_unread("cuda")
