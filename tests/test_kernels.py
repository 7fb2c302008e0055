"""The moe_compile custom ops against a naive per-token loop, opcheck, and gradients.

Index-producing ops (route_permute) must match exactly; GEMM and combine outputs pass a relative
Frobenius-error floor against an fp64 per-token reference.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import OP_BF16_REL, OP_FP32_REL, check_dropped_pairs_unread
from moe_compile.kernels import ops  # noqa: F401  (registers torch.ops.moe_compile.*)
from helpers import rel_err

# three bf16 ops chained (activation, GEMM, sum), each rounding its output once to bf16 (2^-8
# relative), against the fp64 chain: up to three roundings' worth of OP_BF16_REL.
OP_BF16_CHAIN_REL = 3 * OP_BF16_REL

OPS = torch.ops.moe_compile


def _routing(t, k, e, kind, gen):
    """expert ids [T, K] with distinct ids per token (like topk); kinds: random, empty, hot, dropped."""
    scores = torch.rand(t, e, generator=gen)
    if kind == "empty":
        scores[:, [0, e - 1]] = -1.0            # experts 0 and E-1 get no token
    elif kind == "hot":
        scores[:, :k] += 10.0                   # every token picks experts 0..K-1
    ids = scores.topk(k, dim=-1).indices
    if kind == "dropped":                       # ids >= E (e.g. other ranks' experts) are dropped
        ids = torch.where(torch.rand(t, k, generator=gen) < 0.3, ids + e, ids)
    return ids


def naive_moe(x, ids, w_routing, w_experts, bias=None):
    """out[t] = sum_j w[t, j] * (x[t] @ W[ids[t, j]] (+ b)) in fp64, token by token; ids outside
    [0, E) contribute nothing."""
    t, k = ids.shape
    e = w_experts.shape[0]
    out = torch.zeros(t, w_experts.shape[-1], dtype=torch.float64)
    for i in range(t):
        for j in range(k):
            ex = int(ids[i, j])
            if 0 <= ex < e:
                y = x[i].double() @ w_experts[ex].double()
                if bias is not None:
                    y = y + bias[ex].double()
                out[i] += w_routing[i, j].double() * y
    return out


def moe_ops(x, ids, w_routing, w_experts, bias=None):
    e, k = w_experts.shape[0], ids.shape[1]
    perm, inv, offs = OPS.route_permute(ids, e)
    h = OPS.permute_rows(x, perm, inv, offs, k)
    h = OPS.grouped_mm(h, w_experts, offs, bias)
    return OPS.unpermute_combine(h, inv, w_routing, offs)


@pytest.mark.parametrize("kind", ["random", "empty", "hot", "dropped"])
@pytest.mark.parametrize("k", [1, 2])
def test_route_permute_exact(kind, k):
    gen = torch.Generator().manual_seed(1)
    t, e = 11, 5
    ids = _routing(t, k, e, kind, gen)
    perm, inv, offs = OPS.route_permute(ids, e)
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < e)
    counts = torch.tensor([(flat == i).sum().item() for i in range(e)])
    assert offs.dtype == torch.int32 and offs.tolist() == counts.cumsum(0).tolist()
    assert sorted(perm.tolist()) == list(range(t * k))
    assert torch.equal(inv[perm], torch.arange(t * k))
    # group g owns rows [offs[g-1], offs[g]) and they hold exactly expert g's pairs, in token order
    start = 0
    for g in range(e):
        rows = perm[start:int(offs[g])]
        assert (flat[rows] == g).all() and torch.equal(rows, rows.sort().values)
        start = int(offs[g])
    assert not valid[perm[start:]].any()  # dropped pairs sort last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["random", "empty", "hot", "dropped"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_ops_chain_vs_naive(dtype, kind, k, with_bias):
    gen = torch.Generator().manual_seed(2)
    t, e, h, n = 13, 5, 12, 7
    ids = _routing(t, k, e, kind, gen)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w = (torch.randn(e, h, n, generator=gen) / h ** 0.5).to(dtype)
    b = torch.randn(e, n, generator=gen).to(dtype) if with_bias else None
    wr = torch.rand(t, k, generator=gen)
    got = moe_ops(x, ids, wr, w, b)
    assert got.dtype == dtype and got.shape == (t, n)
    ref = naive_moe(x, ids, wr, w, b)
    assert rel_err(got, ref) <= (OP_BF16_REL if dtype == torch.bfloat16 else OP_FP32_REL)
    if kind == "dropped":  # a token whose every id is dropped gets exactly zero
        all_dropped = (ids >= e).all(-1)
        assert (got[all_dropped] == 0).all()


def test_grouped_mm_list_matches_stacked():
    gen = torch.Generator().manual_seed(3)
    e, m, kdim, n = 4, 10, 6, 5
    x = torch.randn(m, kdim, generator=gen)
    ws = [torch.randn(kdim, n, generator=gen) for _ in range(e)]
    bs = [torch.randn(n, generator=gen) for _ in range(e)]
    offs = torch.tensor([3, 3, 7, 9], dtype=torch.int32)  # expert 1 empty, row 9 dropped
    got = OPS.grouped_mm_list(x, ws, offs, bs)
    ref = OPS.grouped_mm(x, torch.stack(ws), offs, torch.stack(bs))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert (got[9] == 0).all()
    for g, (s, t) in enumerate([(0, 3), (3, 3), (3, 7), (7, 9)]):
        torch.testing.assert_close(got[s:t], x[s:t] @ ws[g] + bs[g])


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("kind", ["random", "empty", "dropped"])
def test_grads_vs_naive_autograd(k, kind):
    gen = torch.Generator().manual_seed(4)
    t, e, h, n = 9, 4, 6, 5
    ids = _routing(t, k, e, kind, gen)
    x = torch.randn(t, h, generator=gen, dtype=torch.float64).requires_grad_()
    w = torch.randn(e, h, n, generator=gen, dtype=torch.float64).requires_grad_()
    b = torch.randn(e, n, generator=gen, dtype=torch.float64).requires_grad_()
    wr = torch.rand(t, k, generator=gen, dtype=torch.float64).requires_grad_()
    cot = torch.randn(t, n, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((moe_ops(x, ids, wr, w, b) * cot).sum(), (x, w, b, wr))
    ref = torch.autograd.grad((naive_moe(x, ids, wr, w, b) * cot).sum(), (x, w, b, wr))
    for name, g, r in zip(("x", "w", "bias", "routing weights"), got, ref):
        assert g.shape == r.shape
        # both sides are fp64 here, except the ops' fp32 internal accumulation (wgrad, combine)
        assert rel_err(g, r) <= OP_FP32_REL, name


def test_grouped_mm_list_grads():
    gen = torch.Generator().manual_seed(5)
    e, m, kdim, n = 3, 8, 4, 6
    x = torch.randn(m, kdim, generator=gen).requires_grad_()
    ws = [torch.randn(kdim, n, generator=gen).requires_grad_() for _ in range(e)]
    bs = [torch.randn(n, generator=gen).requires_grad_() for _ in range(e)]
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)
    cot = torch.randn(m, n, generator=gen)
    got = torch.autograd.grad((OPS.grouped_mm_list(x, ws, offs, bs) * cot).sum(), [x, *ws, *bs])
    bounds = [(0, 2), (2, 2), (2, 7)]
    ref_out = torch.zeros(m, n)
    for g, (s, t) in enumerate(bounds):
        ref_out = ref_out.index_put((torch.arange(s, t),), x[s:t] @ ws[g] + bs[g])
    ref = torch.autograd.grad((ref_out * cot).sum(), [x, *ws, *bs])
    for g, r in zip(got, ref):
        assert rel_err(g, r) <= OP_FP32_REL if r.norm() > 0 else g.norm() == 0


def _opcheck_samples():
    gen = torch.Generator().manual_seed(6)
    t, k, e, h, n = 7, 2, 4, 8, 6
    ids = _routing(t, k, e, "empty", gen)
    perm, inv, offs = OPS.route_permute(ids, e)
    x = torch.randn(t, h, generator=gen, requires_grad=True)
    xp = torch.randn(t * k, h, generator=gen, requires_grad=True)
    w = torch.randn(e, h, n, generator=gen, requires_grad=True)
    b = torch.randn(e, n, generator=gen, requires_grad=True)
    ws = [torch.randn(h, n, generator=gen, requires_grad=True) for _ in range(e)]
    y = torch.randn(t * k, n, generator=gen, requires_grad=True)
    wr = torch.rand(t, k, generator=gen, requires_grad=True)
    yb = torch.randn(t * k, n, generator=gen).bfloat16().requires_grad_()
    return {
        "route_permute": (ids, e),
        "permute_rows": (x, perm, inv, offs, k),
        "grouped_mm": (xp, w, offs, b),
        "grouped_mm_list": (xp, ws, offs, []),
        "unpermute_combine": (y, inv, wr, offs),
        "grouped_mm_wgrad": (xp.detach(), y.detach(), offs, e),
        "grouped_bias_grad": (y.detach(), offs, e),
        "unpermute_combine_backward": (torch.randn(t, n, generator=gen), y.detach(), inv, wr.detach(), offs),
        "unpermute_sum": (y, perm, inv, offs, k),
        # bf16 rows summed into an fp32 output (lowering/region.py `_wide`)
        "unpermute_combine:wide": (yb, inv, wr, offs, torch.float32),
        "unpermute_sum:wide": (yb, perm, inv, offs, k, torch.float32),
        "weighted_swiglu": (torch.randn(t * k, 2 * n, generator=gen, requires_grad=True), wr, perm, offs),
        "weighted_swiglu_backward": (torch.randn(t * k, 2 * n, generator=gen), wr.detach(), perm, offs,
                                     torch.randn(t * k, n, generator=gen)),
        "permute_scale": (x, perm, inv, offs, wr, torch.float32),
        # bf16 rows times fp32 weights, the product rounded to bf16 (torchtitan's (rows.float() * w).to(bf16))
        "permute_scale:bf16": (x.detach().bfloat16().requires_grad_(), perm, inv, offs, wr, torch.bfloat16),
        "permute_scale_backward": (torch.randn(t * k, h, generator=gen), x.detach(), inv, wr.detach(), offs),
        "saved_copy": (x,),
        "saved_copy:strided": (xp.t(),),
    }


@pytest.mark.parametrize("name", list(_opcheck_samples()))
def test_opcheck(name):
    torch.library.opcheck(getattr(OPS, name.split(":")[0]).default, _opcheck_samples()[name])


@pytest.mark.parametrize("kind", ["random", "empty", "hot", "dropped"])
@pytest.mark.parametrize("tokens", [0, 1, 9])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32, torch.float32),
                                    (torch.bfloat16, torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32, torch.float32)],
                         ids=["fp32", "bf16_rows_fp32_weights_to_bf16", "bf16", "bf16_rows_fp32_product"])
def test_permute_scale_is_the_gather_times_the_weights(kind, tokens, dtypes):
    """permute_scale = permute_rows, then rows.float() * w.flat[perm], rounded once to out_dtype (torchtitan's
    expert-input scale); outputs, and the input's and weights' gradients, against eager's ops in fp64."""
    x_dtype, w_dtype, out_dtype = dtypes
    gen = torch.Generator().manual_seed(21 + tokens)
    k, e, h = 2, 4, 24
    ids = _routing(tokens, k, e, kind, gen) if tokens else torch.zeros(0, k, dtype=torch.long)
    perm, inv, offs = OPS.route_permute(ids, e)
    x = torch.randn(tokens, h, generator=gen).to(x_dtype).requires_grad_()
    w = torch.rand(tokens, k, generator=gen).to(w_dtype).requires_grad_()
    got = OPS.permute_scale(x, perm, inv, offs, w, out_dtype)
    assert got.dtype == out_dtype and got.shape == (tokens * k, h)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    valid = (torch.arange(tokens * k) < offs[-1]).unsqueeze(-1)
    ref = OPS.permute_rows(x64, perm, inv, offs, k) * w64.reshape(-1)[perm].unsqueeze(-1) * valid
    cot = torch.randn(got.shape, generator=gen).to(out_dtype)
    grads = torch.autograd.grad((got.double() * cot.double()).sum(), [x, w]) if tokens else (x, w)
    refs = torch.autograd.grad((ref * cot.double()).sum(), [x64, w64]) if tokens else (x64, w64)
    tol = OP_FP32_REL if out_dtype == x_dtype == torch.float32 else OP_BF16_CHAIN_REL
    for g, r in zip((got, *grads), (ref, *refs)):
        assert rel_err(g.double(), r.detach()) <= tol if r.norm() > 0 else g.abs().sum() == 0
    if kind == "dropped" and tokens:
        assert got[int(offs[-1]):].abs().sum() == 0 and bool((valid == 0).any())


def test_ops_validate_inputs():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="route_permute"):
        OPS.route_permute(torch.rand(4, 2), 3)
    with pytest.raises(ValueError, match="grouped_mm"):
        OPS.grouped_mm(x, torch.randn(2, 5, 6), torch.tensor([1, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="grouped_mm"):
        OPS.grouped_mm(x.bfloat16(), torch.randn(2, 3, 6), torch.tensor([1, 4], dtype=torch.int32))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=st.integers(1, 12), k=st.integers(1, 3), e=st.integers(1, 6), h=st.integers(1, 9),
       kind=st.sampled_from(["random", "empty", "hot", "dropped"]), seed=st.integers(0, 2 ** 16))
def test_hypothesis_ops_vs_naive(t, k, e, h, kind, seed):
    k = min(k, e)
    if kind == "empty" and e < 3 + k:
        kind = "random"  # "empty" zeroes experts 0 and E-1 and needs K others left
    gen = torch.Generator().manual_seed(seed)
    ids = _routing(t, k, e, kind, gen)
    x = torch.randn(t, h, generator=gen, dtype=torch.float64).requires_grad_()
    w = torch.randn(e, h, 5, generator=gen, dtype=torch.float64).requires_grad_()
    wr = torch.rand(t, k, generator=gen, dtype=torch.float64).requires_grad_()
    got = moe_ops(x, ids, wr, w)
    ref = naive_moe(x, ids, wr, w)
    assert rel_err(got, ref) <= OP_FP32_REL or ref.norm() == 0 and got.norm() == 0
    cot = torch.randn(t, 5, generator=gen, dtype=torch.float64)
    gg = torch.autograd.grad((got * cot).sum(), (x, w, wr))
    if ref.requires_grad:
        gr = torch.autograd.grad((ref * cot).sum(), (x, w, wr), allow_unused=True, materialize_grads=True)
    else:  # every id dropped: the naive loop never touched the inputs, so their gradients are zero
        gr = [torch.zeros_like(v) for v in (x, w, wr)]
    for g, r in zip(gg, gr):
        assert rel_err(g, r) <= OP_FP32_REL if r.norm() > 0 else g.norm() == 0


@pytest.mark.parametrize("rows", [0, 1, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_cat_vs_two_grouped_mm(dtype, rows):
    """torchtitan's w1 and w3 ([E, N, K] Parameters, used as their [E, K, N] transposes) as one op equal two
    grouped_mm side by side: outputs, the input's and both weights' gradients; its dx op in one sum."""
    torch.manual_seed(4)
    k, e, h, i = 2, 4, 8, 6
    ids = torch.randint(0, e, (rows, k))
    if rows:
        ids[0] = e + 1  # a dropped pair
    _, _, offs = ops.route_permute(ids, e)
    x = torch.randn(rows * k, h, dtype=dtype, requires_grad=True)
    w1, w3 = (torch.nn.Parameter(torch.randn(e, i, h, dtype=dtype)) for _ in range(2))
    y = ops.grouped_mm_cat(x, w1.transpose(1, 2), w3.transpose(1, 2), offs)
    ref = torch.cat([ops.grouped_mm(x, w1.transpose(1, 2), offs), ops.grouped_mm(x, w3.transpose(1, 2), offs)], 1)
    tol = OP_BF16_REL if dtype == torch.bfloat16 else OP_FP32_REL
    assert y.shape == (rows * k, 2 * i) and rel_err(y, ref) <= tol
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w1, w3], dy)
    want = torch.autograd.grad(ref, [x, w1, w3], dy)
    for g, w in zip(got, want):
        assert g.shape == w.shape and (rel_err(g, w) <= tol if w.norm() > 0 else g.norm() == 0)
    torch.library.opcheck(ops.grouped_mm_cat, (x, w1.transpose(1, 2), w3.transpose(1, 2), offs))
    torch.library.opcheck(ops.grouped_mm_cat_dx, (dy, w1.transpose(1, 2).detach(), w3.transpose(1, 2).detach(), offs))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("side_by_side", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_list_cat_vs_two_linears(side_by_side, dtype, transposed):
    """Sibling linears (SwiGLU w1|w3) as one op equal two grouped_mm_list calls, outputs and grads,
    whether the weights are separate tensors or side by side in one buffer (one GEMM)."""
    torch.manual_seed(3)
    t, k, e, h, i = 11, 2, 4, 8, 6
    ids = torch.randint(0, e, (t, k))
    ids[0] = e + 1  # a dropped pair
    _, _, offs = ops.route_permute(ids, e)
    x = torch.randn(t * k, h, dtype=dtype, requires_grad=True)
    buf = torch.randn(e, 2 * i, h, dtype=dtype)
    a = [torch.nn.Parameter(buf[j, :i].clone()) for j in range(e)]
    b = [torch.nn.Parameter(buf[j, i:].clone()) for j in range(e)]
    if side_by_side:
        for j in range(e):
            a[j].data, b[j].data = buf[j, :i], buf[j, i:]
    wa, wb = [w.t() for w in a], [w.t() for w in b]
    assert (ops.pair_view(wa, wb) is not None) == side_by_side
    assert (ops.pair_view(a, b, transposed=True) is not None) == side_by_side
    # transposed=True: the nn.Linear weights [N, K] themselves, as the lowering passes them
    args = (x, a, b, offs, True) if transposed else (x, wa, wb, offs)
    y = ops.grouped_mm_list_cat(*args)
    ref = torch.cat([ops.grouped_mm_list(x, wa, offs, []), ops.grouped_mm_list(x, wb, offs, [])], dim=1)
    tol = OP_BF16_REL if dtype == torch.bfloat16 else OP_FP32_REL
    assert rel_err(y, ref) <= tol
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *a, *b], dy)
    want = torch.autograd.grad(ref, [x, *a, *b], dy)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= tol
    torch.library.opcheck(ops.grouped_mm_list_cat, args)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_list_transposed(strided, bias, dtype):
    """grouped_mm_list(x, [W_e], ..., transposed=True) with nn.Linear weights W_e [N, K] equals the
    same op on the views [W_e.t()], outputs and every gradient (weights in their own layout), for
    separate weights and for weights that are evenly spaced views of one buffer (one 3-D GEMM)."""
    torch.manual_seed(4)
    t, k, e, h, n = 9, 2, 5, 7, 6
    ids = torch.randint(0, e, (t, k))
    ids[1, 0] = e  # a dropped pair
    ids[:, :] = torch.where(ids == 2, 3, ids)  # expert 2 gets no token
    _, _, offs = ops.route_permute(ids, e)
    x = torch.randn(t * k, h, dtype=dtype, requires_grad=True)
    buf = torch.randn(e, n, h, dtype=dtype)
    ws = [torch.nn.Parameter(buf[j].clone()) for j in range(e)]
    if strided:
        for j in range(e):
            ws[j].data = buf[j]
    assert (ops.strided_stack(ws) is not None) == strided
    bs = [torch.randn(n, dtype=dtype, requires_grad=True) for _ in range(e)] if bias else []
    y = ops.grouped_mm_list(x, ws, offs, bs, True)
    ref = ops.grouped_mm_list(x, [w.t() for w in ws], offs, bs)
    tol = OP_BF16_REL if dtype == torch.bfloat16 else OP_FP32_REL
    assert rel_err(y, ref) <= tol
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *ws, *bs], dy)
    want = torch.autograd.grad(ref, [x, *ws, *bs], dy)
    for g, w, v in zip(got, want, [x, *ws, *bs]):
        assert g.shape == v.shape and g.stride() == v.stride()
        assert rel_err(g, w) <= tol
    assert got[1 + 2].abs().sum() == 0  # expert 2 had no rows
    torch.library.opcheck(ops.grouped_mm_list, (x, ws, offs, bs, True))


def test_every_op_registered_on_import():
    """Importing the ops registers every op a compiled graph may call, also the backward-only ones:
    a warm Inductor cache loads compiled backward code in a new process without re-tracing it
    (found on the GPU: AttributeError for grouped_mm_wgrad_lowp on the second run)."""
    import subprocess
    import sys

    # a fresh interpreter that imports only ops.py, as lowering/moe_region.py does
    probe = ("import torch, moe_compile.kernels.ops\n"
             "for n in ('grouped_mm_wgrad_lowp', 'grouped_mm_list_cat_dx', 'unpermute_combine_backward',"
             " 'grouped_mm_wgrad', 'grouped_bias_grad', 'grouped_mm_list_cat', 'weighted_swiglu_backward',"
             " 'permute_scale_backward'):\n"
             "    getattr(torch.ops.moe_compile, n).default\n")
    subprocess.run([sys.executable, "-c", probe], check=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_swiglu_op_matches_silu_mul(dtype):
    """moe_compile.swiglu(h) == silu(h[:, :N]) * h[:, N:], output and input gradient (fp32 math,
    one rounding: bf16 within one rounding of the bf16 eager chain)."""
    gen = torch.Generator().manual_seed(11)
    h = (3 * torch.randn(37, 2 * 13, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    da = torch.randn(37, 13, generator=gen, dtype=torch.float64).to(dtype)
    a = ops.swiglu(h)
    hr = h.detach().double().requires_grad_()
    ref = torch.nn.functional.silu(hr[:, :13]) * hr[:, 13:]
    tol = {torch.float64: 1e-12, torch.float32: OP_FP32_REL, torch.bfloat16: OP_BF16_REL}[dtype]
    assert a.dtype == dtype and rel_err(a, ref) <= tol
    (g,) = torch.autograd.grad(a, h, da)
    (gr,) = torch.autograd.grad(ref, hr, da.double())
    assert g.dtype == dtype and rel_err(g, gr) <= tol
    if dtype != torch.bfloat16:
        torch.library.opcheck(ops.swiglu, (h,))
        torch.library.opcheck(ops.swiglu_backward, (h.detach(), da))
    with pytest.raises(ValueError, match="swiglu"):
        ops.swiglu(torch.randn(3, 5))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["random", "empty", "hot", "dropped"])
def test_weighted_swiglu_and_sum_match_the_weighted_combine(kind, dtype):
    """unpermute_sum(weighted_swiglu(h, w) @ W) == unpermute_combine(swiglu(h) @ W, w): the output and
    the gradients of h, W and the routing weights w (dropped pairs: 0), against an fp64 chain."""
    gen = torch.Generator().manual_seed(12)
    t, k, e, n, d = 9, 2, 5, 7, 6
    ids = _routing(t, k, e, kind, gen)
    perm, inv, offs = OPS.route_permute(ids, e)
    h = (2 * torch.randn(t * k, 2 * n, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    w = torch.rand(t, k, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    wd = torch.randn(e, n, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    cot = torch.randn(t, d, generator=gen, dtype=torch.float64).to(dtype)
    out = OPS.unpermute_sum(OPS.grouped_mm(OPS.weighted_swiglu(h, w, perm, offs), wd, offs), perm, inv, offs, k)
    got = torch.autograd.grad((out * cot).sum(), [h, w, wd])
    leaves = [v.detach().double().requires_grad_() for v in (h, w, wd)]
    ref_out = OPS.unpermute_combine(OPS.grouped_mm(ops.swiglu(leaves[0]), leaves[2], offs), inv, leaves[1], offs)
    ref = torch.autograd.grad((ref_out * cot.double()).sum(), leaves)
    # fp64 too: the GEMM and combine references accumulate in fp32
    tol = OP_BF16_CHAIN_REL if dtype == torch.bfloat16 else OP_FP32_REL
    assert out.dtype == dtype and rel_err(out, ref_out) <= tol
    for name, g, r in zip(("h", "weights", "W_down"), got, ref):
        assert g.dtype == dtype and rel_err(g, r) <= tol, name
    dropped = ~torch.isin(inv.view(t, k), torch.arange(int(offs[-1])))
    assert torch.all(got[1][dropped] == 0)
    if kind == "dropped":
        assert dropped.any()  # the case is exercised
    if dtype == torch.float64:
        torch.library.opcheck(OPS.weighted_swiglu.default, (h, w, perm, offs))
        torch.library.opcheck(OPS.unpermute_sum.default, (out.detach().repeat_interleave(k, 0), perm, inv, offs, k))
    with pytest.raises(ValueError, match="weighted_swiglu"):
        OPS.weighted_swiglu(h, w[:, :1], perm, offs)


def _quack_load_with(monkeypatch, modules: dict):
    """kernels._quack, reset to its first load, with these stand-in modules in sys.modules."""
    import sys

    from moe_compile.kernels import _quack

    monkeypatch.setattr(_quack, "_STATE", {})
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return _quack


def test_quack_missing_is_quiet(monkeypatch, recwarn):
    """Without the optional extra the weight gradient quietly keeps torch._grouped_mm: no warning,
    and the reason is there to ask for."""
    import importlib.util

    if importlib.util.find_spec("quack") is not None:
        pytest.skip("quack-kernels is installed here")
    q = _quack_load_with(monkeypatch, {})
    assert not q.available()
    assert "not installed" in q.why_not()
    assert not [w for w in recwarn if "quack" in str(w.message)]


@pytest.mark.parametrize("error", [ModuleNotFoundError("No module named 'cutlass.cutlass_dsl'", name="cutlass.cutlass_dsl"),
                                   RuntimeError("CUDA driver too old")])
def test_quack_broken_install_warns_once(monkeypatch, error):
    """An installed but broken quack (a cutlass-dsl it cannot import, as quack 0.6.5 with
    nvidia-cutlass-dsl 4.8.1 on the GPU image; any other import-time error) is said once, with the fix."""
    import types

    broken = types.ModuleType("quack.gemm_config")

    def fail(name):
        raise error

    broken.__getattr__ = fail  # `from quack.gemm_config import GemmConfig` raises inside the import
    q = _quack_load_with(monkeypatch, {"quack": types.ModuleType("quack"), "quack.gemm_config": broken})
    with pytest.warns(UserWarning, match=rf"quack-kernels failed to import: {type(error).__name__}.*moe_compile\[quack\]"):
        assert not q.available()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not q.available() and str(error) in q.why_not()  # tried once per process


def test_quack_static_schedule_only_where_balanced():
    """kernels/_quack.py: the static tile schedule is kept only where every expert's tile count is a
    multiple of the SM count (each SM then gets the same tiles of every expert, whatever the
    routing); elsewhere the weight gradient takes quack's dynamic scheduler."""
    from moe_compile.kernels import _quack

    assert _quack.tiles_per_expert(1536, 2048) == 12 * 11        # Qwen3-30B-A3B up, 128 x 192 tiles
    assert _quack.static_is_balanced(1536, 2048, 132)            # H100 / H200: one tile per SM per expert
    assert not _quack.static_is_balanced(2048, 768, 132)         # Qwen3 down: 64 tiles per expert
    assert not _quack.static_is_balanced(1536, 2048, 114)        # another SM count
    assert _quack.static_is_balanced(256, 384, 4) and not _quack.static_is_balanced(129, 192, 4)  # 4 vs 2 tiles


def test_dropped_pairs_are_never_read():
    check_dropped_pairs_unread("cpu")
