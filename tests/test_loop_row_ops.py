"""Ops on an expert's rows that the loop rewrite does not take (a review of training-loop realities): they
refuse their own layer only, and a loop whose every expert output comes out of such an op (experts called
through activation checkpointing) is refused with that reason, never left unlisted."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import moe_compile
from helpers import SPELLINGS, LoopMoE, check_compiled, make_input, make_model


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _statuses(model, x):
    return {r.module: (r.status, r.code) for r in moe_compile.explain(model, x).regions}


def test_an_op_on_one_layers_expert_rows_refuses_that_layer_only():
    """Row ops were recorded per expert index, for every layer of the graph: a capture hook on layer 1's
    experts refused layers 0, 1 and 2, each with layer 1's `detach` as the reason."""
    model = Stack([make_model(spelling="index_add", e=4, k=2, h=16, i=12, seed=s) for s in range(3)])
    captured = {}
    for e, expert in enumerate(model.layers[1].experts.experts):
        expert.register_forward_hook(lambda m, i, o, e=e: captured.__setitem__(e, o.detach()))
    x = make_input((10, 16))
    assert _statuses(model, x) == {"layers.0": ("rewritten", ""), "layers.1": ("refused", "unsupported_row_op"),
                                   "layers.2": ("rewritten", "")}
    check_compiled(model, (x,), expect_rewritten=2, expect_refused=1)


class CheckpointedExperts(LoopMoE):
    """Each expert called through torch.utils.checkpoint inside the expert loop."""

    def forward(self, x):
        w, ids = self.router(x)
        out = torch.zeros_like(x)
        for i in range(self.e):
            tok, slot = torch.where(ids == i)
            y = checkpoint(self.experts.experts[i], x[tok], use_reentrant=False)
            out.index_add_(0, tok, y * w[tok, slot].unsqueeze(-1))
        return out


def test_experts_checkpointed_inside_the_loop_are_refused_with_the_reason():
    """The expert functions sat in checkpoint bodies, so the loop had no expert output and was dropped:
    no record, no warning (beside a rewritten layer nothing at all; alone "no MoE layer was found")."""
    torch.manual_seed(0)
    model = Stack([make_model(spelling="index_add", e=4, k=2, h=16, i=12), CheckpointedExperts(h=16, i=12, e=4, k=2)])
    x = make_input((10, 16))
    assert _statuses(model, x) == {"layers.0": ("rewritten", ""), "layers.1": ("refused", "expert_checkpointed")}
    check_compiled(model, (x,), expect_rewritten=1, expect_refused=1)
    report = moe_compile.explain(CheckpointedExperts(h=16, i=12, e=4, k=2), x)
    assert [r.code for r in report.regions] == ["expert_checkpointed"]
    assert "checkpoint the whole MoE layer" in str(report)


@pytest.mark.parametrize("spelling", [s for s in SPELLINGS if s not in ("assign", "assign_mask", "where_flat")])
def test_rewritten_loops_leave_no_host_sync(spelling):
    """The boolean-mask spelling (`out[m] += ...`) kept, after the rewrite, one `out[m]` index (a nonzero)
    per expert with the expert code feeding it: Dynamo's size asserts on `out[m]` read its length, and a
    write into a copy that something else reads was kept. Values were right; every forward synced."""
    model = make_model(spelling=spelling, e=4, k=2, h=16, i=12)
    report = moe_compile.explain(model, make_input((10, 16)))
    assert [r.status for r in report.regions] == ["rewritten"]
    notes = [n for r in report.regions for n in r.notes]
    assert not any("host syncs" in n for n in notes), notes
