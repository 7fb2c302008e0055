"""moe_compile.explain(): regions rewritten (module, form, status, ops) and refused (with a reason)."""
from __future__ import annotations

import torch
import torch.nn as nn

import moe_compile
from helpers import make_input, make_model


class Block(nn.Module):
    """An MoE layer nested under a named attribute, so the report shows a dotted module path."""

    def __init__(self, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.mlp = make_model(**kw)

    def forward(self, x):
        return x + self.mlp(x)


def test_explain_rewritten():
    rep = moe_compile.explain(Block(spelling="where_setitem", e=4, k=2), make_input((2, 5, 16)))
    assert len(rep.regions) == 1 and rep.rewritten == list(rep.regions) and not rep.refused
    r = rep.regions[0]
    assert r.status == "rewritten" and r.reason == ""
    assert r.module.startswith("mlp"), r.module
    assert r.form == "loop/where+setitem"
    assert r.num_experts == 4 and r.top_k == 2
    for op in ("route_permute", "permute_rows", "unpermute_combine"):
        assert op in r.ops
    assert "grouped_mm_list" in r.ops  # ModuleList experts
    assert r.where.startswith("helpers.py:")
    text = str(rep)
    assert "1 MoE region(s) rewritten, 0 refused" in text
    header = next(line for line in text.splitlines() if line.startswith("module"))
    for col in ("form", "status", "experts", "top_k"):
        assert col in header
    assert "---" in text and "loop/where+setitem" in text and "rewritten" in text


def test_explain_forms_named():
    forms = {}
    for sp in ("one_hot", "bool_mask"):
        rep = moe_compile.explain(make_model(spelling=sp, e=3, k=2), make_input((6, 16)))
        forms[sp] = rep.regions[0].form
    assert forms == {"one_hot": "loop/one_hot+index_add_", "bool_mask": "loop/mask+setitem"}


def test_explain_stacked_uses_grouped_mm():
    rep = moe_compile.explain(make_model(spelling="index_add", expert="stacked_chunk"), make_input((6, 16)))
    assert rep.regions[0].status == "rewritten" and "grouped_mm" in rep.regions[0].ops


def test_explain_refused_gives_reason():
    rep = moe_compile.explain(Block(spelling="assign", e=4, k=2), make_input((2, 5, 16)))
    assert len(rep.refused) == 1 and not rep.rewritten
    r = rep.refused[0]
    assert r.status == "refused" and r.code == "overwrite_topk" and "overwrites" in r.reason and "top-k > 1" in r.reason
    assert r.module.startswith("mlp")
    text = str(rep)
    assert "0 MoE region(s) rewritten, 1 refused" in text and "overwrites" in text


def test_explain_nothing_to_do():
    rep = moe_compile.explain(nn.Linear(16, 16), make_input((3, 16)))
    assert rep.regions == () and "0 MoE region(s) rewritten, 0 refused" in str(rep)


def test_experts_with_different_mlps_are_refused():
    """Expert 1 uses GELU where the others use SiLU: no single template, so the region is refused
    (and the model still runs, unrewritten)."""
    import torch.nn.functional as F

    model = make_model(spelling="index_add", e=4, k=2)
    expert1 = model.experts.experts[1]
    expert1.forward = lambda x: expert1.w2(F.gelu(expert1.w1(x)) * expert1.w3(x))
    rep = moe_compile.explain(model, make_input((2, 5, 16)))
    assert not rep.rewritten and len(rep.refused) == 1, str(rep)
    assert "expert 1's MLP differs in structure" in rep.refused[0].reason


def test_explain_notes_many_list_weights():
    """ModuleList experts with many experts: the report says the per-parameter host cost and the fix."""
    many = moe_compile.explain(make_model(h=16, i=8, e=32, k=2, spelling="index_add"), make_input((7, 16)))
    few = moe_compile.explain(make_model(h=16, i=8, e=4, k=2, spelling="index_add"), make_input((7, 16)))
    (r,) = many.rewritten
    assert any("96 per-expert weight tensors" in n and "reduce-overhead" in n for n in r.notes), r.notes
    assert not any("per-expert weight tensors" in n for r in few.rewritten for n in r.notes)
