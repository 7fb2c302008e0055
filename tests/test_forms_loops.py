"""Per-expert loop forms of issue 12: Switch-style top-1 overwrite over a copy of the input, and loops
the backend cannot see (a Python ``if`` skipping empty experts).

    out = x.clone(); for e: idx = where(ids == e)[0]; out[idx] = expert_e(x[idx]) * w[idx, None]

is rewritten: a routed token's row is its expert's output, a token routed to no expert of the loop
(a router with an extra "no-op" choice) keeps x, with x's gradient through the copy only there.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphs import check_all, dynamo_graph, rewrite
from helpers import SwiGLU, check_compiled, make_input
from moe_compile.passes.legality import Accepted, Refusal

FP32, BF16 = torch.float32, torch.bfloat16


class SwitchMoE(nn.Module):
    """Top-1 (argmax) over ``choices`` router outputs; the loop covers experts 0..e-1 (choices > e: the
    extra choices are "no-op" experts whose tokens keep x)."""

    def __init__(self, h=16, i=12, e=4, choices=None, add=False):
        super().__init__()
        self.e, self.add = e, add
        self.router = nn.Linear(h, choices or e)
        self.experts = nn.ModuleList([SwiGLU(h, i) for _ in range(e)])

    def forward(self, x):
        p = F.softmax(self.router(x), -1)
        w, ids = p.max(-1)
        out = x.clone()
        for e in range(self.e):
            idx = torch.where(ids == e)[0]
            if self.add and e == self.e - 1:
                out[idx] += self.experts[e](x[idx]) * w[idx, None]
            else:
                out[idx] = self.experts[e](x[idx]) * w[idx, None]
        return out


def _model(dtype=FP32, **kw):
    torch.manual_seed(0)
    return SwitchMoE(**kw).to(dtype)


def test_switch_overwrite_found():
    (v,) = check_all(dynamo_graph(("fn", _model(), (torch.randn(9, 16),)))[0])
    assert isinstance(v, Accepted), v
    c = v.region.combine
    assert c.overwrite and c.base is not None and v.region.router.top_k == 1


def test_switch_overwrite_mixed_with_add_refused():
    (v,) = check_all(dynamo_graph(("fn", _model(add=True), (torch.randn(9, 16),)))[0])
    assert isinstance(v, Refusal) and v.code == "overwrite_then_add" and v.fix, v


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("choices", [None, 6], ids=["all-routed", "noop-choices"])
def test_switch_overwrite_matches_eager(dtype, choices):
    m = _model(dtype, choices=choices)
    x = make_input((2, 9, 16), dtype)[0]
    if choices:  # some tokens must pick a no-op choice (ids >= 4) for the case to mean something
        assert (m.router(x).argmax(-1) >= 4).any() and (m.router(x).argmax(-1) < 4).any()
    check_compiled(m, [x], expect_rewritten=1)


def test_switch_overwrite_inductor():
    with torch._inductor.config.patch(fallback_random=True):
        check_compiled(_model(choices=6), [make_input((9, 16))], expect_rewritten=1, inductor=True)


def test_switch_rewritten_graph_keeps_unrouted_rows():
    new, records = rewrite(("fn", _model(choices=6), (torch.randn(9, 16),)))
    assert [r.status for r in records] == ["rewritten"]
    assert any(n.target is torch.where for n in new.graph.nodes)


# ---------------------------------------------------------------- what cannot be captured
class SkipEmpty(nn.Module):
    """``if tok.shape[0] == 0: continue``: a Python branch on a data-dependent size. Dynamo breaks the
    graph inside the loop and skips the whole frame (no flag changes that, checked on torch 2.13), so
    no backend sees the experts; the fix is to drop the branch (an expert with no rows is a no-op for
    index_add_ and the rewrite handles empty groups)."""

    def __init__(self, h=16, i=12, e=4, skip=True):
        super().__init__()
        self.e, self.skip = e, skip
        self.router = nn.Linear(h, e)
        self.experts = nn.ModuleList([SwiGLU(h, i) for _ in range(e)])

    def forward(self, x):
        w, ids = torch.topk(F.softmax(self.router(x), -1), 2)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            if self.skip and tok.shape[0] == 0:
                continue
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


def test_skip_empty_branch_is_not_captured_and_its_fix_is():
    """The frame with the branch runs eagerly (same numbers, nothing rewritten) and is reported (one
    refused record: the function routes with a top-k and groups by expert before the line Dynamo gave
    up on, though no name says MoE); without the branch, as the fix says, the same layer is rewritten."""
    torch.manual_seed(0)
    check_compiled(SkipEmpty(), [make_input((9, 16))], expect_rewritten=0, expect_refused=1)
    torch.manual_seed(0)
    check_compiled(SkipEmpty(skip=False), [make_input((9, 16))], expect_rewritten=1)
