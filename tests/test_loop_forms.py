"""Every per-expert loop spelling is rewritten by backend="moe" and matches eager (outputs and every
gradient), or is refused with a reason when the rewrite would be wrong.

Models come from ``helpers.LoopMoE``; routing is forced through the router bias ("empty": experts 1
and E-1 get no token, "hot": every token picks experts 0..K-1), never through all-zero inputs.
"""
from __future__ import annotations

import pytest
import torch

import moe_compile
from helpers import check_compiled, make_input, make_model

FP32, BF16 = torch.float32, torch.bfloat16

# spellings that accept top-k > 1 (with the softmax -> topk -> renormalise router)
TOPK_SPELLINGS = ("where_setitem", "index_add", "one_hot", "bool_mask", "nonzero", "scatter_add", "index_put")


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spelling", TOPK_SPELLINGS)
def test_topk_spellings(spelling, dtype):
    m = make_model(dtype, spelling=spelling, k=2, e=4)
    check_compiled(m, [make_input((2, 5, 16), dtype)], expect_rewritten=1)


@pytest.mark.parametrize("spelling", TOPK_SPELLINGS)
def test_top1_spellings_argmax_router(spelling):
    """top-1 through an argmax router (ids [T, 1], weights gathered from the softmax)."""
    m = make_model(spelling=spelling, k=1, e=4, router="argmax")
    check_compiled(m, [make_input((9, 16))], expect_rewritten=1)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_top1_flat_ids(dtype):
    """argmax without keepdim: ids [T], weights [T], `torch.where(ids == i)[0]`."""
    m = make_model(dtype, spelling="where_flat", k=1, e=4, router="argmax_flat")
    check_compiled(m, [make_input((2, 5, 16), dtype)], expect_rewritten=1)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spelling", ["assign", "assign_mask"])
def test_assign_top1_accepted(spelling, dtype):
    """`out[tok] = expert(x[tok]) * w` / `out[mask] = ...`: each token is written by one expert
    only, so the overwrite is a sum."""
    m = make_model(dtype, spelling=spelling, k=1, e=4, router="argmax")
    check_compiled(m, [make_input((11, 16), dtype)], expect_rewritten=1)


@pytest.mark.parametrize("spelling", ["assign", "assign_mask"])
def test_assign_top2_refused(spelling):
    """With top-2 the second expert overwrites the first: rewriting it as a sum would change the
    numbers, so the region is refused (with a reason) and the model still runs as written."""
    m = make_model(spelling=spelling, k=2, e=4)
    check_compiled(m, [make_input((11, 16))], expect_rewritten=0, expect_rejected=1)
    rep = moe_compile.explain(make_model(spelling=spelling, k=2, e=4), make_input((11, 16)))
    assert [r.status for r in rep.regions] == ["rejected"]
    assert "overwrites" in rep.regions[0].reason


@pytest.mark.parametrize("routing", ["empty", "hot"])
@pytest.mark.parametrize("spelling", ["where_setitem", "index_add", "one_hot", "bool_mask", "scatter_add"])
def test_forced_routings(spelling, routing):
    """Experts with no tokens, and every token on the same K experts."""
    m = make_model(spelling=spelling, k=2, e=4, routing=routing)
    check_compiled(m, [make_input((7, 16))], expect_rewritten=1)


@pytest.mark.parametrize("routing", ["empty", "hot"])
def test_forced_routings_top1_bf16(routing):
    m = make_model(BF16, spelling="where_setitem", k=1, e=4, router="argmax", routing=routing)
    check_compiled(m, [make_input((3, 3, 16), BF16)], expect_rewritten=1)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("expert", ["gelu_seq", "stacked_chunk", "stacked_interleave", "gptoss"])
def test_expert_kinds(expert, dtype):
    """ModuleList of Linear-GELU-Linear with biases; 3-D stacked weights indexed per expert
    (F.linear + chunk, x @ W[e] + interleaved [..., ::2]); GPT-OSS clamped SwiGLU with biases."""
    m = make_model(dtype, spelling="index_add", expert=expert, k=2, e=4)
    check_compiled(m, [make_input((2, 5, 16), dtype)], expect_rewritten=1)


@pytest.mark.parametrize("spelling", ["where_setitem", "bool_mask"])
@pytest.mark.parametrize("expert", ["stacked_chunk", "gptoss"])
def test_stacked_experts_other_spellings(expert, spelling):
    m = make_model(spelling=spelling, expert=expert, k=2, e=4)
    check_compiled(m, [make_input((9, 16))], expect_rewritten=1)


@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax", "sigmoid_group"])
@pytest.mark.parametrize("spelling", ["where_setitem", "index_add"])
def test_routers(router, spelling):
    m = make_model(spelling=spelling, router=router, k=2, e=4)
    check_compiled(m, [make_input((2, 5, 16))], expect_rewritten=1)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shared", ["add", "base"])
@pytest.mark.parametrize("spelling", ["where_setitem", "index_add", "bool_mask"])
def test_shared_expert(spelling, shared, dtype):
    """`out + shared(x)` after the loop, and an accumulator that starts from shared(x)."""
    m = make_model(dtype, spelling=spelling, shared=shared, k=2, e=4)
    check_compiled(m, [make_input((2, 5, 16), dtype)], expect_rewritten=1)


@pytest.mark.parametrize("t,e,k,h,i", [(1, 3, 2, 8, 5), (13, 5, 3, 24, 7), (17, 7, 1, 12, 9)])
def test_odd_sizes(t, e, k, h, i):
    """Sizes that are multiples of nothing; a single token; top-3."""
    router = "argmax" if k == 1 else "softmax_topk"
    m = make_model(spelling="where_setitem", e=e, k=k, h=h, i=i, router=router)
    check_compiled(m, [make_input((t, h))], expect_rewritten=1)


def test_mixtral_reference_layer():
    """The Mixtral reference layer of the shared zoo (not written for these tests)."""
    import sys

    sys.path.insert(0, "/work/shared/tools/hf_moe_zoo")
    try:
        import plain_moe
    except ImportError:
        pytest.skip("hf_moe_zoo not available")
    torch.manual_seed(0)
    m = plain_moe.MixtralRefMoE(hidden=16, inter=8, num_experts=4, top_k=2)
    check_compiled(m, [make_input((2, 6, 16))], expect_rewritten=1)
