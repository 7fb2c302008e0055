"""Expert ids cast to a narrower dtype before the loop compares them (``ids.to(torch.uint8) == e``).

Where the dtype holds every id below E the cast changes nothing and the loop is rewritten. Where it
does not (uint8 with more than 256 experts, int8 with more than 128), eager compares wrapped ids:
expert 300 's tokens run through expert 44 (uint8) or through no expert (int8: negative). The
rewrite routes by the router's own ids, so such a loop must be refused, with its own reason. The
loop was rewritten before (relative error 0.44 for uint8 and 0.52 for int8 with 300 experts).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from helpers import check_compiled, make_input
from moe_compile import report

H, K = 8, 2


class CastIdsLoop(nn.Module):
    """A top-2 loop over ``e`` single-linear experts whose ids are cast to ``dtype`` first; the router
    favours the last four experts, so that ids past the dtype's range are always picked."""

    def __init__(self, e: int, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.gate = nn.Linear(H, e)
        self.experts = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(e))
        with torch.no_grad():
            self.gate.bias.zero_()
            self.gate.bias[-4:] = 4.0

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(K, -1)
        ids = ids.to(self.dtype)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


@pytest.mark.parametrize("e,dtype", [(260, torch.uint8), (130, torch.int8)], ids=["uint8", "int8"])
def test_a_cast_that_wraps_ids_is_refused_and_matches_eager(e, dtype):
    torch.manual_seed(0)
    m = CastIdsLoop(e, dtype)
    x = make_input((16, H))
    assert (m.gate(x).topk(K, -1).indices >= torch.iinfo(dtype).max + 1).any()   # the wrap happens
    with report.recording() as graphs:
        check_compiled(m, [x], expect_rewritten=0, expect_refused=1, fresh_inputs=0)
    records = [r for g in graphs for r in g]
    assert [r.code for r in records] == ["ids_cast_narrow"], records
    assert str(dtype).removeprefix("torch.") in records[0].reason and records[0].fix, records


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_a_cast_that_holds_every_id_is_rewritten(dtype):
    torch.manual_seed(0)
    check_compiled(CastIdsLoop(8, dtype), [make_input((16, H))], expect_rewritten=1)


class SortedInt16(nn.Module):
    """transformers' grouped_mm form (sort, histc, grouped GEMMs, unsort) over 33,000 experts whose
    sort key or histc input is the ids cast to int16: ids >= 32768 wrap negative in eager (they sort
    first and histc drops them, so every group boundary shifts). The router favours experts
    32766-32769."""

    E, I = 33_000, 4

    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.gate = nn.Linear(H, self.E)
        with torch.no_grad():
            self.gate.bias.zero_()
            self.gate.bias[32766:32770] = 4.0
        self.gate_up = nn.Parameter(torch.randn(self.E, 2 * self.I, H) / H ** 0.5)
        self.down = nn.Parameter(torch.randn(self.E, H, self.I) / self.I ** 0.5)

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(K, -1)
        flat, fw = ids.reshape(-1), w.reshape(-1)
        ids_g, perm = torch.sort(flat.to(torch.int16) if self.where == "sort_key" else flat)
        counted = ids_g.to(torch.int16) if self.where == "histc" else ids_g
        offs = torch.cumsum(torch.histc(counted.float(), bins=self.E, min=0, max=self.E - 1), dim=0,
                            dtype=torch.int32)
        gmm = torch.ops.transformers.grouped_mm_fallback
        g, u = gmm(x[perm // K], self.gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = gmm(torch.nn.functional.silu(g) * u, self.down.transpose(-2, -1), offs=offs) * fw[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return y[inv].view(x.shape[0], K, H).sum(dim=1)


@pytest.mark.parametrize("where", ["sort_key", "histc"])
def test_sorted_ids_cast_to_int16_past_its_range_are_refused(where):
    """Rewritten before (relative error 1.83 / 0.98, found by a review): the cast kept the ids' role for
    any number of experts."""
    pytest.importorskip("transformers")
    import transformers.integrations.moe  # noqa: F401  (torch.ops.transformers.grouped_mm_fallback)

    torch.manual_seed(0)
    check_compiled(SortedInt16(where), [make_input((8, H))], expect_rewritten=0, expect_refused=1, fresh_inputs=0)
