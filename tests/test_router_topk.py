"""moe_compile.router_topk: the op (CPU reference = torch.topk, its gradient) and the router_topk
pass, which swaps the topk calls of rewritten regions' routers for it and leaves every other topk.
``sorted=False`` calls are swapped only where no reader can see the order of the k entries: tests
run those with an op that returns each row's entries in a shuffled order (``shuffled_op``), which
torch.topk(sorted=False) may return too, so compiled code that matches eager does not depend on it.

The Triton kernel is tested against torch.topk on CUDA in tests/gpu/test_cuda_kernels.py."""
from __future__ import annotations

import pytest
import torch

import helpers
from graphs import rewrite, ops_in
from moe_compile.kernels import ops, registry
from moe_compile.passes import router_topk as router_topk_pass
from moe_compile.passes.normalize import canon
from moe_compile.pipeline import OPTIONAL_PASSES


@pytest.mark.parametrize("shape,k,dtype", [((5, 16), 3, torch.float32), ((2, 3, 8), 8, torch.float32),
                                           ((7, 64), 6, torch.bfloat16), ((0, 4), 1, torch.float32)])
def test_op_is_torch_topk_with_its_gradient(shape, k, dtype):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    v, i = ops.router_topk(x, k)
    rv, ri = torch.topk(x_ref, k, dim=-1)
    assert torch.equal(v, rv) and torch.equal(i, ri) and i.dtype == torch.long
    g = torch.randn(v.shape, dtype=dtype)
    v.backward(g)
    rv.backward(g)
    assert torch.equal(x.grad, x_ref.grad)


def test_opcheck():
    torch.library.opcheck(torch.ops.moe_compile.router_topk.default, (torch.randn(9, 32, requires_grad=True), 4))
    torch.library.opcheck(torch.ops.moe_compile.router_topk.default, (torch.randn(3, 2, 8), 2))


def test_bad_k_names_the_op_and_the_range():
    with pytest.raises(ValueError, match=r"router_topk.*k=9 must be in \[1, 8\]"):
        ops.router_topk(torch.randn(2, 8), 9)


def _topk_nodes(gm):
    return [n for n in gm.graph.nodes if canon(n) == "topk"]


@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax", "group_inplace", "sigmoid_group"])
def test_region_routers_use_the_op(router):
    """Every topk of a rewritten router becomes router_topk: one for softmax/top-k routers, three
    for a DeepSeek-V3-style group limit ([T, groups, E/groups] group scores, the group mask set by an
    in-place ``scatter_`` the walk must follow); ``sigmoid_group`` writes two of them ``sorted=False``,
    read only as a set (the group mask's scatter_, gather + sum-normalised weights, the region's ids).
    explain lists the op with the region."""
    spec = ("loop", "index_add", 2, router, "swiglu", None)
    new, records = rewrite(spec)
    assert [r.status for r in records] == ["rewritten"]
    assert ops_in(new).count("router_topk") == (3 if "group" in router else 1)
    assert not _topk_nodes(new), [n.format_node() for n in _topk_nodes(new)]
    assert "router_topk" in records[0].ops


def test_router_topk_pass_can_be_disabled():
    new, records = rewrite(("loop", "index_add", 2, "softmax_topk", "swiglu", None), disable=("router_topk",))
    assert "router_topk" not in ops_in(new) and len(_topk_nodes(new)) == 1
    assert records[0].status == "rewritten"


class _MoEAndSampler(torch.nn.Module):
    """A rewritten MoE layer, then a topk of the user's own (not a router): it must stay torch.topk."""

    def __init__(self):
        super().__init__()
        self.moe = helpers.make_model(spelling="index_add", k=2, e=4)

    def forward(self, x):
        y = self.moe(x)
        return y, torch.topk(y.sum(-1), 2, dim=-1).indices


def test_topk_outside_regions_is_left_alone():
    spec = ("fn", _MoEAndSampler(), (helpers.make_input((2, 5, 16), requires_grad=False),))
    new, records = rewrite(spec)
    assert [r.status for r in records] == ["rewritten"]
    assert ops_in(new).count("router_topk") == 1
    left = _topk_nodes(new)
    assert len(left) == 1 and "sum" in str(left[0].args[0]), [n.format_node() for n in left]


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_group"])
def test_compiled_matches_eager_with_the_op(router):
    """Outputs and every gradient (the router's included: it reaches the scores through the op's
    scatter backward) against eager, on fresh inputs too."""
    model = helpers.make_model(spelling="index_add", k=2, e=4, router=router)
    helpers.check_compiled(model, [helpers.make_input((2, 5, 16))], expect_rewritten=1)


# fp32 on CPU, one forward and backward per step: the fused ops add the same products in another order
BIAS_STEP_REL = 1e-5


def test_selection_bias_updated_in_place_between_steps_is_read():
    """Auxiliary-loss-free balancing (DeepSeek-V3) moves the selection bias buffer in place under no_grad
    between steps; the compiled graph must route with the new bias each step (no test wrote it before:
    review helper-120). One expert group, so that the bias changes routing (checked on eager)."""
    import copy

    import moe_compile

    torch._dynamo.reset()
    eager = helpers.make_model(spelling="index_add", e=4, k=2, router="sigmoid_group")
    eager.router.n_group = 1
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="moe")
    x = helpers.make_input((24, 16), requires_grad=False)
    assert len(moe_compile.explain(model, x).rewritten) == 1
    before = None
    for step, delta in enumerate(([0.0] * 4, [0.3, -0.3, 0.1, -0.1], [-0.5, 0.2, 0.4, 0.0], [0.0, 0.0, -0.6, 0.6])):
        for m in (eager, model):
            with torch.no_grad():
                m.router.sel_bias += torch.tensor(delta)
            m.zero_grad()
        want, got = eager(x), compiled(x)
        assert helpers.rel_err(got, want) <= BIAS_STEP_REL, (step, helpers.rel_err(got, want))
        if before is not None:   # the routing moved: a stale bias would show
            assert helpers.rel_err(want, before) > 0.1, step
        before = want.detach()
        want.pow(2).sum().backward()
        got.pow(2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert helpers.rel_err(p.grad, q.grad) <= BIAS_STEP_REL, (step, name)


@pytest.fixture
def shuffled_op(monkeypatch):
    """moe_compile.router_topk on CPU returns each row's k entries in a shuffled order (values and
    indices together): one torch.topk(sorted=False) may return, unlike CPU torch.topk, which
    returns them sorted. Only for routers whose every topk is read as a set (sorted ones too)."""
    def shuffled(scores, k):
        v, i = torch.topk(scores, k, dim=-1)
        order = torch.rand(v.shape, generator=torch.Generator().manual_seed(k)).argsort(-1)
        return v.gather(-1, order), i.gather(-1, order)

    monkeypatch.setitem(registry._IMPLS, ("router_topk", "cpu"), shuffled)
    x = torch.randn(64, 8)
    v, i = ops.router_topk(x, 2)
    assert torch.equal(i.sort(-1)[0], torch.topk(x, 2)[1].sort(-1)[0]) and not torch.equal(i, torch.topk(x, 2)[1])
    assert torch.equal(v, x.gather(-1, i))


# where a rewritten region reads its routing weights: weighted_swiglu (passes/weights_in_swiglu.py,
# on by default where the pipeline has it) or unpermute_combine (that pass disabled)
WEIGHTS_READ_BY = [pytest.param((), id="default"),
                   pytest.param(("weights_in_swiglu",), id="combine", marks=pytest.mark.skipif(
                       "weights_in_swiglu" not in OPTIONAL_PASSES, reason="no weights_in_swiglu pass"))]


@pytest.mark.parametrize("disable", WEIGHTS_READ_BY)
def test_hf_deepseek_v3_router(disable, shuffled_op):
    """transformers' DeepSeek-V3 router: its top-2 per group (sorted), top groups and top-k experts
    (both ``sorted=False``: a group mask's ``scatter_``; ids to the experts, ``gather``ed weights
    divided in place by their sum and scaled) all become the op. Compiled logits and every
    parameter gradient match eager with the op's entries shuffled."""
    pytest.importorskip("transformers")
    import test_hf_models as hf

    new, records = rewrite(("fn", hf.Logits(hf.build("deepseek_v3", layers=2)), (hf._ids(),)), disable=disable)
    assert [r.status for r in records] == ["rewritten"] * 2
    assert ops_in(new).count("router_topk") == 6 and not _topk_nodes(new), [n.format_node() for n in _topk_nodes(new)]
    helpers.check_compiled(hf.Logits(hf.build("deepseek_v3", layers=2)), [hf._ids()], expect_rewritten=2,
                           rel=helpers.HF_FP32_REL, grad_rel=helpers.HF_FP32_REL, fresh_inputs=1,
                           options={"moe.disable": disable})


def _gemm_free_router(self, x):
    logits = (x.unsqueeze(1) * self.proj.weight).sum(-1) + self.proj.bias
    w, ids = torch.topk(torch.softmax(logits, -1), self.k, dim=-1)
    return w, ids


class _TopkBeforeMoE(torch.nn.Module):
    """The user's own topk feeds the tokens of an MoE layer whose router has no GEMM to stop at."""

    def __init__(self):
        super().__init__()
        self.moe = helpers.make_model(spelling="index_add", k=2, e=4)
        self.moe.router.forward = _gemm_free_router.__get__(self.moe.router)

    def forward(self, x):
        v, _ = x.topk(4, dim=-1)
        return self.moe(x + v[..., :1])


def test_walk_stops_at_the_region_tokens():
    """The walk back from the expert ids ends at the tokens the region gathers: the user's topk
    that made them is not a router and stays torch.topk."""
    spec = ("fn", _TopkBeforeMoE(), (helpers.make_input((2, 5, 16), requires_grad=False),))
    new, records = rewrite(spec)
    assert [r.status for r in records] == ["rewritten"]
    assert ops_in(new).count("router_topk") == 1
    left = _topk_nodes(new)
    assert len(left) == 1 and left[0].args[1] == 4, [n.format_node() for n in left]


# routers of a LoopMoE(e=4, k=2) written with sorted=False calls (bound as its router's forward)
def _unsorted_softmax(self, x):        # softmax over the k values: a slot-by-slot op, in any order
    w, ids = torch.topk(self.proj(x), self.k, dim=-1, sorted=False)
    return torch.softmax(w, dim=-1), ids


def _first_slot_weight(self, x):       # weights relative to the first entry: reads a position
    w, ids = torch.topk(torch.softmax(self.proj(x), -1), self.k, dim=-1, sorted=False)
    return w / w[..., :1], ids


def _first_slot_top1(self, x):         # the first entry taken as the top-1 expert: reads a position
    w, ids = torch.topk(torch.softmax(self.proj(x), -1), self.k, dim=-1, sorted=False)
    return torch.where(ids == ids[:, :1], 2 * w, w), ids


def _ids_of_one_weights_of_another(self, x):   # two calls' orders paired as (expert id, weight)
    logits = self.proj(x)
    _, ids = torch.topk(logits, self.k, dim=-1, sorted=False)
    w, _ = torch.topk(torch.softmax(logits, -1), self.k, dim=-1, sorted=False)
    return w, ids


def _two_calls_mixed(self, x):         # slot j of one call's values times slot j of another's
    logits = self.proj(x)
    vb, ib = torch.topk(logits, self.k, dim=-1, sorted=False)
    near = torch.zeros_like(logits).scatter_(1, ib, 1.0)           # read as a set
    va, ids = torch.topk(logits + near, self.k, dim=-1, sorted=False)
    return torch.softmax(va * vb, dim=-1), ids


def _cumulative_weights(self, x):      # cumsum over the slots: an op not known to ignore the order
    w, ids = torch.topk(torch.softmax(self.proj(x), -1), self.k, dim=-1, sorted=False)
    return w.cumsum(-1) / w.sum(-1, keepdim=True), ids


def _sum_over_tokens(self, x):         # a reduction over the tokens: slot j of every row summed
    w, ids = torch.topk(torch.softmax(self.proj(x), -1), self.k, dim=-1, sorted=False)
    return w / w.sum(0, keepdim=True), ids


def _max_normalised(self, x):          # max(-1)'s backward picks the first of tied slots: order-dependent
    w, ids = torch.topk(torch.softmax(self.proj(x), -1), self.k, dim=-1, sorted=False)
    return w / w.max(-1, keepdim=True)[0], ids


def _axis_keyword_sum(self, x):        # sum(axis=0): over the tokens (a keyword, not "every dim")
    w, ids = torch.topk(torch.softmax(self.proj(x), -1), self.k, dim=-1, sorted=False)
    return w / w.sum(axis=0, keepdim=True)[..., :1], ids


def _sorted_first_slot_weight(self, x):  # sorted: weights relative to the first (largest) entry
    w, ids = torch.topk(torch.softmax(self.proj(x), -1), self.k, dim=-1)
    return w / w[..., :1], ids


def _sorted_first_slot_top1(self, x):    # sorted: the first entry's expert weighted twice
    w, ids = torch.topk(torch.softmax(self.proj(x), -1), self.k, dim=-1)
    return torch.where(ids == ids[:, :1], 2 * w, w), ids


def _tied_first_experts(model):
    """Router rows 0 and 1 equal (same weight and bias): experts 0 and 1 tie in every token's scores."""
    with torch.no_grad():
        model.router.proj.weight[1] = model.router.proj.weight[0]
        model.router.proj.bias[:2] = model.router.proj.bias[:2].max() + 10.0
    return model


_ROUTERS = {"max_normalised": _max_normalised, "axis_keyword_sum": _axis_keyword_sum,
            "unsorted_softmax": _unsorted_softmax, "first_slot_weight": _first_slot_weight,
            "first_slot_top1": _first_slot_top1, "ids_of_one_weights_of_another": _ids_of_one_weights_of_another,
            "two_calls_mixed": _two_calls_mixed, "cumulative_weights": _cumulative_weights,
            "sum_over_tokens": _sum_over_tokens, "sorted_first_slot_weight": _sorted_first_slot_weight,
            "sorted_first_slot_top1": _sorted_first_slot_top1}


def _with_router(forward):
    model = helpers.make_model(spelling="index_add", k=2, e=4)
    model.router.forward = forward.__get__(model.router)
    return model


def _deepseek_like():
    """helpers' sigmoid_group router over 8 experts in 4 groups, the top 2 groups kept: two
    sorted=False calls of k=2 (groups, then experts), as transformers' DeepSeek-V3 router."""
    model = helpers.make_model(spelling="index_add", k=2, e=8, router="sigmoid_group")
    model.router.n_group, model.router.topk_group = 4, 2
    return model


def _rewrite_with_router(forward):
    new, records = rewrite(("fn", _with_router(forward), (helpers.make_input((2, 5, 16), requires_grad=False),)))
    assert [r.status for r in records] == ["rewritten"]
    return new


@pytest.mark.parametrize("disable", WEIGHTS_READ_BY)
@pytest.mark.parametrize("build,swapped", [pytest.param(_deepseek_like, 3, id="deepseek_like"),
                                           pytest.param(lambda: _with_router(_unsorted_softmax), 1,
                                                        id="unsorted_softmax")])
def test_unsorted_calls_read_as_a_set_match_eager(build, swapped, disable, shuffled_op):
    """Every topk swapped (DeepSeek-V3-like: the sorted top-2 per group, the top groups read by a
    mask's scatter_, the top experts; a softmax over the unsorted top-k values); outputs and every
    gradient against eager with the op's entries shuffled, on fresh inputs too."""
    new, _ = rewrite(("fn", build(), (helpers.make_input((2, 5, 16), requires_grad=False),)), disable=disable)
    assert ops_in(new).count("router_topk") == swapped and not _topk_nodes(new)
    helpers.check_compiled(build(), [helpers.make_input((2, 5, 16))], expect_rewritten=1,
                           options={"moe.disable": disable})


@pytest.mark.parametrize("router,kept,routers", [("first_slot_weight", 1, 1), ("first_slot_top1", 1, 1),
                                                  ("ids_of_one_weights_of_another", 2, 1), ("two_calls_mixed", 2, 2),
                                                  ("cumulative_weights", 1, 1), ("sum_over_tokens", 1, 1),
                                                  ("max_normalised", 1, 1), ("axis_keyword_sum", 1, 1)])
def test_unsorted_calls_whose_order_is_read_stay_torch_topk(router, kept, routers, monkeypatch):
    """A sorted=False topk whose order a reader can see stays torch.topk: a position read
    (``w[..., :1]``, ``ids[:, :1]`` as the top-1 expert), a region pairing one call's ids with another
    call's weights, slot j of two calls multiplied, a cumsum over the slots, a sum over the tokens
    (also as ``sum(axis=0)``), a ``max(-1)`` (its gradient goes to the first of tied slots). ``routers`` of them are
    routers of the region: the analysis forced to accept swaps exactly those (so it is what keeps them)."""
    new = _rewrite_with_router(_ROUTERS[router])
    assert ops_in(new).count("router_topk") == 0
    left = _topk_nodes(new)
    assert len(left) == kept and all(n.kwargs.get("sorted") is False for n in left), [n.format_node() for n in left]
    monkeypatch.setattr(router_topk_pass, "_readers_see_no_order", lambda *a: True)
    assert ops_in(_rewrite_with_router(_ROUTERS[router])).count("router_topk") == routers


@pytest.mark.parametrize("router,tied", [("first_slot_weight", False), ("axis_keyword_sum", False),
                                         ("max_normalised", True)])
def test_the_shuffled_op_catches_a_wrong_swap(router, tied, shuffled_op, monkeypatch):
    """The compiled-vs-eager tests above can fail: an order-reading router swapped anyway (the
    analysis forced to accept) no longer matches eager (max(-1): only its gradient, with tied slots)."""
    monkeypatch.setattr(router_topk_pass, "_readers_see_no_order", lambda *a: True)
    assert ops_in(_rewrite_with_router(_ROUTERS[router])).count("router_topk") == 1
    model = _with_router(_ROUTERS[router])
    with pytest.raises(AssertionError, match="output|grad"):
        helpers.check_compiled(_tied_first_experts(model) if tied else model, [helpers.make_input((2, 5, 16))],
                               expect_rewritten=1)


@pytest.fixture
def ties_reversed_op(monkeypatch):
    """moe_compile.router_topk on CPU returns the entries of torch.topk with each run of tied values in
    the reverse order (on an H200, torch.topk's CUDA kernel returned tied experts 1, 0 where the
    Triton op returns 0, 1). Values and the order of unequal entries unchanged."""
    def reversed_ties(scores, k):
        v, i = (t.flip(-1) for t in torch.topk(scores, k, dim=-1))
        order = torch.sort(v, dim=-1, descending=True, stable=True).indices
        return v.gather(-1, order), i.gather(-1, order)

    monkeypatch.setitem(registry._IMPLS, ("router_topk", "cpu"), reversed_ties)
    x = torch.tensor([[0.0, 3.0, 3.0, 1.0, 3.0]])
    assert ops.router_topk(x, 4)[1].tolist() == torch.topk(x, 4)[1][:, [2, 1, 0, 3]].tolist()


@pytest.mark.parametrize("router", ["sorted_first_slot_weight", "sorted_first_slot_top1"])
def test_sorted_calls_whose_order_is_read_stay_torch_topk(router, ties_reversed_op, monkeypatch):
    """A sorted topk fixes the order only up to ties, and tied entries come out in torch's own order:
    a position read (``w[..., :1]``, ``ids[:, :1]``) keeps torch.topk, and the compiled model matches
    eager with experts 0 and 1 tied on every token. Forced to swap, it does not (the order of the
    tied pair reversed): the test can fail."""
    new = _rewrite_with_router(_ROUTERS[router])
    assert ops_in(new).count("router_topk") == 0 and len(_topk_nodes(new)) == 1
    x = helpers.make_input((2, 5, 16))
    helpers.check_compiled(_tied_first_experts(_with_router(_ROUTERS[router])), [x], expect_rewritten=1)
    monkeypatch.setattr(router_topk_pass, "_readers_see_no_order", lambda *a: True)
    assert ops_in(_rewrite_with_router(_ROUTERS[router])).count("router_topk") == 1
    with pytest.raises(AssertionError, match="output|grad"):
        helpers.check_compiled(_tied_first_experts(_with_router(_ROUTERS[router])), [x], expect_rewritten=1)


class _UnsortedIdsOut(torch.nn.Module):
    """A DeepSeek-V3-like MoE layer (``_deepseek_like``) that also returns its router's expert ids
    (a graph output: the caller may read their order)."""

    def __init__(self):
        super().__init__()
        self.moe = _deepseek_like()

    def forward(self, x):
        x = x.reshape(-1, 16)
        w, ids = self.moe.router(x)
        out = torch.zeros_like(x)
        for i in range(self.moe.e):
            tok, slot = torch.where(ids == i)
            out.index_add_(0, tok, self.moe.experts.fwd(i, x[tok]) * w[tok, slot].unsqueeze(-1))
        return out, ids


def test_unsorted_ids_returned_stay_torch_topk():
    """The expert ids' sorted=False call reaches a graph output: kept. The same router's top-group
    call (read by the group mask's scatter_ only) and its sorted top-2 per group become the op."""
    spec = ("fn", _UnsortedIdsOut(), (helpers.make_input((2, 5, 16), requires_grad=False),))
    new, records = rewrite(spec)
    assert [r.status for r in records] == ["rewritten"]
    assert ops_in(new).count("router_topk") == 2
    left = _topk_nodes(new)
    assert len(left) == 1 and left[0].kwargs.get("sorted") is False and canon(left[0].args[0]) == "masked_fill", \
        [n.format_node() for n in left]


class _ScaledInputRows(torch.nn.Module):
    """torchtitan's score_before_experts: the routing weights scale the expert input rows in fp32
    (lowered to ``permute_scale``), ids of a ``sorted=False`` topk, weights ``weights``: "gather"
    (``scores.gather(1, ids)``: slots of the ids' call), "other_call" (the values of a second
    ``sorted=False`` topk), "constant" (one weight per slot position)."""

    def __init__(self, weights, h=16, i=24, e=8, k=3):
        super().__init__()
        self.gate = torch.nn.Linear(h, e, bias=False)
        self.w1, self.w3 = (torch.nn.Parameter(torch.randn(e, i, h) / h ** 0.5) for _ in range(2))
        self.w2 = torch.nn.Parameter(torch.randn(e, h, i) / i ** 0.5)
        self.weights, self.e, self.k = weights, e, k

    def forward(self, x):
        import transformers.integrations.moe  # noqa: F401  (torch.ops.transformers.grouped_mm_fallback)

        gmm = torch.ops.transformers.grouped_mm_fallback
        x = x.reshape(-1, x.shape[-1])
        logits = self.gate(x)
        scores = torch.softmax(logits, dim=1)
        _, ids = torch.topk(logits, self.k, dim=1, sorted=False)
        if self.weights == "gather":
            w = scores.gather(1, ids)
        elif self.weights == "other_call":
            w = torch.topk(scores, self.k, dim=1, sorted=False)[0]
        else:
            w = torch.linspace(0.6, 0.1, self.k).expand(x.shape[0], self.k)
        order = torch.argsort(ids.view(-1), stable=True)
        offs = torch.cumsum(torch.histc(ids.view(-1).float(), bins=self.e, min=0, max=self.e), 0, dtype=torch.int32)
        tok = order // self.k
        rows = (x[tok].float() * w.reshape(-1)[order].reshape(-1, 1)).to(x.dtype)
        h = torch.nn.functional.silu(gmm(rows, self.w1.transpose(1, 2), offs=offs)) * gmm(rows, self.w3.transpose(1, 2), offs=offs)
        return torch.zeros_like(x).index_add(0, tok, gmm(h, self.w2.transpose(1, 2), offs=offs))


@pytest.mark.parametrize("weights,swapped", [("gather", 1), ("other_call", 0), ("constant", 0)])
def test_input_scaled_rows_pair_the_weights_read_by_permute_scale(weights, swapped, shuffled_op, monkeypatch):
    """permute_scale reads the routing weights pair by pair: ids of a sorted=False call paired with weights
    that are not slots of that call (another call's values, per-position constants) keep torch.topk.
    Found by review: permute_scale was missing from the walk's pair readers, the ids' call was swapped and
    its ids reordered, the weights not: 0.6-0.9 off. Weights gathered by the ids are still swapped; forced
    to swap, the constant weights no longer match eager (the test can fail)."""
    x = helpers.make_input((2, 8, 16), requires_grad=False)
    new, records = rewrite(("fn", _ScaledInputRows(weights), (x,)))
    assert [r.status for r in records] == ["rewritten"] and "permute_scale" in ops_in(new), ops_in(new)
    assert ops_in(new).count("router_topk") == swapped, ops_in(new)
    torch.manual_seed(26)
    helpers.check_compiled(_ScaledInputRows(weights), [helpers.make_input((2, 8, 16))], expect_rewritten=1)
    if weights == "constant":
        monkeypatch.setattr(router_topk_pass, "_readers_see_no_order", lambda *a: True)
        torch.manual_seed(26)
        with pytest.raises(AssertionError, match="output|grad"):
            helpers.check_compiled(_ScaledInputRows(weights), [helpers.make_input((2, 8, 16))], expect_rewritten=1)


def _titan(kind):
    from test_titan_forms import TitanDSv3, TitanMoE

    torch.manual_seed(5)
    return {"histc_first": lambda: TitanMoE(counts="histc_first"), "histc_after": lambda: TitanMoE(counts="histc_after"),
            "histc_unsort": lambda: TitanMoE(counts="histc_after", combine="unsort", score_before=True),
            "dsv3": lambda: TitanDSv3()}[kind]()


@pytest.mark.parametrize("disable", WEIGHTS_READ_BY)
@pytest.mark.parametrize("kind,swapped", [("histc_first", 1), ("histc_after", 1), ("histc_unsort", 1), ("dsv3", 3)])
def test_torchtitan_routers_counting_their_ids_use_the_op(kind, swapped, disable, shuffled_op):
    """torchtitan counts the router's ids with ``histc`` (into ``tokens_per_expert`` too; ``bincount`` is
    read the same way, but breaks Dynamo's default capture): counts over every entry, the same for every order, which the walk took for a reader that may see the
    order, so its routers kept torch.topk (review helper-65; DeepSeek-V3's last ``sorted=False`` call too).
    Now swapped; outputs and every gradient against eager with the op's entries shuffled."""
    x = helpers.make_input((2, 5, 32), requires_grad=False)
    new, _ = rewrite(("fn", _titan(kind), (x,)), disable=disable)
    assert ops_in(new).count("router_topk") == swapped and not _topk_nodes(new), ops_in(new)
    helpers.check_compiled(_titan(kind), [helpers.make_input((2, 5, 32))], expect_rewritten=1,
                           options={"moe.disable": disable})
