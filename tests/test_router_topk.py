"""moe_compile.router_topk: the op (CPU reference = torch.topk, its gradient) and the router_topk
pass, which swaps the topk calls of rewritten regions' routers for it and leaves every other topk.

The Triton kernel is tested against torch.topk on CUDA in tests/gpu/test_cuda_kernels.py."""
from __future__ import annotations

import pytest
import torch

import helpers
from graphs import rewrite, ops_in
from moe_compile.kernels import ops
from moe_compile.passes.normalize import canon


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


@pytest.mark.parametrize("router,replaced,kept", [("softmax_topk", 1, 0), ("topk_softmax", 1, 0),
                                                  ("group_inplace", 3, 0), ("sigmoid_group", 1, 2)])
def test_region_routers_use_the_op(router, replaced, kept):
    """Every sorted topk of a rewritten router becomes router_topk: three for a DeepSeek-V3-style
    group limit written with sorted calls ([T, groups, E/groups] group scores, the group mask set by
    an in-place ``scatter_`` the walk must follow). ``sorted=False`` calls (``sigmoid_group``: two)
    stay torch.topk: their order is torch's own. explain lists the op with the region."""
    spec = ("loop", "index_add", 2, router, "swiglu", None)
    new, records = rewrite(spec)
    assert [r.status for r in records] == ["rewritten"]
    assert ops_in(new).count("router_topk") == replaced
    left = _topk_nodes(new)
    assert len(left) == kept and all(n.kwargs.get("sorted") is False for n in left), [n.format_node() for n in left]
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


def test_hf_deepseek_v3_router():
    """transformers' DeepSeek-V3 router: its top-2 per group (sorted) becomes the op; its top groups
    and top-k experts (``sorted=False``) stay torch.topk."""
    pytest.importorskip("transformers")
    import test_hf_models as hf

    new, records = rewrite(("fn", hf.Logits(hf.build("deepseek_v3", layers=2)), (hf._ids(),)))
    assert [r.status for r in records] == ["rewritten"] * 2
    assert ops_in(new).count("router_topk") == 2 and len(_topk_nodes(new)) == 4


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
