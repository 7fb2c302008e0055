"""MoE layers chained in one graph (lowering/region_chain.py): a layer whose expert input is the previous
layer's accumulator itself, not a tensor computed from it.

Lowering the first layer points the readers of its accumulator at the new output and erases the writes
into it; the accumulator node stays, holding zeros. The second layer's region, described before any
lowering, names that node as its input: lowered as described it read zeros (output and every gradient
of the second layer lost, both layers reported rewritten). Each case compares outputs and every gradient
with eager and requires both layers rewritten.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)
from helpers import check_compiled, make_input

H, I, E, K = 16, 12, 4, 2


class LoopIntoZeros(nn.Module):
    """ModuleList experts accumulated with ``out.index_add_`` into ``zeros_like(x)``; returns ``out``."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, I, bias=False), nn.SiLU(), nn.Linear(I, H, bias=False))
                                     for _ in range(E))

    def forward(self, x):
        w, ids = torch.topk(F.softmax(self.gate(x), -1), K, -1)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


class Sorted(nn.Module):
    """Rows sorted by expert, two grouped GEMMs; combined into ``zeros_like(x)`` out of place
    (``index_add``) or in place (``scatter_add_``, then ``out`` returned)."""

    def __init__(self, in_place: bool):
        super().__init__()
        self.in_place = in_place
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, I) / math.sqrt(H))
        self.w2 = nn.Parameter(torch.randn(E, I, H) / math.sqrt(I))

    def forward(self, x):
        top, sel = torch.topk(F.softmax(self.gate(x), dim=1), K, dim=1)
        order = torch.argsort(sel.view(-1), stable=True)
        offs = torch.cumsum(torch.histc(sel.view(-1).float(), bins=E, min=0, max=E), dim=0, dtype=torch.int32)
        tok = order // K
        gmm = torch.ops.transformers.grouped_mm_fallback
        y = gmm(F.silu(gmm(x[tok], self.w1, offs=offs)), self.w2, offs=offs) * top.view(-1)[order].reshape(-1, 1)
        if not self.in_place:
            return torch.zeros_like(x).index_add(0, tok, y)
        out = torch.zeros_like(x)
        out.scatter_add_(0, tok.reshape(-1, 1).expand(-1, H), y)
        return out


class Chain(nn.Module):
    def __init__(self, first: nn.Module, second: nn.Module, residual: bool):
        super().__init__()
        self.a, self.b, self.residual = first, second, residual

    def forward(self, x):
        h = self.a(x)
        return h + self.b(h) if self.residual else self.b(h)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("first", ["loop", "sorted_in_place", "sorted"])
@pytest.mark.parametrize("tokens", [0, 1, 13])
def test_second_layer_reads_the_first_layers_output(first, residual, tokens):
    """Also a sorted layer's rows gathered straight from another sorted layer's output (``b(a(x))``): the
    finder took a tensor another region computed for no token input, and the second layer was compiled
    as written, reported as moe_unmatched (or not at all: ``test_one_layer_called_twice``)."""
    torch.manual_seed(0)
    a = LoopIntoZeros() if first == "loop" else Sorted(in_place=first == "sorted_in_place")
    check_compiled(Chain(a, Sorted(in_place=False), residual), (make_input((tokens, H)),), expect_rewritten=2)


def test_one_layer_called_twice():
    """``a(a(x))`` with a sorted layer: both calls rewritten. Before, the second call's rows (gathered from
    the first call's output) were not found, and the unclaimed detector took the layer's module as claimed
    by the first call: one call compiled as written with no record (review helper-59)."""
    torch.manual_seed(2)
    layer = Sorted(in_place=False)
    check_compiled(Chain(layer, layer, residual=False), (make_input((9, H)),), expect_rewritten=2)


def test_three_layers_each_reading_the_previous_accumulator():
    """The second layer's output, itself an accumulator the third layer reads, is followed too."""
    torch.manual_seed(1)
    model = nn.Sequential(LoopIntoZeros(), Sorted(in_place=True), Sorted(in_place=False))
    check_compiled(model, (make_input((11, H)),), expect_rewritten=3)
