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


@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax", "sigmoid_group"])
def test_region_routers_use_the_op(router):
    """Every topk of a rewritten router becomes router_topk (three for the DeepSeek-V3-style group
    limit: its [T, groups, E/groups] group scores, ``sorted=False``, ``.values`` / ``.indices``), and
    explain lists the op with the region."""
    spec = ("loop", "index_add", 2, router, "swiglu", None)
    new, records = rewrite(spec)
    assert [r.status for r in records] == ["rewritten"]
    assert not _topk_nodes(new), [n.format_node() for n in _topk_nodes(new)]
    assert ops_in(new).count("router_topk") == (3 if router == "sigmoid_group" else 1)
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


def test_hf_deepseek_v3_router_has_all_three_topks_replaced():
    """transformers' DeepSeek-V3 router: top-2 per group (values), top groups (indices, into a mask
    written by an in-place ``scatter_``, which the walk follows), top-k experts (``sorted=False``)."""
    pytest.importorskip("transformers")
    import test_hf_models as hf

    new, records = rewrite(("fn", hf.Logits(hf.build("deepseek_v3", layers=2)), (hf._ids(),)))
    assert [r.status for r in records] == ["rewritten"] * 2
    assert ops_in(new).count("router_topk") == 6 and not _topk_nodes(new)
