"""Non-loop MoE forms written as plain PyTorch (passes/grouped_regions.py): sorted/grouped_mm,
batched (gathered weights + bmm) and dense (every token through every expert + routing matrix).

Each case runs eager vs backend="moe" (outputs and every gradient) and asserts the backend's
counters, so a rewrite that silently did not fire fails. Legend: T tokens, K top-k, E experts,
H width, I expert width.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)
import moe_compile
from helpers import DENSE_BF16_GRAD_REL, DENSE_BF16_REL, Router, check_compiled, make_input



class Experts3D(nn.Module):
    """Stacked SwiGLU experts, HF layout: gate_up [E, 2I, H], down [E, H, I] (+ biases)."""

    def __init__(self, h, i, e, bias=False):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(e, 2 * i, h) / math.sqrt(h))
        self.down = nn.Parameter(torch.randn(e, h, i) / math.sqrt(i))
        self.gate_up_b = nn.Parameter(torch.randn(e, 2 * i) * 0.1) if bias else None
        self.down_b = nn.Parameter(torch.randn(e, h) * 0.1) if bias else None


def _gmm(x, w, offs):
    """fp32: HF's fallback custom op (torch._grouped_mm compiles in bf16 only); bf16: F.grouped_mm."""
    if w.dtype == torch.bfloat16:
        return F.grouped_mm(x, w, offs=offs)
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs)


class SortedMoE(nn.Module):
    """sort -> gather -> grouped_mm -> unsort, in several spellings.

    counts: histc | one_hot | bincount;  combine: inv (inv[perm] = arange) | argsort | index_add | scatter_add(_none);
    weigh: "sorted" (before unsort) | "view" (on the [T, K, H] view, only with inv/argsort);
    key: what is sorted: "ids" (flattened token-major) | "stacked" (the same ids rebuilt by a stack) |
    "times2" (ids * 2: the same order) | "kmajor" (``ids.t().reshape(-1)``, slot-major, while rows are
    still gathered with perm // K)."""

    def __init__(self, h=16, i=16, e=4, k=2, router="softmax_topk", routing="random", bias=False,
                 counts="histc", combine="inv", weigh="sorted", sort="sort", sentinel=False, key="ids"):
        super().__init__()
        self.key = key
        self.h, self.e, self.k, self.counts, self.combine, self.weigh, self.sort = h, e, k, counts, combine, weigh, sort
        self.sentinel = sentinel  # transformers <= 5.17 (the GPU image) masks EP sentinels unconditionally
        self.router = Router(h, e, k, router, routing)
        self.experts = Experts3D(h, i, e, bias)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, self.h)
        t = x.shape[0]
        w, ids = self.router(x)
        k = ids.shape[-1] if ids.dim() == 2 else 1
        flat, fw = ids.reshape(-1), w.reshape(-1)
        if self.key == "stacked":   # the same ids, rebuilt (PhiMoE's sparsemixer cats two argmaxes)
            flat = torch.stack([ids[:, j] for j in range(k)], -1).reshape(-1)
        if self.key in ("times2", "kmajor"):
            _, perm = torch.sort(flat * 2 if self.key == "times2" else ids.t().reshape(-1))
            ids_g = flat[perm]
        elif self.key == "cast":    # sorted as a cast copy, the sorted values read from the ids themselves
            perm = torch.argsort(ids.long().contiguous().view(-1), stable=True)
            ids_g = flat[perm]
        elif self.sort == "sort":
            ids_g, perm = torch.sort(flat)
        else:
            perm = torch.argsort(flat, stable=True)
            ids_g = flat[perm]
        xs = x[perm // k] if self.sort == "sort" else x.index_select(0, perm // k)
        if self.counts == "histc":
            cnt = torch.histc(ids_g.float(), bins=self.e, min=0, max=self.e - 1)
        elif self.counts == "bincount":
            cnt = torch.bincount(flat, minlength=self.e)
        else:
            cnt = F.one_hot(flat, self.e).sum(0)
        offs = torch.cumsum(cnt, dim=0, dtype=torch.int32)
        ex = self.experts
        if self.sentinel:  # ids >= E would be other ranks' experts: zero their rows
            mask = (ids_g >= self.e).unsqueeze(-1)
            ids_g.clamp_(max=self.e - 1)
            xs.masked_fill_(mask, 0.0)
        h = _gmm(xs.to(ex.gate_up.dtype), ex.gate_up.transpose(-2, -1), offs)
        if ex.gate_up_b is not None:
            h.add_(ex.gate_up_b[ids_g])
        if self.sentinel:
            h = h.masked_fill(mask, 0.0)
        g, u = h.chunk(2, dim=-1)
        h = _gmm(F.silu(g) * u, ex.down.transpose(-2, -1), offs)
        if ex.down_b is not None:
            h = h + ex.down_b[ids_g]
        if self.sentinel:
            h = h.masked_fill(mask, 0.0)
        if self.weigh == "sorted":
            h = h * fw[perm].unsqueeze(-1)
        elif self.weigh == "sorted_none":   # the column spelled fw[perm, None] (helper-102: refused)
            h = h * fw[perm, None]
        elif self.weigh == "sorted_twice":  # sw = fw[perm]; sw[perm, None]: permuted twice (helper-106: taken as sw)
            h = h * fw[perm][perm, None]
        if self.combine == "buffer_like":   # the unsort buffer made by zeros_like (helper-102: refused)
            buf = torch.zeros_like(h)
            buf[perm] = h
            y = buf.view(t, k, self.h)
            out = (y * w.reshape(t, k).unsqueeze(-1) if self.weigh == "view" else y).sum(dim=1)
        elif self.combine in ("inv", "argsort"):
            if self.combine == "inv":
                inv = torch.empty_like(perm)
                inv[perm] = torch.arange(perm.size(0))
            else:
                inv = torch.argsort(perm)
            y = h[inv].view(t, k, self.h)
            if self.weigh == "view":
                y = y * w.reshape(t, k).unsqueeze(-1)
            out = y.sum(dim=1)
        elif self.combine == "index_add":
            out = torch.zeros_like(x).index_add_(0, perm // k, h.to(x.dtype))
        elif self.combine == "scatter_add":
            out = torch.zeros_like(x).scatter_add_(0, (perm // k).unsqueeze(-1).expand(-1, self.h), h.to(x.dtype))
        else:   # "scatter_add_none": the column index spelled (perm // k)[:, None] (review helper-69: refused)
            out = torch.zeros_like(x).scatter_add_(0, (perm // k)[:, None].expand(-1, self.h), h.to(x.dtype))
        return out.to(x.dtype).view(shape)


class BatchedMoE(nn.Module):
    """HF batched_mm: repeat_interleave tokens, gather per-pair weights W[ids], bmm, sum over top-k;
    ``index=True`` spells the unsqueezes as indexing (``hs[..., None]``, ``a[:, None]``)."""

    def __init__(self, h=16, i=12, e=4, k=2, router="softmax_topk", routing="random", bias=False, index=False):
        super().__init__()
        self.h, self.k, self.index = h, k, index
        self.router = Router(h, e, k, router, routing)
        self.experts = Experts3D(h, i, e, bias)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, self.h)
        t = x.shape[0]
        w, ids = self.router(x)
        ex, flat = self.experts, ids.reshape(-1)
        hs = x.repeat_interleave(self.k, dim=0)
        h = torch.bmm(ex.gate_up[flat], hs[..., None] if self.index else hs.unsqueeze(-1)).squeeze(-1)
        if ex.gate_up_b is not None:
            h.add_(ex.gate_up_b[flat])
        g, u = h.chunk(2, dim=-1)
        a = F.silu(g) * u
        h = torch.bmm(a[:, None] if self.index else a.unsqueeze(1), ex.down[flat].transpose(1, 2)).squeeze(1)
        if ex.down_b is not None:
            h.add_(ex.down_b[flat])
        h = h * w.reshape(-1).unsqueeze(-1)
        return h.view(t, self.k, self.h).sum(dim=1).to(x.dtype).view(shape)


class DenseMoE(nn.Module):
    """Every token through every expert (bmm on 3-D weights), combined by a [T, E] routing matrix:
    sparse top-k (zeros.scatter(1, ids, w)), or ``soft`` (a full softmax: must be refused), or
    ``sampled`` (ids drawn with replacement: a row may name an expert twice, and scatter keeps one of
    the two weights, so a routed rewrite that adds both would be wrong: must be refused); ``matrix``
    spells the sparse one another way: "scatter_add", "renorm" (divided by its row sums after the scatter),
    "threshold" (the softmax where the scores reach the k-th largest), or is soft another way:
    "shifted_softmax" (exp(z - max z) / sum: a max that selects nothing)."""

    def __init__(self, h=16, i=12, e=4, k=2, router="softmax_topk", routing="random", soft=False, sampled=False,
                 matrix="scatter"):
        super().__init__()
        self.h, self.e, self.soft, self.sampled, self.matrix = h, e, soft, sampled, matrix
        self.router = Router(h, e, k, router, routing)
        self.experts = Experts3D(h, i, e)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, self.h)
        t = x.shape[0]
        if self.soft:
            routing = F.softmax(self.router.proj(x), dim=-1).to(x.dtype)
        elif self.sampled:
            probs = F.softmax(self.router.proj(x), dim=-1)
            ids = torch.multinomial(probs, 2, replacement=True)
            routing = torch.zeros(t, self.e, dtype=x.dtype).scatter(1, ids, probs.gather(1, ids))
        elif self.matrix == "one_hot_einsum":
            w, ids = self.router(x)
            routing = torch.einsum("tke,tk->te", F.one_hot(ids, self.e).to(x.dtype), w.to(x.dtype))
        elif self.matrix in ("threshold", "threshold_amax", "threshold_max_kw", "shifted_softmax"):
            z = self.router.proj(x)
            if self.matrix == "threshold":
                routing = torch.where(z >= z.topk(2, -1).values[:, -1:], F.softmax(z, -1), 0.0).to(x.dtype)
            elif self.matrix == "threshold_amax":     # hard top-1
                p = F.softmax(z, -1)
                routing = (p * (p == p.amax(-1, keepdim=True))).to(x.dtype)
            elif self.matrix == "threshold_max_kw":
                routing = torch.where(z >= z.max(dim=-1, keepdim=True).values, F.softmax(z, -1), 0.0).to(x.dtype)
            else:
                z = (z - z.max(-1, keepdim=True).values).exp()
                routing = (z / z.sum(-1, keepdim=True)).to(x.dtype)
        elif self.matrix == "scatter_add":
            w, ids = self.router(x)
            routing = torch.zeros(t, self.e, dtype=x.dtype).scatter_add(1, ids, w.to(x.dtype))
        else:
            w, ids = self.router(x)
            routing = torch.zeros(t, self.e, dtype=x.dtype).scatter(1, ids, w.to(x.dtype))
            if self.matrix == "renorm":
                routing = routing / routing.sum(-1, keepdim=True)
        xe = x.unsqueeze(0).expand(self.e, t, self.h)
        h = torch.bmm(xe, self.experts.gate_up.transpose(1, 2))
        g, u = h.chunk(2, dim=-1)
        y = torch.bmm(F.silu(g) * u, self.experts.down.transpose(1, 2))
        return (y * routing.t().unsqueeze(-1)).sum(dim=0).view(shape)


def _run(cls, dtype=torch.float32, shape=(2, 8, 16), expect=1, refused=0, rel=None, grad_rel=None, seed=None, **kw):
    torch.manual_seed(0)
    model = cls(h=shape[-1], **kw).to(dtype)
    x = make_input(shape, dtype)
    return check_compiled(model, [x], expect_rewritten=expect, expect_refused=refused, rel=rel, grad_rel=grad_rel,
                          seed=seed)


SORTED_SPELLINGS = [
    dict(),                                                    # HF grouped_mm_experts_forward
    dict(counts="one_hot", combine="argsort", weigh="view", sort="argsort"),
    dict(combine="index_add"),
    dict(combine="scatter_add", bias=True),                    # torchtitan-style scatter back
    dict(combine="scatter_add_none"),                          # its index as (perm // k)[:, None]
    dict(bias=True),                                           # GPT-OSS-style per-expert biases
    dict(sentinel=True),                                       # transformers 5.17: EP sentinel masks
    dict(sentinel=True, bias=True),
    dict(key="stacked"),                                       # ids rebuilt from their columns (PhiMoE)
    dict(key="cast"),                                          # the key a cast copy of the ids
    dict(combine="buffer_like", weigh="view"),                 # buf = zeros_like(rows); buf[perm] = rows
    dict(combine="buffer_like", weigh="sorted_none"),
    dict(combine="index_add", weigh="sorted_none"),
    dict(combine="index_add", weigh="sorted_twice"),
]


@pytest.mark.parametrize("kw", SORTED_SPELLINGS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()) or "hf")
def test_sorted_spellings(kw):
    _run(SortedMoE, **kw)


@pytest.mark.parametrize("key, how", [("times2", "a value computed from the ids (`mul`)"),
                                      ("kmajor", "the ids transposed (K-major")])
def test_sorted_by_a_key_that_is_not_the_ids_is_refused_with_that_reason(key, how):
    """Was "the router has top_k 1" (ids * 2) or "top_k 16" (K-major): the sort key is named instead.
    bf16 (F.grouped_mm): the unrewritten fp32 graph needs transformers' fallback op, whose backward
    does not compile on every torch / transformers pair (torch 2.11 with transformers 5.17)."""
    _run(SortedMoE, torch.bfloat16, expect=0, refused=1, key=key)
    rep = moe_compile.explain(SortedMoE(key=key).to(torch.bfloat16), make_input((2, 8, 16), torch.bfloat16))
    assert [r.code for r in rep.refused] == ["sort_key"] and how in rep.refused[0].reason, str(rep)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["empty", "hot"])
def test_sorted_routing_and_dtype(dtype, routing):
    _run(SortedMoE, dtype, routing=routing)


@pytest.mark.parametrize("router", ["argmax", "argmax_flat"])
def test_sorted_top1(router):
    _run(SortedMoE, shape=(8, 16), k=1, router=router)


class _Grouped(nn.Module):
    """SortedMoE with counts by bincount under names that say nothing of MoE (class, function, lines)."""

    def __init__(self, h=16, i=16, e=4, k=2):
        super().__init__()
        self.e, self.k = e, k
        self.router = Router(h, e, k)
        self.w_in = nn.Parameter(torch.randn(e, 2 * i, h) / math.sqrt(h))
        self.w_out = nn.Parameter(torch.randn(e, h, i) / math.sqrt(i))

    def forward(self, x):
        w, ids = self.router(x)
        flat = ids.reshape(-1)
        order = torch.sort(flat)[1]
        offs = torch.cumsum(torch.bincount(flat, minlength=self.e), dim=0, dtype=torch.int32)
        g, u = _gmm(x[order // self.k], self.w_in.transpose(-2, -1), offs).chunk(2, dim=-1)
        y = _gmm(F.silu(g) * u, self.w_out.transpose(-2, -1), offs) * w.reshape(-1)[order].unsqueeze(-1)
        return y[torch.argsort(order)].view(x.shape[0], self.k, -1).sum(1)


def test_sorted_form_with_bincount_counts_through_the_fp32_fallback_is_listed():
    """fp32 (transformers' grouped_mm_fallback, in a helper function) with counts by bincount: Dynamo breaks
    the graph at the fallback op (bincount's length is data-dependent), in a frame whose router is a module
    call and whose names say nothing of MoE: explain() listed nothing (review helper-76). Listed as
    break_bincount with its fix; bf16 (F.grouped_mm takes the counts as they are) is rewritten."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    rep = moe_compile.explain(_Grouped(), make_input((16, 16)))
    assert [b.reason_code for b in rep.graph_breaks] == ["break_bincount"] and "histc" in rep.graph_breaks[0].fix, \
        str(rep)
    _run(_Grouped, torch.bfloat16, shape=(16, 16))


@pytest.mark.parametrize("router", ["sort_slice", "topk_plus1"])
def test_sorted_form_of_a_sliced_router(router):
    """Ids that are the first K of a sort of the scores, or of a top-(K + 1): the router's (was unmatched)."""
    _run(SortedMoE, router=router)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_batched(dtype, bias):
    low = dtype == torch.bfloat16
    _run(BatchedMoE, dtype, bias=bias, rel=DENSE_BF16_REL if low else None,
         grad_rel=DENSE_BF16_GRAD_REL if low else None)


def test_batched_unsqueeze_spelled_as_index():
    """``x[..., None]`` / ``x[:, None]`` for the unsqueezes: was moe_unmatched, now rewritten."""
    _run(BatchedMoE, index=True, bias=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["random", "hot"])
def test_dense(dtype, routing):
    low = dtype == torch.bfloat16
    _run(DenseMoE, dtype, routing=routing, rel=DENSE_BF16_REL if low else None,
         grad_rel=DENSE_BF16_GRAD_REL if low else None)


def test_dense_soft_moe_is_refused_with_reason():
    from moe_compile import explain

    torch.manual_seed(0)
    model = DenseMoE(soft=True)
    _run(DenseMoE, expect=0, refused=1, soft=True)
    rep = explain(model, make_input((2, 8, 16)))
    assert len(rep.refused) == 1 and "soft MoE" in rep.refused[0].reason, str(rep)


@pytest.mark.parametrize("matrix", ["scatter_add", "renorm", "threshold", "threshold_amax", "threshold_max_kw",
                                    "one_hot_einsum"])
def test_dense_with_another_top_k_routing_matrix_is_refused_with_that_reason(matrix):
    """Was "soft MoE: every expert contributes to every token": the matrix comes from the top-k ids."""
    _run(DenseMoE, expect=0, refused=1, matrix=matrix)
    rep = moe_compile.explain(DenseMoE(matrix=matrix), make_input((2, 8, 16)))
    assert [r.code for r in rep.refused] == ["routing_matrix_form"], str(rep)
    assert "soft MoE" not in rep.refused[0].reason and "zeros(T, E).scatter(1, ids, w)" in rep.refused[0].fix


def test_dense_soft_matrix_with_a_max_is_soft_moe():
    """A softmax written out (exp(z - max z)) is soft: its max selects no expert. Was reported as a top-k
    routing matrix in another spelling."""
    _run(DenseMoE, expect=0, refused=1, matrix="shifted_softmax")
    rep = moe_compile.explain(DenseMoE(matrix="shifted_softmax"), make_input((2, 8, 16)))
    assert [r.code for r in rep.refused] == ["soft_moe"], str(rep)


class _SparseThenSoft(nn.Module):
    """A sparse dense-form layer, then a soft one reading its output: the soft layer's matrix is
    computed after the first layer's top-k, which is not its own."""

    def __init__(self):
        super().__init__()
        self.sparse, self.soft = DenseMoE(), DenseMoE(soft=True)

    def forward(self, x):
        x = x + self.sparse(x)
        return x + self.soft(x)


def test_dense_soft_layer_after_a_sparse_layer_is_soft_moe():
    """Was routing_matrix_form: the walk from the soft matrix reached the previous layer's top-k."""
    torch.manual_seed(0)
    check_compiled(_SparseThenSoft(), [make_input((2, 8, 16))], expect_rewritten=1, expect_refused=1)
    rep = moe_compile.explain(_SparseThenSoft(), make_input((2, 8, 16)))
    assert [r.code for r in rep.refused] == ["soft_moe"], str(rep)


def test_dense_with_ids_that_may_repeat_is_refused():
    """Sampled with replacement (2 draws from 4 experts over 16 tokens: repeats are near certain):
    the scatter keeps one weight per repeated expert, so only the unrewritten graph is right."""
    from moe_compile import explain

    torch.manual_seed(0)
    _run(DenseMoE, expect=0, refused=1, sampled=True, seed=3)
    torch.manual_seed(3)
    rep = explain(DenseMoE(sampled=True), make_input((2, 8, 16)))
    assert len(rep.refused) == 1 and rep.refused[0].code == "ids_may_repeat", str(rep)


@pytest.mark.parametrize("form", [SortedMoE, BatchedMoE, DenseMoE], ids=lambda c: c.__name__)
def test_zero_tokens(form):
    """An MoE block called on zero tokens works compiled as in eager, forward and backward."""
    torch.manual_seed(0)
    check_compiled(form(h=16), [make_input((0, 16))], expect_rewritten=1, fresh_inputs=0)


@settings(max_examples=4, deadline=None)
@given(t=st.integers(1, 12), e=st.sampled_from([2, 3, 5]), k=st.integers(1, 2),
       form=st.sampled_from([SortedMoE, BatchedMoE, DenseMoE]))
def test_shapes_hypothesis(t, e, k, form):
    _run(form, shape=(t, 8), e=e, k=min(k, e), i=6)
