"""Never silent, never hidden: what looks like MoE and was not rewritten is listed by explain() and
logged once at WARNING when compiling (per compiled model and region, not per call or recompile);
graph breaks and frames Dynamo gave up on in MoE code say how to fix them (fullgraph=True included);
our own failures compile the graph unrewritten with a warning (raise with moe.strict) and never
become a quiet eager run; a region counts as rewritten only once the code that runs contains it."""
from __future__ import annotations

import copy
import logging
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_compile
import moe_compile.backend as backend
from helpers import FP32_REL, SwiGLU, assert_close_rel, check_compiled, make_input, make_model
from moe_compile import records

OPTS = {"moe.inductor": False}


def _warnings(caplog, code: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and f"[{code}]" in r.getMessage()]


def _nothing(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "rewrote no MoE region" in r.getMessage()]


@pytest.fixture
def unknown_forms(monkeypatch):
    """Both finders recognise nothing: every MoE layer is a form the backend does not know."""
    import moe_compile.passes.grouped_regions as gr
    import moe_compile.passes.loop_regions as lr

    monkeypatch.setattr(lr, "find_loop_regions", lambda gm, *a, **k: [])
    monkeypatch.setattr(gr, "find_grouped_regions", lambda gm, *a, **k: [])


class TwoLayers(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(make_model(**kw) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


# ------------------------------------------------------------------------------ MoE-like, not claimed
@pytest.mark.parametrize("spelling, expert", [("where_setitem", "swiglu"), ("index_add", "stacked_chunk")])
def test_unclaimed_moe_is_listed_and_warned_once(unknown_forms, caplog, spelling, expert):
    """A form no finder knows: one moe_unmatched record per layer, in explain() and in the counters;
    one warning naming both layers (the same code at the same line: one problem; it was one warning per
    layer, 48 for 48 identical layers, review helper-110) and one nothing-rewritten warning over three calls
    and a recompile."""
    model = TwoLayers(spelling=spelling, expert=expert, e=4, k=2)
    rep = moe_compile.explain(model, make_input((6, 16)))
    assert [r.code for r in rep.refused] == ["moe_unmatched"] * 2, str(rep)
    assert sorted(r.module for r in rep.refused) == ["layers.0", "layers.1"], str(rep)
    r = rep.refused[0]
    assert "top-2 router over 4 experts" in r.reason and "helpers.py:" in r.reason and r.fix, r
    assert "moe_unmatched" in str(rep) and r.fix in str(rep)

    torch._dynamo.reset()
    cm = torch.compile(model, backend="moe", options=OPTS)
    before = records.counters["refused"]
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        for n in (6, 6, 6, 9):              # the last shape recompiles
            cm(make_input((n, 16), seed=n))
    assert records.counters["refused"] - before >= 2
    warned = _warnings(caplog, "moe_unmatched")
    assert len(warned) == 1 and "fix:" in warned[0], warned
    assert "MoE regions layers.0, layers.1 (" in warned[0], warned
    assert len(_nothing(caplog)) == 1
    # another compile of the model reuses Dynamo's cached code: nothing is compiled, nothing warned twice;
    # once Dynamo's cache is reset it compiles again, and warns again, once
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        cm2 = torch.compile(copy.deepcopy(model), backend="moe", options=OPTS)
        cm2(make_input((6, 16)))
        assert not caplog.records, caplog.text
        torch._dynamo.reset()
        cm2(make_input((6, 16)))
        cm2(make_input((6, 16)))
    assert len(_warnings(caplog, "moe_unmatched")) == 1 and len(_nothing(caplog)) == 1



class SelfNamedS(nn.Module):
    """``def forward(s, x)``: Dynamo's paths start ``L['s']``, not ``L['self']``."""
    def __init__(s):
        super().__init__()
        s.moe = make_model(spelling="where_setitem", expert="swiglu", e=4, k=2)

    def forward(s, x):
        return x + s.moe(x)


def test_warning_names_the_region_as_explain_does_whatever_self_is_called(unknown_forms, caplog):
    """The compile warning named the region ``s.moe`` where explain() says ``moe``."""
    model = SelfNamedS()
    rep = moe_compile.explain(model, make_input((6, 16)))
    assert [r.module for r in rep.refused] == ["moe"], str(rep)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        torch.compile(model, backend="moe", options=OPTS)(make_input((6, 16)))
    warned = _warnings(caplog, "moe_unmatched")
    assert len(warned) == 1 and "MoE region moe (" in warned[0], warned



class _AnyNonzeroLoop(nn.Module):
    """Tokens of expert e by ``(ids == e).any(-1).nonzero()``, their slot by an argmax: a form no finder knows."""
    def __init__(self, h=16, f=32, e=4):
        super().__init__()
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h)) for _ in range(e))

    def forward(self, x):
        w, ids = F.softmax(self.gate(x), -1).topk(2, -1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = ids == e
            tok = mask.any(-1).nonzero().squeeze(-1)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, mask[tok].float().argmax(-1), None])
        return out


def test_unclaimed_detector_compares_data_dependent_sizes_without_guarding():
    """The detector compared a nonzero-sized write with the token count (a data-dependent guard): it
    raised, and the layer was listed as a matcher_error without module, experts or top-k (helper-102)."""
    rep = moe_compile.explain(_AnyNonzeroLoop(), make_input((24, 16)))
    assert [(r.code, r.module, r.num_experts, r.top_k) for r in rep.refused] == [("moe_unmatched", "experts", 4, 2)], \
        str(rep)


class DerivedWeightsMoE(nn.Module):
    """The routed tokens meet expert weights computed from the Parameters (``W * 1.0``, ``flip``,
    ``cat``), with buffers beside them (a mask, int8 weights times learned scales), in forms no finder
    knows (a dense einsum, a masked loop over all tokens)."""

    def __init__(self, form, h=16, i=8, e=4, k=2):
        super().__init__()
        torch.manual_seed(0)
        self.form, self.k, self.e = form, k, e
        self.gate = nn.Linear(h, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(e, h, i) / 4)
        self.w2 = nn.Parameter(torch.randn(e, i, h) / 3)
        self.register_buffer("mask", (torch.rand(e, 1, i) > 0.2).float())
        self.register_buffer("q1", torch.randint(-127, 127, (e, h, i), dtype=torch.int8))
        self.s1 = nn.Parameter(torch.full((e, 1, i), 0.01))
        self.register_buffer("q2", torch.randint(-127, 127, (e, i, h), dtype=torch.int8))
        self.s2 = nn.Parameter(torch.full((e, 1, h), 0.01))
        self.a1, self.b1 = nn.Parameter(torch.randn(e, h, 2) / 4), nn.Parameter(torch.zeros(e, 2, i))
        self.register_buffer("t1", torch.full((e, 1, i), 0.01))     # frozen scales of frozen int8 experts
        self.register_buffer("t2", torch.full((e, 1, h), 0.01))
        self.register_buffer("p1", torch.randint(0, 2 ** 31 - 1, (e, h, i // 8), dtype=torch.int32))  # int4 x 8
        self.register_buffer("p2", torch.randint(0, 2 ** 31 - 1, (e, i, h // 8), dtype=torch.int32))  # per int32

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(self.k, dim=-1)
        if self.form in ("buffer_mask", "int8", "int8_buffers", "int4_in_int32", "lora"):
            if self.form == "lora":           # per-expert low-rank updates merged into the weights
                w1, w2 = self.w1 + self.a1 @ self.b1, self.w2 / self.w2.norm(dim=(1, 2), keepdim=True)
            elif self.form == "buffer_mask":
                w1, w2 = self.w1 * self.mask, self.w2 * self.mask.transpose(1, 2)
            elif self.form == "int4_in_int32":   # GPTQ / AWQ-style packing, frozen scales
                shifts = torch.arange(0, 32, 4, dtype=torch.int32)
                w1 = ((self.p1[..., None] >> shifts) & 0xF).flatten(-2).float() * self.t1
                w2 = ((self.p2[..., None] >> shifts) & 0xF).flatten(-2).float() * self.t2
            elif self.form == "int8_buffers":
                w1, w2 = self.q1.float() * self.t1, self.q2.float() * self.t2   # nothing learned: buffers only
            else:
                w1, w2 = self.q1.float() * self.s1, self.q2.float() * self.s2   # learned scales (QAT)
            r = torch.zeros(x.shape[0], self.e).scatter(1, ids, w)
            h = F.gelu(torch.einsum("th,ehi->eti", x, w1))
            return torch.einsum("eth,te->th", torch.einsum("eti,eih->eth", h, w2), r)
        if self.form == "einsum":
            r = torch.zeros(x.shape[0], self.e).scatter(1, ids, w)
            h = F.gelu(torch.einsum("th,ehi->eti", x, self.w1 * 1.0))
            return torch.einsum("eth,te->th", torch.einsum("eti,eih->eth", h, self.w2.flip(0)), r)
        w12 = torch.cat([self.w1, self.w2.transpose(1, 2)], -1)
        out = torch.zeros_like(x)
        for e in range(self.e):
            mine = (ids == e).any(-1, keepdim=True)
            we = (w * (ids == e)).sum(-1, keepdim=True)
            h = F.gelu(x @ w12[e][:, :8])
            out = out + torch.where(mine, h @ w12[e][:, 8:].t() * we, 0)
        return out


@pytest.mark.parametrize("form", ["einsum", "masked_loop", "buffer_mask", "int8", "int8_buffers", "int4_in_int32",
                                  "lora"])
def test_unclaimed_moe_with_derived_expert_weights_is_listed(form):
    """Was silent: the scan followed expert weights through views only (now through anything computed
    from Parameters, buffers and constants beside them: a masked or int8-dequantised expert weight;
    and from quantised buffers alone: int8 experts, or int4 packed in int32, with frozen scales)."""
    rep = moe_compile.explain(DerivedWeightsMoE(form), make_input((6, 16)))
    assert [r.code for r in rep.refused] == ["moe_unmatched"] and not rep.rewritten, str(rep)
    assert "top-2 router over 4 experts" in rep.refused[0].reason, str(rep)


class _VectorExperts(nn.Module):
    """PEER-style experts kept as raw Parameters, one vector per expert: the gathered rows meet the
    token (``x . down[ids]``), so this is MoE, whatever weights the scores; ``weights_from`` picks
    the top-k values or the scores before the top-k."""

    def __init__(self, weights_from="topk", h=16, e=12, k=3):
        super().__init__()
        self.weights_from, self.k, self.e = weights_from, k, e
        self.gate = nn.Linear(h, e + h if weights_from == "shared_projection" else e, bias=False)
        self.down, self.up = nn.Parameter(torch.randn(e, h) / 4), nn.Parameter(torch.randn(e, h) / 4)

    def forward(self, x):
        scores = self.gate(x)
        if self.weights_from == "shared_projection":   # the router's logits and the experts' input: one matmul
            scores, x = scores[:, :self.e], scores[:, self.e:]
        w, ids = scores.topk(self.k, -1)
        w = w.softmax(-1) if self.weights_from == "topk" else scores.softmax(-1).gather(-1, ids)
        h = F.gelu(torch.einsum("th,tkh->tk", x, self.down[ids])) * w
        return torch.einsum("tk,tkh->th", h, self.up[ids])


@pytest.mark.parametrize("weights_from", ["topk", "scores", "shared_projection"])
def test_vector_experts_that_meet_the_token_are_listed(weights_from):
    """The token-path rule that drops kNN and memory reads keeps experts whose rows meet the token, also
    when one projection gives both the router's logits and the experts' input."""
    rep = moe_compile.explain(_VectorExperts(weights_from), make_input((6, 16)))
    assert [r.code for r in rep.refused] == ["moe_unmatched"] and not rep.rewritten, str(rep)
    assert "expert weight rows gathered by the routed ids" in rep.refused[0].reason, str(rep)


class _MaskThenBreak(nn.Module):
    """Per-expert masks built from the router's ids, then a graph break, then the expert loop on the
    masks: ``ids.unsqueeze(-1) == arange(E)`` (or ``ids[..., None] == arange(E)``, or against a view of
    the arange) and load statistics (``.tolist()``), or Switch's top-1 ``one_hot(argmax)`` and a
    ``print``. No name and no source line says MoE."""

    def __init__(self, form, h=16, e=4):
        super().__init__()
        self.form, self.e = form, e
        self.proj = nn.Linear(h, e)
        self.ffn = nn.ModuleList(nn.Linear(h, h) for _ in range(e))
        self.stats = None

    def forward(self, x):
        probs = self.proj(x).softmax(-1)
        if self.form in ("top1_arange", "top1_list"):      # top-1: masks [T, E] or a list of [T]
            idx = probs.argmax(-1)
            sel = idx[:, None] == torch.arange(self.e) if self.form == "top1_arange" else None
            sels = [idx == e for e in range(self.e)] if sel is None else [sel[:, e] for e in range(self.e)]
            self.stats = [int(m.sum()) for m in sels]
            masks = [(m, probs[:, e]) for e, m in enumerate(sels)]
        elif self.form.startswith("arange"):
            w, idx = probs.topk(2, -1)
            sel = {"arange": idx.unsqueeze(-1) == torch.arange(self.e),
                   "arange_index": idx[..., None] == torch.arange(self.e),
                   "arange_view": idx.unsqueeze(-1) == torch.arange(self.e).view(1, 1, -1)}[self.form]
            self.stats = sel.sum((0, 1)).tolist()
            masks = [(sel[:, :, e].any(-1), (w * sel[:, :, e]).sum(-1)) for e in range(self.e)]
        else:
            onehot = F.one_hot(probs.argmax(-1), self.e).bool()
            print("dispatching")
            masks = [(onehot[:, e], probs[:, e]) for e in range(self.e)]
        out = torch.zeros_like(x)
        for e, (rows, we) in enumerate(masks):
            out[rows] += we[rows, None] * self.ffn[e](x[rows])
        return out


@pytest.mark.parametrize("form", ["arange", "arange_index", "arange_view", "one_hot", "top1_arange", "top1_list"])
def test_graph_break_after_per_expert_masks_is_listed(form, capsys):
    """Was silent: the graph before the break ends with the router's per-expert masks, not its ids."""
    torch.manual_seed(0)
    rep = moe_compile.explain(_MaskThenBreak(form), make_input((8, 16)))
    assert rep.graph_breaks and not rep.rewritten, str(rep)


def test_must_not_match_is_not_flagged():
    """A top-k and a scatter-add with no expert weights, attention, a dense MLP: not MoE."""
    from test_backend import Attention, DenseMLP, TopkNoExperts

    for cls in (TopkNoExperts, Attention, DenseMLP):
        torch.manual_seed(0)
        rep = moe_compile.explain(cls(), make_input((2, 5, 16)))
        assert not rep.regions and not rep.graph_breaks, (cls.__name__, str(rep))


def test_nothing_rewritten_warns_once_and_rewritten_model_is_quiet(caplog):
    from test_backend import DenseMLP

    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        cm = torch.compile(DenseMLP(), backend="moe", options=OPTS)
        for seed in range(3):
            cm(make_input((3, 16), seed=seed))
    assert len(_nothing(caplog)) == 1 and "no MoE layer was found" in _nothing(caplog)[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        m = make_model(spelling="index_add")
        cm = torch.compile(m, backend="moe", options=OPTS)
        cm(make_input((6, 16)))
        cm(make_input((6, 16), seed=1))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize("what", ["dense", "refused"])
def test_nothing_rewritten_warns_under_fullgraph(caplog, what):
    """fullgraph=True: Dynamo counts no frame, and the nothing-rewritten warning was never given (helper-75)."""
    from test_backend import DenseMLP

    torch._dynamo.reset()
    model = DenseMLP() if what == "dense" else make_model(spelling="assign", e=4, k=2)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        cm = torch.compile(model, backend="moe", options=OPTS, fullgraph=True)
        cm(make_input((3, 16)))
        cm(make_input((3, 16), seed=1))
    assert len(_nothing(caplog)) == 1, caplog.text


def test_nothing_rewritten_warns_for_a_call_inside_an_except_block(caplog):
    """A first call made while the caller handles an exception (a fallback path) compiled and ran
    fine: it still warns that nothing was rewritten (the scope took the handled exception for one
    raised by the call, and the warning was lost for good: later calls compile nothing)."""
    from test_backend import DenseMLP

    torch._dynamo.reset()
    cm = torch.compile(DenseMLP(), backend="moe", options=OPTS)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        try:
            raise KeyError("the caller's own error")
        except KeyError:
            cm(make_input((3, 16)))
        cm(make_input((3, 16), seed=1))
    assert len(_nothing(caplog)) == 1, caplog.text


# ------------------------------------------------------------------------------ graph breaks
class _RootMoE(nn.Module):
    """An MoE layer on the compiled root module itself (module path ""), in a form no finder knows (a
    masked dense loop over 3-D weights), beside a supported layer in a child module."""

    def __init__(self, h=16, i=8, e=4, k=2, child=True):
        super().__init__()
        self.e, self.k = e, k
        self.gate = nn.Linear(h, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(e, h, i) / 4)
        self.w2 = nn.Parameter(torch.randn(e, i, h) / 3)
        self.moe = make_model(spelling="index_add", e=4, k=2) if child else None

    def forward(self, x):
        if self.moe is not None:
            x = x + self.moe(x)
        w, ids = self.gate(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.e):
            mine = (ids == e).any(-1, keepdim=True)
            we = (w * (ids == e)).sum(-1, keepdim=True)
            out = out + torch.where(mine, (F.gelu(x @ self.w1[e]) @ self.w2[e]) * we, 0)
        return x + out


@pytest.mark.parametrize("child", [False, True])
def test_moe_on_the_root_module_is_listed_beside_a_rewritten_layer(child, caplog):
    """The root's path "" contains every module path: a rewritten layer anywhere used to count as the
    root layer's own region, which was then neither listed nor warned about."""
    model = _RootMoE(child=child)
    rep = moe_compile.explain(model, make_input((8, 16)))
    assert [r.code for r in rep.refused] == ["moe_unmatched"] and len(rep.rewritten) == int(child), str(rep)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        torch.compile(model, backend="moe", options=OPTS)(make_input((8, 16)))
    assert len(_warnings(caplog, "moe_unmatched")) == 1, caplog.text


class SkipEmptyMoE(nn.Module):
    """DeepSeek-style: counts on the host to skip experts without tokens (Dynamo gives up on the frame)."""

    def __init__(self, h=16, i=8, e=4, k=2):
        super().__init__()
        self.k = k
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(SwiGLU(h, i) for _ in range(e))

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), self.k, dim=-1)
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            if counts[e] == 0:
                continue
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


class BreakMoE(SkipEmptyMoE):
    """A graph break between the router and the experts."""

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), self.k, dim=-1)
        torch._dynamo.graph_break()
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


class Block(nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.norm, self.moe = nn.LayerNorm(16), moe

    def forward(self, x):
        return x + self.moe(self.norm(x))


def test_skipped_frame_in_moe_code(caplog):
    """Dynamo gives up on the frame (`.tolist()` of routing counts): the compile warns once with the fix,
    explain() lists it, before and after a compile (Dynamo never traces a skipped frame again)."""
    x = make_input((6, 16))
    model = Block(SkipEmptyMoE())
    rep = moe_compile.explain(model, x)
    (b,) = rep.graph_breaks
    assert b.reason_code == "break_tolist" and "tolist()" in b.code and "torch.where(ids == e)" in b.fix, str(rep)
    assert b.where.startswith("test_never_silent.py:") and "Dynamo gave up on the frame" in b.reason
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        cm = torch.compile(model, backend="moe", options=OPTS)
        for _ in range(3):
            torch.testing.assert_close(cm(x), model(x))
    assert len(_warnings(caplog, "break_tolist")) == 1 and len(_nothing(caplog)) == 1, caplog.text
    rep = moe_compile.explain(model, x)             # the frame is skipped now: still listed
    assert [b.reason_code for b in rep.graph_breaks] == ["break_tolist"], str(rep)


def test_stock_compile_first_leaves_the_moe_compile_rewritten(caplog):
    """Stock torch.compile of the same class first (a benchmark's order): Dynamo gives up on the expert
    loop's frame (data-dependent nonzero) and marks its code to run eagerly, process-wide. A later
    backend="moe" compile of another instance then ran that frame eagerly too and said "no MoE layer
    was found"; its first call now lifts the mark (skipped_frames.lift_earlier_skips): rewritten, with
    eager's outputs and gradients."""
    torch._dynamo.reset()
    x = make_input((6, 16))
    stock_model, model = make_model(spelling="index_add"), make_model(spelling="index_add")
    torch.compile(stock_model, backend="inductor")(x).sum().backward()
    ours = copy.deepcopy(model)
    before = dict(records.counters)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        x1, x2 = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        out = torch.compile(ours, backend="moe", options=OPTS)(x1)
        out.sum().backward()
    assert records.counters["rewritten"] - before.get("rewritten", 0) == 1, caplog.text
    assert not _nothing(caplog), caplog.text
    ref = model(x2)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x1.grad, x2.grad)
    for (name, p), q in zip(ours.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_graph_break_in_moe_code(caplog):
    x = make_input((6, 16))
    model = Block(BreakMoE())
    rep = moe_compile.explain(model, x)
    assert [b.reason_code for b in rep.graph_breaks] == ["break_other"], str(rep)
    b = rep.graph_breaks[0]
    assert "graph_break()" in b.code and "User-inserted graph break" in b.reason  # Dynamo's reason, in full
    assert "gb0025" in b.reason or len(b.reason) > 200                             # never cut
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        cm = torch.compile(model, backend="moe", options=OPTS)
        cm(x)
        cm(x)
    assert len(_warnings(caplog, "break_other")) == 1, caplog.text


def test_fullgraph_break_in_moe_code_says_how_to_fix():
    torch._dynamo.reset()
    cm = torch.compile(SkipEmptyMoE(), backend="moe", fullgraph=True, options=OPTS)
    with pytest.raises(Exception) as info:
        cm(make_input((6, 16)))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "moe_compile [break_tolist]" in notes and "fix: keep the counts on the device" in notes, notes


@pytest.mark.parametrize("decorated", [True, False])
def test_expert_hit_fix_checks_what_the_class_supports(tmp_path, decorated):
    """transformers' eager loop: experts_implementation="grouped_mm" is advised only to a class that
    has the switch (@use_experts_implementation); DBRX-like classes get the loop rewrite instead."""
    pytest.importorskip("transformers")
    from moe_compile.passes.unclaimed import Frame, break_fix, classify_break

    src = tmp_path / "modeling_fake.py"
    src.write_text(textwrap.dedent(f"""\
        {"@use_experts_implementation" if decorated else "# no decorator"}
        class FakeExperts(nn.Module):
            def forward(self, hidden_states, top_k_index, top_k_weights):
                for expert_idx in expert_hit:
                    pass
        """))
    code, detail = classify_break([Frame(str(src), 4, "forward")], "graph break in loop")
    fix = break_fix(code, detail)
    if decorated:
        assert code == "break_expert_hit_hf" and 'experts_implementation="grouped_mm"' in fix, fix
    else:
        assert code == "break_expert_hit" and "grouped_mm" not in fix and "range(num_experts)" in fix, fix
        assert "FakeExperts has no experts_implementation switch" in fix


# ------------------------------------------------------------------------------ our failures
def _fail_when_rewritten(monkeypatch, always: bool = False):
    real = backend._compile_rewritten

    def compile_(gm, *a, **k):
        if always or any("moe_compile" in str(n.target) for n in gm.graph.nodes):
            raise RuntimeError("injected compile failure")
        return real(gm, *a, **k)

    monkeypatch.setattr(backend, "_compile_rewritten", compile_)


def test_compile_failure_compiles_unrewritten_and_warns(monkeypatch, caplog):
    _fail_when_rewritten(monkeypatch)
    m = make_model(spelling="index_add")
    with caplog.at_level(logging.WARNING, logger="moe_compile"), records.recording() as graphs:
        check_compiled(m, [make_input((6, 16))], expect_rewritten=0, expect_refused=1)
    (r,) = {r for g in graphs for r in g}
    assert r.code == "compile_error" and "injected compile failure" in r.reason
    assert "compiling the rewritten graph failed" in caplog.text
    torch._dynamo.reset()
    with pytest.raises(Exception, match="injected compile failure"):
        torch.compile(make_model(spelling="index_add"), backend="moe",
                      options={**OPTS, "moe.strict": True})(make_input((6, 16)))


def test_backend_error_is_raised_not_run_eagerly(monkeypatch):
    """An error left after our fallbacks reaches the user, as with stock torch.compile: the capture
    scope's suppress_errors (for frames Dynamo cannot trace) must not turn it into an eager run."""
    _fail_when_rewritten(monkeypatch, always=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="injected compile failure"):
        torch.compile(make_model(spelling="index_add"), backend="moe", options=OPTS)(make_input((6, 16)))
    assert torch._dynamo.config.suppress_errors is False  # the scope's patch is gone


def test_lowering_failure_compiles_unrewritten_and_warns(monkeypatch, caplog):
    import moe_compile.lowering.region as region

    def boom(*a, **k):
        raise RuntimeError("injected lowering failure")

    monkeypatch.setattr(region, "lower_region", boom)
    with caplog.at_level(logging.WARNING, logger="moe_compile"), records.recording() as graphs:
        check_compiled(make_model(spelling="index_add"), [make_input((6, 16))], expect_rewritten=0,
                       expect_refused=1)
    assert [r.code for g in graphs for r in g] == ["lowering_error"] and "injected lowering failure" in caplog.text
    torch._dynamo.reset()
    with pytest.raises(Exception, match="injected lowering failure"):
        torch.compile(make_model(spelling="index_add"), backend="moe",
                      options={**OPTS, "moe.strict": True})(make_input((6, 16)))


def test_after_compile_failure_keeps_the_rewrite(monkeypatch, caplog):
    import moe_compile.lowering.rehome as rehome

    def boom(*a, **k):
        raise RuntimeError("injected rehome failure")

    monkeypatch.setattr(rehome, "rehome_expert_weights", boom)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        check_compiled(make_model(spelling="index_add"), [make_input((6, 16))], expect_rewritten=1)
    assert "injected rehome failure" in caplog.text


def test_detector_failure_warns_and_keeps_the_rewrite(monkeypatch, caplog):
    import moe_compile.passes.unclaimed as unclaimed

    def boom(*a, **k):
        raise RuntimeError("injected detector failure")

    monkeypatch.setattr(unclaimed, "find_unclaimed", boom)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        check_compiled(make_model(spelling="index_add"), [make_input((6, 16))], expect_rewritten=1,
                       expect_refused=1)
    assert "injected detector failure" in caplog.text
    torch._dynamo.reset()
    with pytest.raises(Exception, match="injected detector failure"):
        torch.compile(make_model(spelling="index_add"), backend="moe",
                      options={**OPTS, "moe.strict": True})(make_input((6, 16)))


def test_records_published_when_the_compiled_code_first_runs():
    """A graph the backend compiled but that never ran (Dynamo dropped it) is not counted."""
    from graphs import dynamo_graph

    gm, inputs = dynamo_graph(("loop", "index_add", 2, "softmax_topk", "swiglu", None))
    before = dict(records.counters)
    with records.recording() as graphs:
        fn = moe_compile.moe_backend(gm, inputs, options=OPTS)
        assert dict(records.counters) == before and not graphs
        fn(*inputs)
        fn(*inputs)
    assert records.counters["rewritten"] == before.get("rewritten", 0) + 1 and len(graphs) == 1


# ------------------------------------------------------------------------------ zero tokens
def test_zero_tokens_explain_and_compile_quiet(caplog):
    m = make_model(spelling="index_add", e=4, k=2)
    x = make_input((0, 16))
    rep = moe_compile.explain(m, x)
    assert [r.status for r in rep.regions] == ["rewritten"] and not rep.graph_breaks, str(rep)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        check_compiled(m, [x], expect_rewritten=1, fresh_inputs=0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_moe_inside_nested_compile_region_is_reported(monkeypatch, caplog):
    """torch.compiler.nested_compile_region makes each decoder layer an invoke_subgraph whose body the
    finders do not enter: the MoE layer inside is refused with `nested_region` (the fix names
    moe_compile.compile_blocks), once for the subgraph every layer shares, not 'no MoE layer found'."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, intermediate_size=32, use_cache=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM._from_config(cfg)
    cls = type(model.model.layers[0])
    monkeypatch.setattr(cls, "forward", torch.compiler.nested_compile_region(cls.forward))
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        cm = torch.compile(model, backend="moe", options=OPTS)
        cm(input_ids=ids)
        cm(input_ids=ids)
    found = _warnings(caplog, "nested_region")
    assert len(found) == 1, caplog.text
    assert "top-2 router over 4 experts" in found[0] and "compile_blocks" in caplog.text
    assert "no MoE layer was found" not in caplog.text


class _NestedLoop(nn.Module):
    """A ModuleList expert loop called from a torch.compiler.nested_compile_region method: Dynamo inlines it
    (the where/nonzero sizes), so the backend rewrites it."""

    def __init__(self):
        super().__init__()
        self.moe = make_model(spelling="index_add", e=4, k=2)

    @torch.compiler.nested_compile_region
    def block(self, x):
        return self.moe(x)

    def forward(self, x):
        return self.block(x) + 1


class _WrappedLater(nn.Module):
    """The same layer, its class's forward wrapped by nested_compile_region after the class was written."""

    def __init__(self):
        super().__init__()
        self.moe = make_model(spelling="index_add", e=4, k=2)

    def forward(self, x):
        return self.moe(x)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _WrappedLater()

    def forward(self, x):
        return self.block(x) + 1


_ncr = torch.compiler.nested_compile_region


class _NestedAlias(_NestedLoop):
    """The region decorated on the compiled root's own method, under another name."""

    @_ncr
    def block(self, x):
        return self.moe(x)


def _run_moe(moe, x):
    return moe(x)


_run_moe_region = torch.compiler.nested_compile_region(_run_moe)   # a plain function wrapped where it is used


class _NestedCallSite(_NestedLoop):
    def forward(self, x):
        return _run_moe_region(self.moe, x) + 1


@pytest.mark.parametrize("how", ["decorated", "wrapped", "alias", "call_site"])
def test_modulelist_experts_in_an_inlined_nested_compile_region_keep_their_storage(how, monkeypatch):
    """Re-homing the expert weights of such a layer into one buffer made Dynamo's next trace of the region (a new
    batch size, explain()) raise UncapturedHigherOrderOpError: invoke_subgraph refuses inputs that share storage
    (review helper-94). The weights stay where they are, and the note names the function."""
    torch.manual_seed(0)
    if how == "wrapped":
        monkeypatch.setattr(_WrappedLater, "forward", torch.compiler.nested_compile_region(_WrappedLater.forward))
    model = {"decorated": _NestedLoop, "wrapped": _Outer, "alias": _NestedAlias, "call_site": _NestedCallSite}[how]()
    check_compiled(model, [make_input((8, 16))], expect_rewritten=1, options={"moe.inductor": False})
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    eager = copy.deepcopy(model)
    for t in (8, 12, 5):
        x = make_input((t, 16))
        assert_close_rel(compiled(x), eager(x), FP32_REL, f"{t} tokens")
    w1 = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.shape[0] != 4]
    assert len({w.weight.untyped_storage().data_ptr() for w in w1}) == len(w1), "expert weights were re-homed"
    rep = moe_compile.explain(compiled, make_input((7, 16)))
    assert [r.status for r in rep.regions] == ["rewritten"], str(rep)
    name = {"decorated": "block", "wrapped": "forward", "alias": "block", "call_site": "_run_moe"}[how]
    assert any("nested_compile_region" in n and f"`{name}`" in n for n in rep.regions[0].notes), str(rep)
    assert not any("moves them into one buffer" in n for n in rep.regions[0].notes), str(rep)


class DrawnRouterMoE(nn.Module):
    """A per-expert loop whose ids are drawn without a top-k (hash layers, sampled or random routing),
    next to nothing else: a token may draw one expert twice, so it is never rewritten, and listed."""

    def __init__(self, draw: str, e: int = 4, k: int = 2, h: int = 16):
        super().__init__()
        self.draw, self.e, self.k = draw, e, k
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(SwiGLU(h, 24) for _ in range(e))

    def forward(self, x, token_ids):
        probs = self.gate(x).softmax(-1)
        if self.draw == "multinomial":
            ids = torch.multinomial(probs.detach(), self.k)
        elif self.draw == "randint":
            ids = torch.randint(0, self.e, (x.shape[0], self.k))
        else:
            ids = torch.stack([token_ids % self.e, (token_ids * 7 + 1) % self.e], -1)
        w = probs.gather(1, ids)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


@pytest.mark.parametrize("draw", ["multinomial", "randint", "hash"])
def test_routers_that_draw_ids_are_listed(draw):
    """Listed as router_draws, with the router named; compiled as written (matches eager)."""
    args = [make_input((12, 16)), torch.randint(0, 1000, (12,))]
    with torch._inductor.config.patch(fallback_random=True):
        check_compiled(DrawnRouterMoE(draw), args, expect_rewritten=0, expect_refused=1, seed=7, fresh_inputs=0)
    rep = moe_compile.explain(DrawnRouterMoE(draw), *args)
    assert [r.code for r in rep.refused] == ["router_draws"], str(rep)
    word = {"multinomial": "multinomial", "randint": "randint", "hash": "ids % E"}[draw]
    assert word in rep.refused[0].reason and "over 4 experts" in rep.refused[0].reason, str(rep)


class SortRouterMoE(nn.Module):
    """A top-2 router written as a sort of the scores and a slice of its first 2 (``how``), experts a
    ModuleList one or two modules down (``depth``); ``how="topk"`` is the fix the record names."""

    def __init__(self, how: str, depth: int = 1, e: int = 4, h: int = 16):
        super().__init__()
        self.how, self.e = how, e
        self.gate = nn.Linear(h, e, bias=False)
        box = nn.Module()
        box.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, 24), nn.GELU(), nn.Linear(24, h)) for _ in range(e))
        if depth == 2:
            self.box = nn.Module()
            self.box.inner = box
        else:
            self.box = box

    def forward(self, x):
        p = self.gate(x).softmax(-1)
        if self.how == "sort":
            sv, si = p.sort(-1, descending=True)
            w, ids = sv[:, :2], si[:, :2]
        elif self.how == "argsort":
            ids = p.argsort(-1, descending=True)[..., :2]
            w = p.gather(-1, ids)
        elif self.how == "narrow_ascending":   # the two smallest scores' experts
            sv, si = torch.sort(-p, dim=-1)
            w, ids = -sv.narrow(-1, 0, 2), si.narrow(-1, 0, 2)
        else:
            w, ids = p.topk(2, -1)
        experts = self.box.inner.experts if hasattr(self.box, "inner") else self.box.experts
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, w[tok, slot, None] * experts[e](x[tok]))
        return out


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("how", ["sort", "argsort", "narrow_ascending"])
def test_router_by_sort_and_slice(how, depth, monkeypatch):
    """The first k indices of a sort / argsort of the scores pick k distinct experts per token, as a top-k
    does: rewritten (outputs and gradients as eager's). With the experts two modules down no router of the
    graph was a sort: silent (review helper-71). In a form no finder knows: listed, the router named."""
    args = [make_input((12, 16))]
    check_compiled(SortRouterMoE(how, depth), args, expect_rewritten=1)
    import moe_compile.passes.loop_regions as lr

    monkeypatch.setattr(lr, "find_loop_regions", lambda gm, *a, **k: [])
    rep = moe_compile.explain(SortRouterMoE(how, depth), *args)
    path = "box.inner.experts" if depth == 2 else "box.experts"
    assert [(r.code, r.module) for r in rep.refused] == [("moe_unmatched", path)], str(rep)
    assert f"a top-2 router ({'argsort' if how == 'argsort' else 'sort'} + slice)" in rep.refused[0].reason, str(rep)


class CumsumExpertMoE(nn.Module):
    """A loop whose experts mix their rows (cumsum over the expert's tokens): not an expert function the
    rewrite replays, and torch cannot compile its captured graph (the cumsum's backward guards on the
    expert's data-dependent row count), where stock torch.compile breaks the graph and runs."""

    def __init__(self, e=4, k=2, h=16):
        super().__init__()
        self.e, self.k = e, k
        self.gate = nn.Linear(h, e, bias=False)
        self.up = nn.ModuleList(nn.Linear(h, 24, bias=False) for _ in range(e))
        self.down = nn.ModuleList(nn.Linear(24, h, bias=False) for _ in range(e))

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(self.k, -1)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, k = torch.where(ids == e)
            out.index_add_(0, tok, self.down[e](torch.tanh(self.up[e](x[tok])).cumsum(0)) * w[tok, k, None])
        return out


def test_uncompilable_captured_graph_raises_with_the_fix():
    """Was torch's bare GuardOnDataDependentSymNode; now the error names the cause, the layer explain()
    refuses with its code (the error named neither: review helper-108), and the option, and the option
    compiles the layer as stock torch.compile does (matching eager, reported)."""
    torch._dynamo.reset()
    model = CumsumExpertMoE()
    with pytest.raises(Exception, match=r"capture_compile_error(.|\n)*not rewritten: <top> \[unsupported_row_op\]: "
                                        r"unsupported op `cumsum`(.|\n)*moe\.capture_dynamic\": False"):
        torch.compile(copy.deepcopy(model), backend="moe", options=OPTS)(make_input((32, 16))).sum().backward()
    check_compiled(model, [make_input((32, 16))], expect_rewritten=0, expect_refused=1,
                   options={"moe.capture_dynamic": False})


class _ClusterAttention(nn.Module):
    """Routing-Transformer-style attention within clusters (top-1 centroid per token, one shared set of
    weights, no experts): not MoE, and torch cannot compile its captured data-dependent sizes."""

    def __init__(self, h=16, c=4):
        super().__init__()
        self.c = c
        self.centroids = nn.Parameter(torch.randn(c, h))
        self.qkv, self.o = nn.Linear(h, 3 * h), nn.Linear(h, h)

    def forward(self, x):
        cluster = (x @ self.centroids.t()).topk(1, -1).indices.squeeze(-1)
        q, k, v = self.qkv(x).chunk(3, -1)
        out = torch.zeros_like(x)
        for c in range(self.c):
            idx = torch.where(cluster == c)[0]
            out.index_add_(0, idx, (q[idx] @ k[idx].t()).softmax(-1) @ v[idx])
        return self.o(out)


def test_uncompilable_captured_graph_without_moe_code_says_so():
    """The error said the captured sizes were "in MoE code" (review helper-75): it says the graph holds none,
    and the option it names compiles the model as stock torch.compile does."""
    torch._dynamo.reset()
    model = _ClusterAttention()
    with pytest.raises(Exception, match=r"capture_compile_error(.|\n)*holds no MoE code(.|\n)*capture_dynamic\": False"):
        torch.compile(copy.deepcopy(model), backend="moe", options=OPTS)(make_input((12, 16))).sum().backward()
    check_compiled(model, [make_input((12, 16))], expect_rewritten=0, options={"moe.capture_dynamic": False})


class Mixer(nn.Module):
    """SkipEmptyMoE's code under names that say nothing of MoE (class, function, tables, source lines)."""

    def __init__(self, h=16, i=8, n=4, k=2):
        super().__init__()
        self.k = k
        self.score = nn.Linear(h, n, bias=False)
        self.table_a = nn.Parameter(torch.randn(n, h, i) / 4)
        self.table_b = nn.Parameter(torch.randn(n, i, h) / 3)

    def forward(self, x):
        p, sel = torch.topk(self.score(x).softmax(-1), self.k, dim=-1)
        sizes = torch.bincount(sel.flatten(), minlength=self.table_a.shape[0]).tolist()
        out = torch.zeros_like(x)
        for j in range(len(sizes)):
            if sizes[j] == 0:
                continue
            t, s = torch.where(sel == j)
            out.index_add_(0, t, torch.tanh(x[t] @ self.table_a[j]) @ self.table_b[j] * p[t, s, None])
        return out


def test_skipped_frame_found_by_what_the_code_does():
    """No name says MoE: the frame routes (topk) and then groups by expert before the line Dynamo gave
    up on, so the skipped frame is still listed with its fix (was: nothing listed, nothing warned)."""
    rep = moe_compile.explain(Block(Mixer()), make_input((6, 16)))
    assert [b.reason_code for b in rep.graph_breaks] == ["break_tolist"], str(rep)


def _no_op(fn):
    return fn


class NormedMixer(nn.Module):
    """Experts with a BatchNorm (a ModuleList), no MoE name anywhere: torch's batch_norm checks the
    data-dependent row count of `x[t]`, a graph break inside the loop, so Dynamo gives up on the whole
    frame and Dynamo's record names only the frame's first line. Here that is a decorator, and the
    signature runs over several lines (formatter style): the body starts after a line at the def's
    indent. (``NormedMixerSpellings`` has a plain one-line ``def``.)"""

    def __init__(self, h=16, i=8, n=4, k=2):
        super().__init__()
        self.k = k
        self.score = nn.Linear(h, n, bias=False)
        self.parts = nn.ModuleList(nn.Sequential(nn.Linear(h, i), nn.BatchNorm1d(i), nn.GELU(), nn.Linear(i, h))
                                   for _ in range(n))

    @_no_op
    def forward(
        self, x: torch.Tensor
    ) -> torch.Tensor:
        p, sel = torch.topk(self.score(x).softmax(-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for j, part in enumerate(self.parts):
            t, s = torch.where(sel == j)
            out.index_add_(0, t, part(x[t]) * p[t, s, None])
        return out


class NormedMixerSpellings(NormedMixer):
    """Other per-expert loops, under a plain one-line ``def``: ``sel.eq(j)``, Hugging Face Mixtral's one-hot
    mask, a top-1 by ``max``."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, x):
        probs = self.score(x).softmax(-1)
        if self.spelling == "top1_max":
            p, sel = probs.max(-1)
            p, sel = p[:, None], sel[:, None]
        else:
            p, sel = torch.topk(probs, self.k, dim=-1)
        mask = F.one_hot(sel, len(self.parts)).permute(2, 1, 0)
        out = torch.zeros_like(x)
        for j in range(len(self.parts)):
            if self.spelling == "one_hot":
                s, t = torch.where(mask[j])
            else:
                t, s = torch.where(sel.eq(j))
            out.index_add_(0, t, self.parts[j](x[t]) * p[t, s, None])
        return out


def _per_class_recall(logits, labels, classes=5):
    _, top = logits.topk(3, dim=-1)
    recall = []
    for c in range(classes):
        mask = labels == c                              # selects per class, but picks no expert
        recall.append((top[mask] == c).any(-1).float().mean())
        print("class", c)                               # the frame is given up as a whole
    return torch.stack(recall)


@pytest.mark.parametrize("cls", [NormedMixer, "eq_method", "one_hot", "top1_max"])
def test_frame_given_up_as_a_whole_is_found_from_its_body(cls):
    """Was silent (nothing listed, nothing warned, the layer ran eagerly): with only the skipped frame's
    first line known, its whole body is read for a router followed by a per-expert loop."""
    torch.manual_seed(0)   # 64 tokens: every expert gets 2+ rows (BatchNorm in training raises on 1)
    model = NormedMixerSpellings(cls) if isinstance(cls, str) else cls()
    rep = moe_compile.explain(model, make_input((64, 16)))
    assert len(rep.graph_breaks) == 1 and not rep.regions, str(rep)
    assert f"Dynamo gave up on the frame `{type(model).__name__}.forward`" in rep.graph_breaks[0].reason, str(rep)


def _accuracy_step(lin, x, y):
    logits = lin(x)
    correct = (logits.argmax(-1) == y).sum()
    return logits.sum() * int(correct.item())          # a graph break after an argmax and an ==


def _sample(logits, k: int):
    v, _ = torch.topk(logits, k)
    probs = torch.where(logits < v[:, -1:], -float("inf"), logits).softmax(-1)
    tok = torch.multinomial(probs, 1)
    return tok if tok.sum() > 3 else tok + 1           # a graph break on sampled ids


def _position_hash(lin, x):
    pos = torch.arange(x.shape[0]) % 4                  # positions modulo a block size, then per-block rows
    return sum(lin(x[pos == b]).sum() for b in range(4))


def _greedy_until_eos(lm, emb, ids, steps=4, eos=3):
    for _ in range(steps):
        _, cand = lm(emb(ids)[:, -1]).topk(2, dim=-1)
        ids = torch.cat([ids, cand[:, :1]], 1)
        if (ids[:, -1] == eos).all():                   # Dynamo gives up on the whole frame (a loop)
            break
    return ids, (ids == eos).nonzero()


def _knn_vote(feats, bank, labels, k=5, classes=10):
    preds = []
    for chunk in feats.split(4):
        w, idx = (chunk @ bank.t()).topk(k, dim=-1)
        print("chunk", chunk.shape[0])                  # a graph break in a loop: the frame is given up
        preds.append((F.one_hot(labels[idx], classes) * w.exp().unsqueeze(-1)).sum(1).argmax(-1))
    return torch.cat(preds)


class _ProtoKNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.protos = nn.Parameter(torch.randn(32, 8))

    def forward(self, x):
        p = F.normalize(self.protos, dim=-1)            # a table computed from a Parameter, gathered by top-k
        w, idx = (F.normalize(x, dim=-1) @ p.t()).topk(4, dim=-1)
        return (p[idx] * w.softmax(-1).unsqueeze(-1)).sum(-2)


class _KNNMemory(nn.Module):
    def __init__(self):
        super().__init__()
        self.mem, self.kp, self.vp = nn.Parameter(torch.randn(40, 8)), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, q):
        keys, vals = self.kp(self.mem), self.vp(self.mem)
        s, idx = (q @ keys.t()).topk(5, -1)
        return torch.einsum("tk,tkd->td", s.softmax(-1), vals[idx])


class _TopkKVCache(nn.Module):
    """Top-k attention over a static KV cache buffer laid out [S, heads, dh]: the ids range over S."""

    def __init__(self, s=32, nh=2, dh=4):
        super().__init__()
        self.nh, self.dh, self.q = nh, dh, nn.Linear(nh * dh, nh * dh)
        self.register_buffer("k_cache", torch.randn(s, nh, dh))
        self.register_buffer("v_cache", torch.randn(s, nh, dh))

    def forward(self, x):
        q = self.q(x).view(-1, self.nh, self.dh)
        w, idx = torch.einsum("thd,shd->ts", q, self.k_cache).topk(4, dim=-1)
        att = torch.einsum("thd,tkhd->thk", q, self.k_cache[idx]).softmax(-1)
        return torch.einsum("thk,tkhd->thd", att, self.v_cache[idx]).reshape(x.shape[0], -1)


class _ParamKNN(nn.Module):
    """A kNN read of a raw Parameter table: the rows meet only the top-k scores."""

    def __init__(self):
        super().__init__()
        self.keys, self.vals = nn.Parameter(torch.randn(20, 8)), nn.Parameter(torch.randn(20, 8))

    def forward(self, q):
        w, i = (q @ self.keys.t()).topk(3, -1)
        return (w.softmax(-1)[..., None] * self.vals[i]).sum(1)


class _MemoryLayer(nn.Module):
    """A memory layer (keys a Parameter, values an nn.Embedding): retrieval, whichever scores weight it."""

    def __init__(self, all_scores=False, pick=""):
        super().__init__()
        self.all_scores, self.pick, self.q = all_scores, pick, nn.Linear(8, 8)
        self.keys, self.values = nn.Parameter(torch.randn(32, 8)), nn.Embedding(32, 8)

    def forward(self, x):
        sc = self.q(x) @ self.keys.t()
        w, i = {"": sc, "scaled": sc / 8 ** 0.5, "detached": sc.detach(),   # the top-k over a copy of the scores
                "noisy": sc + 0.1 * torch.randn_like(sc), "masked": sc.masked_fill(self.keys[:, 0] > 2, -1e4),
                "viewed": sc.view(x.shape[0], -1), "clamped": sc.clamp(-50, 50)}[self.pick].topk(4, -1)
        if self.all_scores:                              # the weights from the scores before the top-k
            return x + torch.einsum("tk,tkd->td", sc.softmax(-1).gather(-1, i), self.values(i))
        return x + (w.softmax(-1)[..., None] * self.values(i)).sum(-2)


class _ProductKeyMemory(nn.Module):
    """Lample et al.'s product-key memory: two sub-key top-ks, a top-k of their sums, values weighted by it."""

    def __init__(self, n=4, k=2, d=8):
        super().__init__()
        self.n, self.k, self.q = n, k, nn.Linear(d, d)
        self.k1, self.k2 = nn.Parameter(torch.randn(n, d // 2)), nn.Parameter(torch.randn(n, d // 2))
        self.values = nn.Embedding(n * n, d)

    def forward(self, x):
        q1, q2 = self.q(x).chunk(2, -1)
        s1, i1 = (q1 @ self.k1.t()).topk(self.k, -1)
        s2, i2 = (q2 @ self.k2.t()).topk(self.k, -1)
        w, j = (s1[:, :, None] + s2[:, None, :]).flatten(1).topk(self.k, -1)
        ids = (i1[:, :, None] * self.n + i2[:, None, :]).flatten(1).gather(1, j)
        return x + (w.softmax(-1)[..., None] * self.values(ids)).sum(1)


class _PredictionMasks(nn.Module):
    """A classifier's masks of its own prediction, then a graph break: positives of a binary head
    (``argmax == 1``), which beam candidates are EOS (``topk(3) == 0``). Not per-expert masks. (Per-class
    masks of an argmax, ``pred[:, None] == arange(C)``, are the graph of Switch's per-expert masks and
    are listed: see _MaskThenBreak.)"""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.lin = nn.Linear(8, 10)

    def forward(self, x):
        logits = self.lin(x)
        if self.form == "binary":
            keep = logits.argmax(-1) == 1
        else:
            keep = logits.topk(3, -1)[1] == 0                 # crosses the break as it is
            print("step")
            return logits.sum(-1) * keep.any(-1)
        print("step")
        return logits.sum(-1) * keep


def _select_correct(lin, x, y):
    keep = x[lin(x).argmax(-1) == y]                    # the rows a prediction got right, through the same Linear
    return lin(keep).sum()


class _ClassActivationMap(nn.Module):
    """The classifier's own weight row of its argmax class, applied to the features (CAM)."""

    def __init__(self):
        super().__init__()
        self.feat, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 5)

    def forward(self, img):
        f = self.feat(img)
        c = self.fc(f.mean((2, 3))).argmax(-1)
        return torch.einsum("bc,bchw->bhw", self.fc.weight[c], f)


def _topk_kv_cache_arguments(x, wq, k_cache, v_cache):
    """_TopkKVCache as a function: the caches [S, heads, dh] are arguments, gathered by the top-k ids."""
    q = (x @ wq).view(x.shape[0], k_cache.shape[1], -1)
    _, idx = torch.einsum("thd,shd->ts", q, k_cache).topk(4, dim=-1)
    att = torch.einsum("thd,tkhd->thk", q, k_cache[idx]).softmax(-1)
    return torch.einsum("thk,tkhd->thd", att, v_cache[idx]).reshape(x.shape[0], -1)


def _per_head_topk_arguments(q, k_cache, v_cache):
    """Top-k attention per head over caches [heads, S, dh] passed as arguments: constant slices ``k_cache[h]``
    a matmul reads, as a per-expert loop over stacked weights would take them, but the ids range over S."""
    out = []
    for h in range(k_cache.shape[0]):
        w, i = (q[:, h] @ k_cache[h].t()).topk(4, dim=-1)
        out.append((w.softmax(-1)[..., None] * v_cache[h][i]).sum(1))
    return torch.stack(out, 1)


class _KnnAttention(nn.Module):
    """Memorizing Transformers' kNN attention: the top-k memory keys nearest the query, gathered as
    ``nn.Embedding`` rows (``by_index``: ``weight[ids]``), softmax attention over them (review helper-68)."""

    def __init__(self, by_index=False, n=32, k=4):
        super().__init__()
        self.by_index, self.k = by_index, k
        self.wq, self.mem_k, self.mem_v = nn.Linear(8, 8), nn.Embedding(n, 8), nn.Embedding(n, 8)

    def forward(self, x):
        q = self.wq(x)
        _, ids = (q @ self.mem_k.weight.t()).topk(self.k, -1)
        kk, vv = (self.mem_k.weight[ids], self.mem_v.weight[ids]) if self.by_index else (self.mem_k(ids), self.mem_v(ids))
        att = torch.matmul(kk, q.unsqueeze(-1)).squeeze(-1).div(8 ** 0.5).softmax(-1)
        return torch.matmul(att.unsqueeze(1), vv).squeeze(1)


class _VectorExpertsWithKeyBias(nn.Module):
    """PEER-style vector experts (``down(ids)`` and ``up(ids)`` meeting the token) whose router also gathers a
    table its scores read: centroids ``emb`` (scores ``x @ emb.weight.t()``, ``emb(ids)`` added as a bias), or
    the gate's own weight (``F.embedding(ids, gate.weight)``)."""

    def __init__(self, keys):
        super().__init__()
        torch.manual_seed(0)
        self.keys = keys
        self.gate, self.emb = nn.Linear(16, 8, bias=False), nn.Embedding(8, 16)
        self.down, self.up = nn.Embedding(8, 16), nn.Embedding(8, 16)

    def forward(self, x):
        table = self.emb.weight if self.keys == "centroids" else self.gate.weight
        s, ids = (x @ table.t()).topk(2, -1)
        w = s.softmax(-1)
        h = F.gelu(torch.einsum("th,tkh->tk", x, self.down(ids))) * w
        return torch.einsum("tk,tkh->th", h, self.up(ids)) + (w[..., None] * F.embedding(ids, table)).sum(1)


@pytest.mark.parametrize("keys", ["centroids", "gate_weight"])
def test_vector_experts_whose_router_gathers_its_keys_are_listed(keys):
    """The kNN exclusion (a router whose ids gather a table its scores read) first dropped every gathered
    table of such a router: these layers went unlisted (review helper-71). Only the key rows, and what is
    computed from them, are excluded now."""
    torch._dynamo.reset()
    rep = moe_compile.explain(_VectorExpertsWithKeyBias(keys), torch.randn(12, 16))
    assert [r.code for r in rep.refused] == ["retrieval_experts"], str(rep)


def _recall_at_topk(logits, y):                         # named *topk*, syncs: a metric, not a router
    return (logits.topk(2, -1).indices == y[:, None]).any(-1).float().sum().item()


_NOT_MOE = ["accuracy", "sampler", "position_hash", "greedy_until_eos", "knn_vote", "proto_knn", "knn_memory",
            "topk_kv_cache", "per_class_recall", "param_knn", "memory_layer", "memory_layer_all_scores",
            "select_correct", "class_activation_map", "topk_named_metric", "product_key_memory",
            "memory_layer_scaled_topk", "memory_layer_detached_topk", "memory_layer_noisy_topk",
            "memory_layer_masked_topk", "memory_layer_viewed_topk", "memory_layer_clamped_topk",
            "binary_positives", "beam_eos", "topk_kv_cache_arguments", "per_head_topk_arguments", "knn_attention",
            "knn_attention_by_index"]


@pytest.mark.parametrize("case", _NOT_MOE)
def test_code_that_is_not_moe_is_not_reported(case):
    """No MoE record and no MoE graph break for code that only resembles routing (an accuracy count, a
    top-k sampler, positions modulo a block size, frames Dynamo gives up on whole after a top-k and a
    nonzero / one_hot, kNN lookups in tables computed from Parameters): the name-free checks stay narrow.
    Since the token-path rule (passes/token_paths.py): memory layers and kNN reads of raw Parameters
    (rows that meet only the top-k scores), a classifier's own weight reused after its argmax (CAM,
    rows it got right fed through it again); and a metric named *topk* that syncs."""
    lin = nn.Linear(8, 5)
    fn, args = {"accuracy": (_accuracy_step, (lin, torch.randn(4, 8), torch.randint(0, 5, (4,)))),
                "sampler": (_sample, (torch.randn(2, 10), 3)),
                "position_hash": (_position_hash, (nn.Linear(8, 8), torch.randn(12, 8))),
                "greedy_until_eos": (_greedy_until_eos, (nn.Linear(8, 10), nn.Embedding(10, 8),
                                                         torch.randint(0, 10, (2, 3)))),
                "knn_vote": (_knn_vote, (torch.randn(8, 8), torch.randn(20, 8), torch.randint(0, 10, (20,)))),
                "proto_knn": (_ProtoKNN(), (torch.randn(6, 8),)),
                "knn_memory": (_KNNMemory(), (torch.randn(6, 8),)),
                "topk_kv_cache": (_TopkKVCache(), (torch.randn(6, 8),)),
                "per_class_recall": (_per_class_recall, (torch.randn(8, 5), torch.randint(0, 5, (8,)))),
                "param_knn": (_ParamKNN(), (torch.randn(6, 8),)),
                "memory_layer": (_MemoryLayer(), (torch.randn(6, 8),)),
                "memory_layer_all_scores": (_MemoryLayer(all_scores=True), (torch.randn(6, 8),)),
                "select_correct": (_select_correct, (nn.Linear(8, 8), torch.randn(6, 8), torch.randint(0, 8, (6,)))),
                "class_activation_map": (_ClassActivationMap(), (torch.randn(2, 3, 6, 6),)),
                "topk_named_metric": (_recall_at_topk, (torch.randn(6, 5), torch.randint(0, 5, (6,)))),
                "product_key_memory": (_ProductKeyMemory(), (torch.randn(6, 8),)),
                **{f"memory_layer_{p}_topk": (_MemoryLayer(all_scores=True, pick=p), (torch.randn(6, 8),))
                   for p in ("scaled", "detached", "noisy", "masked", "viewed", "clamped")},
                "topk_kv_cache_arguments": (_topk_kv_cache_arguments, (torch.randn(6, 8), torch.randn(8, 8),
                                                                       torch.randn(32, 2, 4), torch.randn(32, 2, 4))),
                "per_head_topk_arguments": (_per_head_topk_arguments, (torch.randn(6, 2, 4), torch.randn(2, 32, 4),
                                                                       torch.randn(2, 32, 4))),
                "binary_positives": (_PredictionMasks("binary"), (torch.randn(6, 8),)),
                "beam_eos": (_PredictionMasks("beam_eos"), (torch.randn(6, 8),)),
                "knn_attention": (_KnnAttention(), (torch.randn(6, 8),)),
                "knn_attention_by_index": (_KnnAttention(by_index=True), (torch.randn(6, 8),))}[case]
    rep = moe_compile.explain(fn, *args)
    assert not rep.refused and not rep.graph_breaks, str(rep)


# ------------------------------------------------------------------ experts Dynamo ran eagerly
class _StackedLoopExperts(nn.Module):
    def __init__(self, e=4, h=8, i=6):
        super().__init__()
        self.e = e
        self.w1 = nn.Parameter(torch.randn(e, h, i) / h ** 0.5)
        self.w2 = nn.Parameter(torch.randn(e, i, h) / i ** 0.5)

    def forward(self, x, ids, w):
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, (F.silu(x[tok] @ self.w1[e]) @ self.w2[e]) * w[tok, slot, None])
        return out


class _Block(nn.Module):
    def __init__(self, graph_break):
        super().__init__()
        self.graph_break = graph_break
        self.attn = nn.Linear(8, 8)
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = _StackedLoopExperts()

    def forward(self, x):
        h = self.attn(x)
        if self.graph_break:
            torch._dynamo.graph_break()   # outside the MoE code, as a print or an unsupported call would be
        w, ids = self.router(h).softmax(-1).topk(2, dim=-1)
        return h + self.experts(h, ids, w)


class _CheckpointedModel(nn.Module):
    def __init__(self, graph_break, checkpoint=True):
        super().__init__()
        self.checkpoint = checkpoint
        self.layers = nn.ModuleList([_Block(graph_break), _Block(False)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if self.checkpoint else layer(x)
        return x


def test_experts_dynamo_ran_eagerly_are_listed():
    """A graph break outside the MoE code but inside activation checkpointing makes Dynamo run the
    checkpointed calls eagerly: no graph reaches the backend, and explain listed nothing. Each such
    experts module is now refused with ran_eagerly, its reason and fix; the probes' hooks are gone
    afterwards. Without the break (and without checkpointing) the layers are rewritten, no ran_eagerly."""
    x = torch.randn(5, 8)
    model = _CheckpointedModel(graph_break=True)
    torch._dynamo.reset()
    rep = moe_compile.explain(model, x)
    eager = {r.module: r for r in rep.refused if r.code == "ran_eagerly"}
    assert set(eager) == {"layers.0.experts", "layers.1.experts"} and not rep.rewritten, str(rep)
    assert "ran eagerly under torch.compile" in eager["layers.0.experts"].reason
    assert "activation checkpointing" in eager["layers.0.experts"].fix and "compile_blocks" in eager["layers.0.experts"].fix
    assert not any(m._forward_pre_hooks for m in model.modules()), "explain left its probes on the model"
    for kw in ({"graph_break": False}, {"graph_break": True, "checkpoint": False}):
        torch._dynamo.reset()
        rep = moe_compile.explain(_CheckpointedModel(**kw), x)
        # with the break, layer 0's graph is compiled for its nested frame: each layer still one record
        assert [r.module for r in rep.rewritten] == ["layers.0.experts", "layers.1.experts"] and not rep.refused, f"{kw}: {rep}"


class _BreakingExperts(_StackedLoopExperts):
    def forward(self, x, ids, w):
        torch._dynamo.graph_break()   # in the MoE code: its own break record names it
        return super().forward(x, ids, w)


def test_experts_run_eagerly_by_a_break_in_moe_code_are_listed_once():
    """A graph break inside the experts under checkpointing: the break record (in MoE code) says why
    and how to fix it; no second, vaguer ran_eagerly record for the same module."""
    model = _CheckpointedModel(graph_break=False)
    model.layers[0].experts.__class__ = _BreakingExperts
    torch._dynamo.reset()
    rep = moe_compile.explain(model, torch.randn(5, 8))
    assert rep.graph_breaks, str(rep)
    # layer 1 has no break of its own: it ran eagerly because layer 0's break made Dynamo give up the frame
    assert {r.module for r in rep.refused if r.code == "ran_eagerly"} == {"layers.1.experts"}, str(rep)


def test_probes_cost_the_compiled_model_no_recompile():
    """explain's probes (forward pre-hooks on 3-D expert containers, added and removed) do not make a
    model compiled before recompile."""
    model = _CheckpointedModel(graph_break=False)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe", options=OPTS)
    compiled(torch.randn(5, 8))
    for _ in range(3):
        assert len(moe_compile.explain(compiled, torch.randn(5, 8)).rewritten) == 2
    frames = torch._dynamo.utils.counters["frames"]["total"]
    compiled(torch.randn(5, 8))
    assert torch._dynamo.utils.counters["frames"]["total"] == frames, "the compiled model recompiled after explain"


class _ListExpertsBlock(nn.Module):
    """ModuleList experts called by the block's loop over a host list of the experts that got tokens."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList([SwiGLU(8, 6) for _ in range(4)])

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():   # the block's own graph break (break_tolist)
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


def test_list_experts_run_eagerly_by_their_blocks_break_are_listed_once():
    """The break sits in the block that calls the ModuleList experts (not in the experts' class): its
    record says why; no ran_eagerly record beside it."""
    model = nn.Sequential(_ListExpertsBlock(), _ListExpertsBlock())

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = model

        def forward(self, x):
            for layer in self.layers:
                x = x + torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            return x

    torch._dynamo.reset()
    rep = moe_compile.explain(Checkpointed(), torch.randn(5, 8))
    assert [b.reason_code for b in rep.graph_breaks] == ["break_tolist"], str(rep)
    assert not [r for r in rep.refused if r.code == "ran_eagerly"], str(rep)


class _LoopBreakAboveCheckpoints(nn.Module):
    """A graph break in the model's own loop, outside MoE code, over checkpointed MoE layers: Dynamo
    gives up on the whole forward, and torch.utils.checkpoint runs each layer with Dynamo off, so no
    MoE layer reaches a graph. The compile's one warning used to say no MoE layer was found."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([make_model(spelling="index_add", e=4, k=2) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            torch._dynamo.graph_break()
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return x


def test_nothing_rewritten_names_the_frame_dynamo_gave_up_on(caplog):
    """The nothing-rewritten warning names the frame Dynamo gave up on outside MoE code (where, and its
    reason), once; explain lists the layers that ran eagerly."""
    torch._dynamo.reset()
    model = _LoopBreakAboveCheckpoints()
    x = make_input((2, 5, 16))
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        for _ in range(2):
            compiled(x)
    (message,) = _nothing(caplog)
    assert "no graph reached the backend: Dynamo gave up on `_LoopBreakAboveCheckpoints.forward`" in message
    assert "torch._dynamo.graph_break()" in message and "ran eagerly" in message, message
    report = moe_compile.explain(model, x)
    assert [r.code for r in report.refused] == ["ran_eagerly", "ran_eagerly"], str(report)


class _DenseBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.lin(x).relu()


class _DenseLoopBreak(nn.Module):
    """No MoE at all, a graph break in its own loop: Dynamo gives up on the forward and compiles
    each block's frame on its own (graphs reach the backend)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_DenseBlock(), _DenseBlock()])

    def forward(self, x):
        for layer in self.layers:
            torch._dynamo.graph_break()
            x = layer(x)
        return x


def test_nothing_rewritten_names_no_frame_when_graphs_were_compiled(caplog):
    """Found by a review: the new wording blamed a skipped frame even though graphs reached the backend
    (here the blocks' frames; elsewhere another torch.compile's frame). Frames are named only when no
    graph reached the backend in the call."""
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        torch.compile(_DenseLoopBreak(), backend="moe", options={"moe.inductor": False})(torch.randn(4, 16))
    (message,) = _nothing(caplog)
    assert "no MoE layer was found in the compiled graphs" in message and "gave up on" not in message, message


class _ListExpertsRouting(nn.Module):
    """ModuleList experts routed in ways no finder rewrites (found silent by an adversarial review):
    ``expert_choice``: each expert takes its top-c tokens (a top-k over the token dim);
    ``dense_loop``: every expert on every token, each output weighted by its column of a top-k routing
    matrix. Both compiled into one graph with no record and no graph break before."""

    def __init__(self, kind: str, h: int = 16, e: int = 4):
        super().__init__()
        self.kind = kind
        self.router = nn.Linear(h, e)
        self.experts = nn.ModuleList([SwiGLU(h, 8) for _ in range(e)])

    def forward(self, x):
        s = F.softmax(self.router(x), -1)
        out = torch.zeros_like(x)
        if self.kind == "expert_choice":
            wv, tok = s.topk(x.shape[0] // 2, dim=0)
            for e, expert in enumerate(self.experts):
                out.index_add_(0, tok[:, e], wv[:, e, None] * expert(x[tok[:, e]]))
            return out
        w, ids = s.topk(2, -1)
        r = torch.zeros_like(s).scatter(1, ids, w / w.sum(-1, keepdim=True))
        for e, expert in enumerate(self.experts):
            out = out + r[:, e, None] * expert(x)
        return out


@pytest.mark.parametrize("kind, words", [("expert_choice", "an expert-choice router (each expert takes its top-8"),
                                         ("dense_loop", "a top-2 router over 4 experts")])
def test_module_list_experts_routed_another_way_are_listed(kind, words):
    """Refused as moe_unmatched with the router named and the ModuleList experts as evidence; values as
    eager's (nothing rewritten)."""
    torch._dynamo.reset()
    rep = moe_compile.explain(_ListExpertsRouting(kind), make_input((16, 16)))
    assert [r.code for r in rep.refused] == ["moe_unmatched"] and not rep.rewritten, str(rep)
    assert words in rep.refused[0].reason and "nn.ModuleList experts' linears" in rep.refused[0].reason, str(rep)
    check_compiled(_ListExpertsRouting(kind), [make_input((16, 16))], expect_rewritten=0, expect_refused=1,
                   fresh_inputs=0)


# ------------------------------------------------- expert sets gated per expert without a top-k router
class _Unrouted(nn.Module):
    """A rewritable top-2 layer (``good``) beside a layer whose experts are selected per expert without a
    top-k router (found silent by a review: no record, and no "nothing rewritten" warning since ``good`` is
    rewritten): threshold / top-p routing, hash routing (a table, a bit-and, an LSH, a hash of the hidden
    state; a loop over the experts, or each token's weights gathered by its ids), a checkpointed expert loop given the ids, every expert weighted by the scores (einsum, a
    ModuleList, Soft MoE slots), expert choice with stacked weights."""

    def __init__(self, form, h=16, i=32, e=4):
        super().__init__()
        torch.manual_seed(0)
        self.form, self.e = form, e
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, i), nn.GELU(), nn.Linear(i, h)) for _ in range(e))
        self.w1, self.w2 = nn.Parameter(torch.randn(e, h, i) / 4), nn.Parameter(torch.randn(e, i, h) / 5)
        self.phi = nn.Parameter(torch.randn(h, e) / 4)
        self.register_buffer("table", torch.randint(0, e, (100,), generator=torch.Generator().manual_seed(5)))
        self.register_buffer("proj", torch.randn(h, 2, generator=torch.Generator().manual_seed(6)))

    def _loop(self, x, eid):
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok = (eid == e).nonzero().squeeze(-1)
            out[tok] = self.experts[e](x[tok])
        return out

    def _dense(self, x, r):
        h = F.gelu(torch.einsum("th,ehi->eti", x, self.w1))
        return torch.einsum("eth,te->th", torch.einsum("eti,eih->eth", h, self.w2), r)

    def _body(self, x, w, ids):
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, w[tok, slot, None] * self.experts[e](x[tok]))
        return out

    def forward(self, x, ids):
        f, p = self.form, self.gate(x).softmax(-1)
        if f in ("threshold", "top_p"):
            if f == "top_p":
                sp, si = p.sort(-1, descending=True)
                keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, si, (sp.cumsum(-1) - sp) < 0.6)
            out = torch.zeros_like(x)
            for e in range(self.e):
                tok = ((p[:, e] > 0.2) if f == "threshold" else keep[:, e]).nonzero().squeeze(-1)
                out.index_add_(0, tok, p[tok, e, None] * self.experts[e](x[tok]))
            return out
        if f == "hash_table":
            return self._loop(x, self.table[ids])
        if f == "hash_bitand":
            return self._loop(x, (ids * 2654435761) & (self.e - 1))
        if f == "hash_lsh":
            bits = (x @ self.proj > 0).long()
            return self._loop(x, bits[:, 0] * 2 + bits[:, 1])
        if f == "hash_hidden":
            return self._loop(x, (x.detach().abs().sum(-1) * 1000).long() % self.e)
        if f == "hash_offset":       # expert e takes the tokens of number e + 1
            eid, out = self.table[ids], torch.zeros_like(x)
            for e in range(self.e):
                m = eid == (e + 1) % self.e
                out[m] = self.experts[e](x[m])
            return out
        if f == "hash_enumerate_from_1":
            eid, out = self.table[ids] + 1, torch.zeros_like(x)
            for i, expert in enumerate(self.experts, start=1):
                m = eid == i
                out[m] = expert(x[m])
            return out
        if f == "hash_gather":       # each token's expert weights gathered by its table ids (DeepSeek-V4's hash layers)
            eid = self.table[ids]
            h = F.gelu(torch.bmm(x.unsqueeze(1), self.w1[eid]))
            return torch.bmm(h, self.w2[eid]).squeeze(1)
        if f == "hash_gather_index_select":
            eid = (x.detach().abs().sum(-1) * 1000).long() & (self.e - 1)
            h = F.gelu(torch.einsum("th,thi->ti", x, self.w1.index_select(0, eid)))
            return torch.einsum("ti,tih->th", h, self.w2.index_select(0, eid))
        if f in ("checkpoint", "checkpoint_reentrant"):
            w, top = p.topk(2, -1)
            return torch.utils.checkpoint.checkpoint(self._body, x, w, top, use_reentrant=f != "checkpoint")
        if f == "dense_soft":
            return self._dense(x, p)
        if f == "dense_threshold":
            return self._dense(x, p * (p > 0.2))
        if f == "dense_topk_mask":
            return self._dense(x, p * (p >= p.topk(2, -1).values[:, -1:]))
        if f == "list_soft":
            return sum(p[:, e, None] * self.experts[e](x) for e in range(self.e))
        if f == "slots":
            logits = x @ self.phi
            slots = logits.softmax(0).t() @ x
            return logits.softmax(1) @ torch.stack([self.experts[e](slots[e]) for e in range(self.e)])
        cap = x.shape[0] * 2 // self.e      # expert choice, stacked weights: top-k over the tokens
        g, tok = p.t().topk(cap, dim=-1) if f == "expert_choice_t" else [a.t() for a in p.topk(cap, dim=0)]
        y = torch.bmm(F.gelu(torch.bmm(x[tok], self.w1)), self.w2) * g[..., None]
        return torch.zeros_like(x).index_add(0, tok.reshape(-1), y.reshape(-1, x.shape[-1]))


class _GoodAndGap(nn.Module):
    def __init__(self, gap):
        super().__init__()
        self.good, self.gap = make_model(spelling="index_add", e=4, k=2), gap

    def forward(self, x, ids):
        x = x + self.good(x)
        return x + self.gap(x, ids)


_UNROUTED = {"threshold": "moe_unmatched", "top_p": "moe_unmatched", "hash_table": "router_draws",
             "hash_bitand": "router_draws", "hash_lsh": "router_draws", "hash_hidden": "router_draws",
             "hash_offset": "router_draws", "hash_enumerate_from_1": "router_draws", "hash_gather": "router_draws", "hash_gather_index_select": "router_draws",
             "checkpoint": "ids_outside", "checkpoint_reentrant": "ids_outside", "dense_soft": "soft_moe",
             "dense_threshold": "soft_moe", "dense_topk_mask": "routing_matrix_form", "list_soft": "soft_moe",
             "slots": "soft_moe", "expert_choice": "moe_unmatched", "expert_choice_t": "moe_unmatched"}


@pytest.mark.parametrize("form", list(_UNROUTED))
def test_experts_selected_without_a_topk_router_are_listed(form, caplog):
    """Was silent: the scan started from top-k / argmax / drawn ids only. Now also from the experts: a
    per-expert selection (column e of the gate's [T, E] scores, or ids compared with each expert number)
    gating the inputs or outputs of two or more experts (ModuleList elements, W[e], a bmm / einsum on W)
    is listed; expert choice over stacked weights reads E from the score's expert dim."""
    model = _GoodAndGap(_Unrouted(form))
    args = (make_input((24, 16)), torch.randint(0, 100, (24,), generator=torch.Generator().manual_seed(2)))
    torch._dynamo.reset()
    rep = moe_compile.explain(model, *args)
    assert [r.code for r in rep.refused] == [_UNROUTED[form]] and rep.refused[0].module == "gap", str(rep)
    assert [r.module for r in rep.rewritten] == ["good"] and rep.refused[0].fix, str(rep)
    if form.startswith("expert_choice"):
        assert "each expert takes its top-12 tokens) over 4 experts" in rep.refused[0].reason, str(rep)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        torch.compile(model, backend="moe", options=OPTS)(*args)
    warned = _warnings(caplog, _UNROUTED[form])
    assert len(warned) == 1 and "region gap" in warned[0], caplog.text


class _MixtureOfDepths(nn.Module):
    """Mixture-of-Depths: the top-k tokens by a score through one dense MLP, an nn.Sequential (its
    children are numbered ``mlp.0`` / ``mlp.2`` as a ModuleList's elements are)."""

    def __init__(self, k=4):
        super().__init__()
        self.k = k
        self.score = nn.Linear(16, 1)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))

    def forward(self, x):
        w, ids = self.score(x).squeeze(-1).topk(self.k)
        return x.index_add(0, ids, self.mlp(x[ids]) * w.sigmoid().unsqueeze(-1))


def test_one_sequential_mlp_on_top_k_tokens_is_not_moe():
    """Was listed moe_unmatched ("a top-4 router over 8 experts ... the nn.ModuleList experts' linears";
    review helper-68): an nn.Sequential's numbered children counted as list elements."""
    torch._dynamo.reset()
    rep = moe_compile.explain(_MixtureOfDepths(), make_input((8, 16)))
    assert not rep.regions, str(rep)


class _LayersOnTopTokens(nn.Module):
    """A ModuleList of layers run one after the other on rows a top-k picks, not experts side by side:
    token pruning (the top half of the tokens by a score through a stack of blocks), top-k graph pooling
    (a stack of layers on the kept nodes), residual VQ (per stage a codebook row by its top-1, projected by
    that stage's linear; the next stage's ids read the residual)."""

    def __init__(self, kind, h=16):
        super().__init__()
        self.kind = kind
        self.score = nn.Linear(h, 1)
        self.blocks = nn.ModuleList(nn.Linear(h, h) for _ in range(3))
        self.codebooks = nn.ModuleList(nn.Embedding(8, h) for _ in range(3))

    def forward(self, x):
        if self.kind == "residual_vq":
            r, out = x, 0
            for cb, proj in zip(self.codebooks, self.blocks):
                q = proj(cb(torch.topk(r @ cb.weight.t(), 1, -1).indices.squeeze(-1)))
                out, r = out + q, r - q
            return out
        v, idx = self.score(x).squeeze(-1).topk(x.shape[0] // 2)
        y = x[idx] * (torch.sigmoid(v)[:, None] if self.kind == "pooling" else 1.0)
        for blk in self.blocks:
            y = y + F.gelu(blk(y)) if self.kind == "pruning" else F.relu(blk(y))
        if self.kind == "pooling":
            return y.mean(0)
        return x.index_copy(0, idx, y)


@pytest.mark.parametrize("kind", ["pruning", "pooling", "residual_vq"])
def test_layers_run_one_after_the_other_on_top_k_rows_are_not_moe(kind, caplog):
    """Were listed moe_unmatched and warned ("a top-6 router over 12 experts": the token count; review
    helper-75): the list elements' matmuls read each other's outputs, or the ids reach one element."""
    torch._dynamo.reset()
    x = make_input((12, 16))
    rep = moe_compile.explain(_LayersOnTopTokens(kind), x)
    assert not rep.regions, str(rep)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        torch.compile(_LayersOnTopTokens(kind), backend="moe", options=OPTS)(x)
    assert not [m for m in _moe_warnings(caplog) if "refused" in m], caplog.text


class _ExpertChoiceInPlaceResidual(nn.Module):
    """Expert-choice routing (a form nothing rewrites), its output added to the residual in place after
    every expert ran (``h += out``)."""

    def __init__(self, h=16, e=4):
        super().__init__()
        self.e = e
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, 8), nn.GELU(), nn.Linear(8, h)) for _ in range(e))

    def forward(self, x):
        h = x + 0
        z = h * 1.0
        g, tok = self.gate(z).softmax(-1).t().topk(h.shape[0] // 2, -1)   # each expert's top tokens [E, C]
        out = torch.zeros_like(h)
        for e in range(self.e):
            out = out.index_add(0, tok[e], g[e, :, None] * self.experts[e](z[tok[e]]))
        h += out
        return h


class _CapacityBufferParamList(nn.Module):
    """Top-2 capacity dispatch into a buffer [E, C, H] (index_put, or a scatter into its [E * C, H] view),
    experts nn.ParameterList matrices applied to buf[e]: only the per-expert selection's rows say MoE."""

    def __init__(self, dispatch, h=16, i=8, e=4):
        super().__init__()
        self.dispatch, self.e = dispatch, e
        self.gate = nn.Linear(h, e, bias=False)
        self.w1 = nn.ParameterList(nn.Parameter(torch.randn(i, h) / 4) for _ in range(e))
        self.w2 = nn.ParameterList(nn.Parameter(torch.randn(h, i) / 3) for _ in range(e))

    def forward(self, x):
        t, hd = x.shape
        w, ids = self.gate(x).softmax(-1).topk(2, -1)
        fid = ids.reshape(-1)
        pos = (F.one_hot(fid, self.e).cumsum(0) - 1).gather(1, fid[:, None]).squeeze(1)   # slot in its expert
        buf = x.new_zeros(self.e, t, hd)
        if self.dispatch == "index_put":
            buf = buf.index_put((fid, pos), x.repeat_interleave(2, 0))
        else:
            flat = (fid * t + pos)[:, None].expand(-1, hd)
            buf = buf.view(self.e * t, hd).scatter(0, flat, x.repeat_interleave(2, 0)).view(self.e, t, hd)
        ob = torch.stack([F.linear(F.gelu(F.linear(buf[e], self.w1[e])), self.w2[e]) for e in range(self.e)])
        return (ob[fid, pos].view(t, 2, hd) * w[..., None]).sum(1)


@pytest.mark.parametrize("model", ["expert_choice_inplace_residual", "capacity_index_put", "capacity_scatter"])
def test_real_moe_stays_listed_beside_the_layer_stack_rules(model):
    """Review helper-77 of the layer-stack and combine rules above: an in-place residual written after every
    expert made the experts look chained; a dispatch write into a per-expert buffer stopped the selection's
    rows as a combine would. Both silent for a moment; listed moe_unmatched."""
    torch._dynamo.reset()
    m = _ExpertChoiceInPlaceResidual() if model.startswith("expert") else _CapacityBufferParamList(model.split("_", 1)[1])
    rep = moe_compile.explain(m, make_input((8, 16)))
    assert [r.code for r in rep.refused] == ["moe_unmatched"], str(rep)


class _CheckpointedLoopAtRoot(nn.Module):
    """The block compiled on its own (the root module): its router outside the checkpoint, the expert
    loop a method given the ids, the ModuleList two modules down (``self.box.inner.experts``)."""

    def __init__(self, e=4, ids="topk"):
        super().__init__()
        self.e, self.ids = e, ids
        self.gate = nn.Linear(16, e, bias=False)
        self.box = nn.Module()
        self.box.inner = nn.Module()
        self.box.inner.experts = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                                               for _ in range(e))

    def _body(self, x, w, ids):
        out = torch.zeros_like(x)
        ids, w = ids.view(x.shape[0], -1), w.view(x.shape[0], -1)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, w[tok, slot, None] * self.box.inner.experts[e](x[tok]))
        return out

    def forward(self, x):
        p = self.gate(x).softmax(-1)
        if self.ids == "argmax":   # Switch's top-1
            ids = p.argmax(-1)
            w = p.gather(-1, ids[:, None])
        elif self.ids == "sorted":   # the first two of a sort
            w, ids = p.sort(-1, descending=True)
            w, ids = w[:, :2], ids[:, :2]
        else:
            w, ids = p.topk(2, -1)
            if self.ids == "dropped":   # a capacity drop: -1 for dropped slots
                ids = torch.where(w > 0.3, ids, -1)
        return torch.utils.checkpoint.checkpoint(self._body, x, w, ids, use_reentrant=False)


@pytest.mark.parametrize("ids", ["topk", "argmax", "sorted", "dropped"])
def test_checkpointed_expert_loop_of_the_root_block_is_listed(ids):
    """The body's nodes belong to no module (path ''), the experts to ``box.inner.experts``: the selections
    were dropped as outside the experts' block, and nothing was listed (0 rewritten, 0 refused; review
    helper-62). The caller hands the body a router's indices (a top-k's; an argmax, a sort's first two, ids
    with dropped slots set to -1: review helper-71): comparisons of those count wherever they sit."""
    torch._dynamo.reset()
    rep = moe_compile.explain(_CheckpointedLoopAtRoot(ids=ids), make_input((24, 16)))
    assert [(r.module, r.code) for r in rep.refused] == [("box.inner.experts", "ids_outside")], str(rep)


class _TaskHeads(nn.Module):
    """A multi-task model: task ids given as an input pick a head three modules down
    (``model.heads.heads[t]``), in the root block's forward or in a checkpointed method of it. Not MoE:
    the ids come from no router (review helper-67)."""

    def __init__(self, checkpointed):
        super().__init__()
        self.checkpointed = checkpointed
        self.model = nn.Module()
        self.model.heads = nn.Module()
        self.model.heads.heads = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def _body(self, x, task):
        out = torch.zeros_like(x)
        for t in range(3):
            rows = torch.where(task == t)[0]
            out = out.index_add(0, rows, self.model.heads.heads[t](x[rows]))
        return out

    def forward(self, x, task):
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self._body, x, task, use_reentrant=False)
        return self._body(x, task)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_task_ids_given_as_input_picking_nested_heads_are_not_listed(checkpointed):
    torch._dynamo.reset()
    task = torch.arange(24) % 3
    rep = moe_compile.explain(_TaskHeads(checkpointed), make_input((24, 16)), task)
    assert not rep.refused and not rep.rewritten, str(rep)


def test_module_list_expert_choice_on_transposed_scores_counts_the_experts():
    """The top-k over the last dim of the transposed [E, T] scores: 4 experts (was "over 16 experts")."""
    class _T(_ListExpertsRouting):
        def forward(self, x):
            wv, tok = F.softmax(self.router(x), -1).t().topk(x.shape[0] // 2, dim=-1)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                out.index_add_(0, tok[e], wv[e, :, None] * expert(x[tok[e]]))
            return out

    torch._dynamo.reset()
    rep = moe_compile.explain(_T("expert_choice"), make_input((16, 16)))
    assert [r.code for r in rep.refused] == ["moe_unmatched"], str(rep)
    assert "top-8 tokens) over 4 experts" in rep.refused[0].reason, str(rep)


class _NotMoE(nn.Module):
    """Look-alikes with no expert selection: per-head ModuleList projections on slices of the heads,
    stacked per-head weights under softmax attention, a gated MLP, a grouped linear on chunks, a
    classifier's top-k after a ModuleList of layers, modality heads picked by a constant."""

    def __init__(self, form, h=16, n=4):
        super().__init__()
        torch.manual_seed(0)
        self.form, self.n = form, n
        self.q = nn.Linear(h, h)
        self.heads = nn.ModuleList(nn.Linear(h // n, h // n) for _ in range(n))
        self.wv = nn.Parameter(torch.randn(n, h, h // n) / 4)
        self.gate, self.up, self.down = nn.Linear(h, 32), nn.Linear(h, 32), nn.Linear(32, h)
        self.layers = nn.ModuleList(nn.Linear(h, h) for _ in range(2))
        self.cls = nn.Linear(h, n)
        self.register_buffer("perm", torch.arange(n).flip(0))

    def forward(self, x):
        t, h = x.shape
        if self.form == "list_heads":
            q = self.q(x).view(t, self.n, -1)
            return torch.cat([self.heads[i](q[:, i]) for i in range(self.n)], -1)
        if self.form == "stacked_heads":
            v = torch.einsum("th,nhd->ntd", x, self.wv)
            att = torch.einsum("th,sh->ts", x, x).softmax(-1)
            return torch.einsum("ts,nsd->tnd", att, v).reshape(t, -1)
        if self.form == "every_head_gathered":    # W[arange(n)]: every head, not ids computed from the input
            return torch.einsum("th,nhd->tnd", x, self.wv[torch.arange(self.n)]).reshape(t, -1)
        if self.form == "every_head_by_a_buffer":    # W[perm] of a buffer: every head, permuted
            return torch.einsum("th,nhd->tnd", x, self.wv[self.perm]).reshape(t, -1)
        if self.form == "two_groups_every_head":    # rows picked by two numbers, each group through every head
            tid = (x.detach().abs().sum(-1) * 10).long() % 3
            a, b = x[tid == 1], x[tid == 2]
            return torch.cat([self.heads[i](a[:, :4]).sum(0) + self.heads[i](b[:, :4]).sum(0) for i in range(self.n)])
        if self.form == "gated_mlp":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        if self.form == "grouped_chunks":
            return torch.cat([self.heads[i](c) for i, c in enumerate(x.chunk(self.n, -1))], -1)
        for layer in self.layers:
            x = x + F.gelu(layer(x))
        logits = self.cls(x)
        if self.form == "layers_then_topk":
            return logits.topk(2, -1).indices
        return torch.stack([self.heads[i](x[:, :4]) for i in range(self.n)]) * logits.softmax(-1).t()[0, :, None]


@pytest.mark.parametrize("form", ["list_heads", "stacked_heads", "every_head_gathered", "every_head_by_a_buffer", "two_groups_every_head", "gated_mlp", "grouped_chunks", "layers_then_topk",
                                  "classifier_weighted_first"])
def test_look_alikes_without_expert_selection_are_not_listed(form):
    rep = moe_compile.explain(_NotMoE(form), make_input((6, 16)))
    assert not rep.refused and not rep.graph_breaks, str(rep)


# ------------------------------------------- MoE code found by what it does, whatever it is called
class _GateModule(nn.Module):
    def __init__(self, h=16, e=4, k=2):
        super().__init__()
        self.k, self.weight = k, nn.Parameter(torch.randn(e, h) / 4)

    def forward(self, x):
        return torch.topk(F.linear(x, self.weight).softmax(-1), self.k)


class SparseFFN(nn.Module):
    """Routing in a gate module or a helper, then Hugging Face Mixtral's loop with its empty-expert skip:
    Dynamo gives up on the whole forward (a graph break in a loop)."""

    def __init__(self, via, h=16, e=4):
        super().__init__()
        torch.manual_seed(0)
        self.via, self.e = via, e
        self.gate = _GateModule(h, e)
        self.experts = nn.ModuleList(SwiGLU(h, 32) for _ in range(e))

    def route(self, x):
        return torch.topk(F.linear(x, self.gate.weight).softmax(-1), 2)

    def forward(self, x):
        w, ids = self.route(x) if self.via == "helper" else self.gate(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, self.e).permute(2, 1, 0)
        for e in range(self.e):
            slot, tok = torch.where(mask[e])
            if tok.shape[0] == 0:
                continue
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


@pytest.mark.parametrize("via", ["helper", "gate_module"])
def test_skipped_frame_whose_router_is_elsewhere_is_listed(via):
    """Was silent (0 rewritten, 0 refused, 0 graph breaks): the skipped forward has no top-k of its own
    and no MoE name; its per-expert loop says it is MoE code."""
    torch._dynamo.reset()
    rep = moe_compile.explain(SparseFFN(via), make_input((24, 16)))
    assert len(rep.graph_breaks) == 1 and "Dynamo gave up on the frame `SparseFFN.forward`" in rep.graph_breaks[0].reason, \
        str(rep)


class _Mlps(nn.Module):
    def __init__(self, h=8, e=4):
        super().__init__()
        self.router = nn.Linear(h, e, bias=False)
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(h, 16), nn.GELU(), nn.Linear(16, h)) for _ in range(e))

    def moe(self, x):
        w, ids = torch.topk(self.router(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        for e in range(len(self.mlps)):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.mlps[e](x[tok]) * w[tok, slot, None])
        return out


class _DisabledMlps(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.ln, self.ffn = nn.LayerNorm(8), _Mlps()

    def forward(self, x):
        return x + torch.compiler.disable(self.ffn.moe)(self.ln(x))


def test_experts_run_eagerly_in_a_list_not_named_experts_are_listed():
    """Was silent: the eager probe looked at ModuleLists named *expert* only; a list whose owner routes and
    loops over it is probed whatever it is called."""
    torch._dynamo.reset()
    rep = moe_compile.explain(_DisabledMlps(), torch.randn(12, 8))
    assert [(r.module, r.code) for r in rep.refused] == [("ffn.mlps", "ran_eagerly")], str(rep)


class _LimitedMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = make_model(spelling="index_add", e=4, k=2)

    def forward(self, x):
        return self.moe(x)


def test_recompile_limit_hit_in_moe_code_is_listed(caplog):
    """Was silent: past torch._dynamo.config.recompile_limit the frame runs eagerly on every new shape
    (torch's own warning only), and explain() still said rewritten. Dynamo's metrics entry for the hit names
    no code: the frame is found from an earlier compile of the same frame id."""
    model = _LimitedMoE()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe", dynamic=False, options=OPTS)
    with torch._dynamo.config.patch(recompile_limit=2), caplog.at_level(logging.WARNING, logger="moe_compile"):
        for t in (10, 7, 5, 3):
            compiled(torch.randn(t, 16))
        rep = moe_compile.explain(compiled, torch.randn(11, 16))
    warned = _warnings(caplog, "recompile_limit")
    assert len(warned) == 1 and "recompile_limit (2)" in warned[0] and "_LimitedMoE.forward" in warned[0], caplog.text
    assert [r.code for r in rep.refused] == ["recompile_limit"] and "mark_dynamic" in rep.refused[0].fix, str(rep)


class _MaskRouter(nn.Module):
    def __init__(self, h=16, e=4):
        super().__init__()
        self.lin = nn.Linear(h, e, bias=False)

    def forward(self, x):
        p = self.lin(x).softmax(-1)
        return F.one_hot(p.argmax(-1), p.shape[-1]), p.max(-1).values[:, None]


class _MaskExperts(nn.Module):
    """A router returning a one-hot dispatch mask (Switch Transformers'), experts in a ModuleList or in a
    ModuleDict keyed expert_<e> (transformers' SwitchTransformersExperts); a graph break on the router's
    output (a forward hook; transformers' router-logit recorder with output_router_logits=True) leaves the
    experts' graph only the mask."""

    def __init__(self, container, h=16, e=4):
        super().__init__()
        torch.manual_seed(0)
        self.e, self.container = e, container
        self.router = _MaskRouter(h, e)
        made = [nn.Sequential(nn.Linear(h, 32, bias=False), nn.ReLU(), nn.Linear(32, h, bias=False)) for _ in range(e)]
        self.experts = nn.ModuleList(made) if container == "list" else nn.ModuleDict(
            {f"expert_{i}": m for i, m in enumerate(made)})
        self.router.register_forward_hook(lambda mod, args, out: torch._dynamo.graph_break())

    def forward(self, x):
        mask, w = self.router(x)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok = torch.where(mask[:, e])[0]
            expert = self.experts[e] if self.container == "list" else self.experts[f"expert_{e}"]
            out.index_add_(0, tok, w[tok] * expert(x[tok]))
        return out


@pytest.mark.parametrize("container", ["list", "dict"])
def test_experts_given_a_dispatch_mask_from_outside_the_graph_are_listed(container):
    """Was silent (0 rewritten, 0 refused): the unrouted scan took ids compared with numbers and the
    block's own gate scores, not column e of a mask that is a graph input, nor ModuleDict experts."""
    torch._dynamo.reset()
    rep = moe_compile.explain(_MaskExperts(container), make_input((24, 16)))
    assert [r.code for r in rep.refused] == ["ids_outside"], str(rep)
    assert "dispatch mask" in rep.refused[0].reason and "graph break" in rep.refused[0].fix, str(rep)
    if container == "dict":
        assert "experts.expert_<e>" in rep.refused[0].reason, str(rep)


class _Wrapper(nn.Module):
    def __init__(self, graph_break):
        super().__init__()
        self.graph_break, self.pre, self.moe = graph_break, nn.Linear(16, 16), make_model(spelling="index_add", e=4, k=2)

    def forward(self, x):
        x = self.pre(x)
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.moe(x)


@pytest.mark.parametrize("graph_break", [False, True])
def test_recompile_limit_hit_in_a_frame_around_moe_code_is_listed(graph_break, caplog):
    """The frame that hits the limit is usually the model's forward, not MoE code by its looks: it holds the
    MoE layer inlined (its graphs held a region), or resumes into it after a graph break; Dynamo then runs
    the layer eagerly on new shapes. Was silent (found by a review)."""
    torch._dynamo.reset()
    compiled = torch.compile(_Wrapper(graph_break), backend="moe", dynamic=False, options=OPTS)
    with torch._dynamo.config.patch(recompile_limit=2), caplog.at_level(logging.WARNING, logger="moe_compile"):
        for t in (4, 5, 6, 7):
            compiled(torch.randn(t, 16))
    warned = _warnings(caplog, "recompile_limit")
    assert len(warned) == 1 and "_Wrapper.forward" in warned[0], caplog.text


class _LookAlike(nn.Module):
    """Not MoE, found as MoE by the first versions of the unrouted scan's W[ids] and mask rules (a review's
    false positives)."""

    def __init__(self, form, h=16, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.W = nn.Parameter(torch.randn(5, h, h) / 4)            # per-class bilinear table / relation weights
        self.rel_k3 = nn.Parameter(torch.randn(7, 2, h // 2) / 4)
        self.layers = nn.ModuleList(nn.Linear(h, h) for _ in range(n))

    def forward(self, x, ids, mask):
        if self.form == "class_bilinear":      # bmm(f, W[labels]); R-GCN's weight[edge_type] alike
            return torch.bmm(x.unsqueeze(1), self.W[ids]).squeeze(1)
        if self.form == "relative_keys":       # Shaw-style relative key table gathered by position distances
            pos = torch.arange(x.shape[0])
            rel = (pos[:, None] - pos[None, :]).clamp(-3, 3) + 3
            return torch.einsum("th,tsh->ts", x[:, :8], self.rel_k3[rel].flatten(-2)[..., :8])
        if self.form == "layer_drop":          # per-sample layer drop with a precomputed keep mask
            for i, layer in enumerate(self.layers):
                keep = mask[:, i]
                x = x.clone()
                x[keep] = layer(x[keep])
            return x
        raise ValueError(self.form)


@pytest.mark.parametrize("form", ["class_bilinear", "relative_keys", "layer_drop"])
def test_look_alikes_given_ids_or_masks_are_not_listed(form):
    """Labels or edge types gathering a 3-D table (not hashed, nor looked up in a buffer), relative-position
    tables, and a layer-drop mask picking each layer's rows (layers one after the other) are not experts."""
    x = make_input((12, 16))
    ids = torch.randint(0, 5, (12,), generator=torch.Generator().manual_seed(1))
    mask = torch.rand(12, 3, generator=torch.Generator().manual_seed(2)) > 0.5
    torch._dynamo.reset()
    rep = moe_compile.explain(_LookAlike(form), x, ids, mask)
    assert not rep.refused and not rep.graph_breaks, str(rep)


def test_moe_source_reads_loops_and_names_narrowly():
    """A review's false positives from the source checks: a class-weighted loss loop (``self.cw[c]`` indexes a
    weight, calls no module) and a Python branch on the loop variable (``if i == last``) are no per-expert
    loop where no router is in sight; capsule routing, context gating and gMLP's spatial gating unit are no
    MoE names. The MoE loop of a forward whose router is a gate module still is."""
    from moe_compile.passes.moe_source import _MOE_NAME, _per_expert_loop

    moe = "for e in range(4):\n    slot, tok = torch.where(mask[e])\n    out.index_add_(0, tok, self.experts[e](x[tok]))\n"
    loss = "for c in range(3):\n    m = y == c\n    loss = loss + self.cw[c] * x[m].square().mean()\n"
    blocks = "for i, blk in enumerate(self.blocks):\n    x = blk(x)\n    if i == len(self.blocks) - 1:\n        h = x\n"
    assert _per_expert_loop(moe, calls=True) and not _per_expert_loop(loss, calls=True)
    assert not _per_expert_loop(blocks) and not _per_expert_loop(blocks, calls=True)
    assert not any(_MOE_NAME.search(n) for n in ("CapsuleRouting", "ContextGating", "SpatialGatingUnit"))
    assert all(_MOE_NAME.search(n) for n in ("TopKGating", "SwitchGate", "NoisyTopkGate", "MoeLayer", "Router",
                                             "SparseMoeBlock", "Experts"))


class _Heads3D(nn.Module):
    def __init__(self, h=8, heads=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(heads, h, h // 2) / 4)   # per-head projections [H, D, dh]

    def forward(self, x):
        q = torch.einsum("td,hde->hte", x, self.w)
        return torch.einsum("hte,hse->ts", q, q).softmax(-1) @ x


class _CheckpointedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = _Heads3D()

    def _body(self, x):
        torch._dynamo.graph_break()
        return x + self.attn(x)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False)


def test_per_head_weights_run_eagerly_are_not_experts():
    """3-D per-head weights [H, ...] that Dynamo ran eagerly (a graph break under checkpointing) were listed
    as ran_eagerly experts: a 3-D Parameter counts as experts only next to a router op (a review's false
    positive); experts next to one still are (test_experts_dynamo_ran_eagerly_are_listed)."""
    torch._dynamo.reset()
    rep = moe_compile.explain(_CheckpointedAttention(), torch.randn(6, 8))
    assert not rep.refused, str(rep)


def _top5_accuracy(logits, y):
    pred = logits.topk(5, -1).indices
    hit = torch.where(pred == y[:, None])[0]
    return logits.sum() * hit.float().mean().item()


def test_break_after_a_topk_in_code_without_experts_is_not_moe_code():
    """A top-k, a selection, then a host sync (a top-5 accuracy, a kNN monitor, a beam search's exit test) was
    reported as a graph break in MoE code (a review's false positive): the function computes with no expert."""
    torch._dynamo.reset()
    rep = moe_compile.explain(_top5_accuracy, torch.randn(8, 10), torch.randint(0, 10, (8,)))
    assert not rep.graph_breaks and not rep.refused, str(rep)


# ------------------------------------- Mixtral's loop with the expert bound first, router in a gate module
class SparseMLP(SparseFFN):
    """Hugging Face Mixtral's per-expert loop: the expert bound first (``expert = self.experts[e]``), the
    router a gate module, and in the loop an empty-expert skip, a host sync or a graph break: Dynamo gives up
    on the whole forward, then compiles each expert's forward as a frame of its own, with no router. No name
    says MoE. (SparseFFN's gate module and experts, its own forward.)"""

    def __init__(self, skip, h=16, e=4):
        super().__init__("gate_module", h, e)
        self.skip = skip

    def forward(self, x):
        w, ids = self.gate(x)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            if self.skip == "numel" and tok.numel() == 0:
                continue
            if self.skip == "item" and w[tok, slot].sum().item() == 0:
                continue
            if self.skip == "item_value":   # a host value in the arithmetic, no branch
                w = w * (w.sum().item() / w.sum().item())
            if self.skip == "graph_break":
                torch._dynamo.graph_break()
            expert = self.experts[e]
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


class _BesideRewritten(nn.Module):
    def __init__(self, skip):
        super().__init__()
        self.a, self.b = make_model(spelling="index_add", e=4, k=2), SparseMLP(skip)

    def forward(self, x):
        x = x + self.a(x)
        return x + self.b(x)


# a branch on `.item()` is a branch: its fix removes it ("keep the value a tensor" led to the numel case's break)
_SKIPS = {"numel": "break_data_dependent", "item": "break_data_dependent", "item_value": "break_item",
          "graph_break": "break_other"}


def _moe_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("moe_compile")]


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside_rewritten"])
@pytest.mark.parametrize("skip", list(_SKIPS))
def test_loop_that_binds_the_expert_first_is_listed_and_warned_once(skip, beside, caplog):
    """Was silent: explain() listed nothing (no region, no break, no ran_eagerly), the compile warned nothing
    beside a rewritten layer and, alone, only that no MoE layer was found. The loop binds the expert before
    calling it (``expert = self.experts[e]``), which the source check did not read as picking an expert."""
    model, code = (_BesideRewritten(skip) if beside else SparseMLP(skip)), _SKIPS[skip]
    x = make_input((24, 16))
    torch._dynamo.reset()
    rep = moe_compile.explain(model, x)
    # beside a layer, the outer frame's graph break at that line is listed too (as with a top-k in the function)
    breaks = rep.graph_breaks
    assert {b.reason_code for b in breaks} == {code} and len({b.where for b in breaks}) == 1, str(rep)
    assert any("Dynamo gave up on the frame `SparseMLP.forward`" in b.reason for b in breaks), str(rep)
    assert all(b.fix and b.where.startswith("test_never_silent.py:") for b in breaks) and not rep.refused, str(rep)
    assert [r.module for r in rep.rewritten] == (["a"] if beside else []), str(rep)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        compiled = torch.compile(model, backend="moe", options=OPTS)
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x))
    assert len(_warnings(caplog, code)) == 1 and "fix:" in _warnings(caplog, code)[0], caplog.text
    assert len(_moe_warnings(caplog)) == (1 if beside else 2), caplog.text   # alone: and nothing rewritten
    assert not any("no MoE layer was found" in m for m in _nothing(caplog)), caplog.text


class _LayersInALoop(nn.Module):
    """Layers called in a Python loop: a data-dependent branch inside one layer's expert loop makes Dynamo
    skip the outer frame with its generic "graph break in loop" at the same line."""

    def __init__(self, skip, n=2):
        super().__init__()
        self.layers = nn.ModuleList(SparseMLP(skip) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


@pytest.mark.parametrize("skip", ["numel", "item"])
def test_a_branch_in_layers_called_in_a_loop_keeps_its_own_reason(skip, caplog):
    """Was break_other with Dynamo's "graph break in loop" text and a generic fix (review helper-110): the outer
    frame's failure came first at the line and the layer frame's specific one was dropped as a duplicate."""
    model, x = _LayersInALoop(skip), make_input((24, 16))
    torch._dynamo.reset()
    rep = moe_compile.explain(model, x)
    assert [b.reason_code for b in rep.graph_breaks] == ["break_data_dependent"], str(rep)
    assert "remove the branch" in rep.graph_breaks[0].fix, str(rep)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        compiled = torch.compile(model, backend="moe", options=OPTS)
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x))
    assert len(_warnings(caplog, "break_data_dependent")) == 1 and not _warnings(caplog, "break_other"), caplog.text


class _WeightedThenScaled(nn.Module):
    """An element-wise op on the expert output after its routing weight (a per-expert 0/1 factor), before it
    (``before_weight``), or none (``factor=False``)."""

    def __init__(self, before_weight: bool, factor: bool = True, h=16, e=4):
        super().__init__()
        self.e, self.before_weight, self.factor = e, before_weight, factor
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, 32), nn.GELU(), nn.Linear(32, h)) for _ in range(e))

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            n = (ids == e).sum()
            if not self.factor:
                out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
            elif self.before_weight:
                out.index_add_(0, tok, self.experts[e](x[tok]) * (n > 0) * w[tok, slot, None])
            else:
                out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None] * (n > 0))
        return out


def test_an_op_after_the_routing_weight_says_so():
    """``expert(x[tok]) * w * f``: refused as an unsupported `mul` whose fix (keep the code to linears and
    element-wise ops) read as a contradiction; the reason now says the op follows the weight multiply. Moved
    before the weight, the per-expert factor gets its own reason (review helper-110)."""
    x = make_input((24, 16))
    torch._dynamo.reset()
    rep = moe_compile.explain(_WeightedThenScaled(before_weight=False), x)
    assert [r.code for r in rep.refused] == ["unsupported_row_op"], str(rep)
    assert "after the routing weight multiply" in rep.refused[0].reason, str(rep)
    torch._dynamo.reset()
    rep = moe_compile.explain(_WeightedThenScaled(before_weight=True), x)
    assert [r.code for r in rep.refused] == ["expert_operand_not_linear"], str(rep)


def test_expert_widths_that_differ_are_listed_by_expert():
    """The reason listed the distinct shapes as quoted strings sorted as text (8 after 16), not which expert
    had which (review helper-110); now by expert, in expert order."""
    model = _WeightedThenScaled(before_weight=False, factor=False)
    for e, f in enumerate([32, 24, 32, 8]):
        model.experts[e] = nn.Sequential(nn.Linear(16, f), nn.GELU(), nn.Linear(f, 16))
    torch._dynamo.reset()
    rep = moe_compile.explain(model, make_input((24, 16)))
    assert [r.code for r in rep.refused] == ["weight_shapes_differ"], str(rep)
    assert "experts 0, 2: (32, 16); expert 1: (24, 16); expert 3: (8, 16)" in rep.refused[0].reason, str(rep)


@pytest.mark.parametrize("skip", ["numel", "graph_break"])
def test_fullgraph_break_in_a_loop_that_binds_the_expert_first_says_how_to_fix(skip):
    """``fullgraph=True`` names only the failing line: the per-expert loop around it says it is MoE code."""
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(SparseMLP(skip), backend="moe", fullgraph=True, options=OPTS)(make_input((24, 16)))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"moe_compile [{_SKIPS[skip]}]" in notes and "fix: " in notes, notes


def test_experts_called_from_a_frame_dynamo_gave_up_on_are_listed_by_the_probe(monkeypatch):
    """The eager probe is the backstop where the source checks miss MoE code: its hooks ran as frames Dynamo
    compiled on their own (``is_compiling()`` True there), so experts called from a frame Dynamo gave up on
    were never recorded. With the source checks blind, those experts are still listed as ran_eagerly."""
    import moe_compile.passes.moe_source as moe_source

    monkeypatch.setattr(moe_source, "_per_expert_loop", lambda *a, **k: False)
    torch._dynamo.reset()
    rep = moe_compile.explain(SparseMLP("numel"), make_input((24, 16)))
    assert not rep.graph_breaks and [(r.module, r.code) for r in rep.refused] == [("experts", "ran_eagerly")], str(rep)


def test_moe_source_reads_a_loop_that_binds_the_expert_first():
    """``expert = self.experts[e]`` then ``expert(...)`` (Mixtral), or the experts given the loop variable,
    pick an expert; a weight bound from the loop variable and never called does not."""
    from moe_compile.passes.moe_source import _per_expert_loop

    head = "for e in range(4):\n    tok, slot = torch.where(ids == e)\n"
    bound = head + "    expert_layer = self.experts[e]\n    out.index_add_(0, tok, expert_layer(x[tok]))\n"
    method = head + "    out.index_add_(0, tok, self.experts.fwd(e, x[tok]))\n"
    weight = "for c in range(3):\n    m = y == c\n    cw = self.cw[c]\n    loss = loss + cw * x[m].mean()\n"
    assert _per_expert_loop(bound, calls=True) and _per_expert_loop(method, calls=True)
    assert not _per_expert_loop(weight, calls=True)


# ------------------------------------------------------------ expert weights passed as arguments
def _masked_dense_moe(x, gate_w, w1, w2, k=2):
    """Every expert on every token, kept where the token routed to it: a form no finder knows."""
    w, ids = (x @ gate_w).softmax(-1).topk(k, dim=-1)
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        mine = (ids == e).any(-1, keepdim=True)
        we = (w * (ids == e)).sum(-1, keepdim=True)
        out = out + torch.where(mine, (F.gelu(x @ w1[e]) @ w2[e]) * we, 0)
    return out


def _index_add_moe(x, gate_w, w1, w2, k=2):
    w, ids = (x @ gate_w).softmax(-1).topk(k, dim=-1)
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, slot = torch.where(ids == e)
        out.index_add_(0, tok, (F.gelu(x[tok] @ w1[e]) @ w2[e]) * w[tok, slot, None])
    return out


def _two_moe_layers(x, g1, a1, b1, g2, a2, b2):
    x = x + _index_add_moe(x, g1, a1, b1)          # rewritten
    return x + _masked_dense_moe(x, g2, a2, b2)     # not: listed


@pytest.mark.parametrize("case", ["alone", "alone_grad", "parameters", "beside_rewritten"])
def test_expert_weights_passed_as_arguments_are_listed(case, caplog):
    """Was silent: in ``torch.compile(fn)`` with the stacked expert weights passed as arguments (plain
    tensors: not nn.Parameters, so not expert weights to the unclaimed scan), a masked dense loop over
    ``W[e]`` was listed nowhere (compiled alone: a false "no MoE layer was found"); beside a rewritten
    layer in the same function, that layer's region on the root (every node of a function is there)
    hid it. Arguments sliced per expert by constants (``w1[e]``) now count as stacked weights, and a
    region on the root claims by its nodes and router alone; each warned once, with its code."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    layer = [torch.randn(16, 4), torch.randn(4, 16, 8), torch.randn(4, 8, 16)]
    fn, args = (_two_moe_layers, layer + [t.clone() for t in layer]) if case == "beside_rewritten" \
        else (_masked_dense_moe, layer)
    args = [nn.Parameter(t) if case == "parameters" else t.requires_grad_(case != "alone") for t in args]
    rep = moe_compile.explain(fn, x, *args)
    assert [r.code for r in rep.refused] == ["moe_unmatched"], str(rep)
    assert len(rep.rewritten) == (case == "beside_rewritten"), str(rep)
    torch._dynamo.reset()
    caplog.set_level(logging.WARNING, logger="moe_compile")
    torch.compile(fn, backend="moe", options={"moe.inductor": False})(x, *args)
    assert caplog.text.count("[moe_unmatched]") == 1 and "no MoE layer was found" not in caplog.text, caplog.text


def test_moe_layer_under_a_func_transform_is_refused_by_name(caplog):
    """torch.func.grad inside the compiled function (what Dynamo's message for grad(compiled) advises): the
    region was found, the lowering failed on functorch's wrapped values ("`x` has no fake value"), and the
    record said "a bug in moe_compile: please report it". Now refused as func_transform with a fix; the
    gradients are eager's."""
    from torch.func import functional_call, grad

    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    x = make_input((3, 5, 16), requires_grad=False)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, x):
        return functional_call(model, p, (x,)).square().sum()

    torch._dynamo.reset()
    before = dict(records.counters)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        got = torch.compile(lambda p, x: grad(loss)(p, x), backend="moe", options=OPTS)(params, x)
    want = grad(loss)(params, x)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    assert records.counters["refused"] - before.get("refused", 0) == 1, caplog.text
    (w,) = _warnings(caplog, "func_transform")
    assert "_grad_increment_nesting" in w and "torch.autograd.grad" in w and "lowering failed" not in caplog.text, w


def test_compiled_model_under_a_func_transform_from_eager_names_the_transform(caplog):
    """torch.func.grad(compiled) from eager code: Dynamo gives up on the frames ("Unsupported functorch
    tracing attempt") and they run eagerly; the warning was break_other, whose fix (move the code out of the
    MoE layer) does not apply. Now break_func_transform, naming loss.backward / torch.autograd.grad."""
    from torch.func import functional_call, grad

    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    x = make_input((3, 5, 16), requires_grad=False)
    params = {n: p.detach() for n, p in model.named_parameters()}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe", options=OPTS)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        got = grad(lambda p: functional_call(compiled, p, (x,)).square().sum())(params)
    want = grad(lambda p: functional_call(model, p, (x,)).square().sum())(params)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    warned = _warnings(caplog, "break_func_transform")
    assert warned and not _warnings(caplog, "break_other") and "torch.autograd.grad" in warned[0], caplog.text
    # explain() names those frames (Dynamo never traces them again) until torch._dynamo.reset() lifts the
    # marks: then they were still listed, for any model of those classes (a stale record)
    assert "break_func_transform" in {b.reason_code for b in moe_compile.explain(model, x).graph_breaks}
    torch._dynamo.reset()
    assert not moe_compile.explain(model, x).graph_breaks


def test_expert_weights_of_a_tensor_subclass_are_refused_by_name():
    """Frozen expert weights of a traceable wrapper subclass (torchao's quantized weights in QLoRA-style
    fine-tuning; torch's TwoTensor here): the fused ops have no kernel for them. The lowering failed on
    them and the record said 'a bug in moe_compile: please report it'; now the legality rule
    plain_weights refuses the region with the weight's type, and values are eager's."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    torch.manual_seed(0)
    model = make_model(h=16, i=12, e=4, k=2)
    for mod in model.experts.experts.modules():
        if isinstance(mod, nn.Linear):
            w = mod.weight.detach()
            mod.weight = nn.Parameter(two_tensor.TwoTensor(w.clone(), w.clone()), requires_grad=False)
    x = make_input((6, 16))
    torch._dynamo.reset()
    report = moe_compile.explain(model, x)
    assert [(r.status, r.code) for r in report.regions] == [("refused", "weight_subclass")], report
    assert "TwoTensor" in report.regions[0].reason
    check_compiled(model, (x,), expect_rewritten=0, expect_refused=1)


class _Fp32GroupedMM(nn.Module):
    """Sorted experts on torch._grouped_mm in fp32, all in forward (torch 2.13's fake kernel wants bf16
    operands while eager runs fp32 on CPU: Dynamo gives up on the frame, which runs eagerly)."""

    def __init__(self, h=32, i=24, e=8, k=2):
        super().__init__()
        self.k, self.e = k, e
        self.gate = nn.Linear(h, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(e, h, i) / 6)
        self.w2 = nn.Parameter(torch.randn(e, i, h) / 5)

    def forward(self, x):
        top, sel = torch.topk(F.softmax(self.gate(x), -1), self.k, -1)
        flat = sel.view(-1)
        perm = flat.argsort(stable=True)
        offs = torch.histc(flat.float(), bins=self.e, min=0, max=self.e).cumsum(0).to(torch.int32)
        tok = perm // self.k
        h = F.gelu(torch._grouped_mm(x[tok], self.w1, offs=offs))
        o = torch._grouped_mm(h, self.w2, offs=offs) * top.view(-1)[perm][:, None]
        return torch.zeros_like(x).index_add_(0, tok, o)


def test_frame_with_torch_grouped_mm_given_up_on_is_listed_by_explain():
    """explain() listed nothing (0 graphs, no break) for a frame Dynamo gave up on whose only expert
    compute is `torch._grouped_mm(`: the source rule looked for `grouped_mm(` after a word boundary,
    which `._grouped_mm(` does not have. The compile's own warning named the frame as not MoE code."""
    from moe_compile.passes.moe_source import _EXPERT_COMPUTE

    assert _EXPERT_COMPUTE.search("h = torch._grouped_mm(x, w, offs=offs)")
    torch.manual_seed(0)
    torch._dynamo.reset()
    report = moe_compile.explain(_Fp32GroupedMM(), torch.randn(10, 32))
    assert report.regions or report.graph_breaks, report


class _SlicedExperts(nn.Module):
    """megablocks-style: rows sorted by expert, each expert's rows sliced with tensor bounds."""

    def __init__(self, h=16, e=4, k=2):
        super().__init__()
        self.e, self.k = e, k
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList([SwiGLU(h, 12) for _ in range(e)])

    def forward(self, x):
        w, sel = torch.topk(F.softmax(self.gate(x), -1), self.k, -1)
        flat = sel.view(-1)
        order = flat.argsort(stable=True)
        counts = torch.histc(flat.float(), bins=self.e, min=0, max=self.e - 1).long()
        ends = counts.cumsum(0)
        starts = ends - counts
        xs = x[order // self.k]
        ys = torch.empty_like(xs)
        for e in range(self.e):
            ys[starts[e]:ends[e]] = self.experts[e](xs[starts[e]:ends[e]])
        ys = ys * w.view(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, order // self.k, ys)


def test_break_inside_the_expert_loop_is_named_as_such():
    """Dynamo cannot resume inside the loop after the slice's host read: it gave up on the loop with
    'step_unsupported', reported as break_other with the generic fix; now break_in_expert_loop, whose fix
    names the loop forms without host reads. Values are eager's."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    report = moe_compile.explain(_SlicedExperts(), make_input((10, 16)))
    assert [b.reason_code for b in report.graph_breaks] == ["break_in_expert_loop"], report
    check_compiled(_SlicedExperts(), (make_input((10, 16)),), expect_rewritten=0, expect_refused=1)


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _FunctionExpert(nn.Module):
    def __init__(self, h=16, i=12):
        super().__init__()
        self.w1, self.w2 = nn.Linear(h, i, bias=False), nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.w2(_Double.apply(F.silu(self.w1(x))))


class _FunctionExpertsLoop(nn.Module):
    def __init__(self, h=16, e=4, k=2):
        super().__init__()
        self.e, self.k = e, k
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList([_FunctionExpert(h) for _ in range(e)])

    def forward(self, x):
        w, ids = torch.topk(F.softmax(self.gate(x), -1), self.k, -1)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, w[tok, slot, None] * self.experts[e](x[tok]))
        return out


def test_custom_autograd_function_in_an_expert_is_named_in_the_reason():
    """An expert that calls a custom torch.autograd.Function (torchao's float8 training Linear does) is
    refused as unsupported_row_op; the reason now says what `trampoline_autograd_apply` is."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    report = moe_compile.explain(_FunctionExpertsLoop(), make_input((10, 16)))
    refused = [r for r in report.regions if r.code == "unsupported_row_op"]
    assert refused and "custom torch.autograd.Function" in refused[0].reason, report


class _DroppedExpert(nn.Module):
    """An expert that a module dropout may skip (peft's LoHa / LoKr draw `torch.rand(1) > module_dropout`), or
    with a per-expert scale in a non-linear op (peft's VeRA / IA3 vectors)."""

    def __init__(self, p=0.0, scale=False):
        super().__init__()
        self.up, self.down, self.p = nn.Linear(16, 24), nn.Linear(24, 16), p
        self.scale = nn.Parameter(torch.ones(24)) if scale else None

    def forward(self, x):
        if self.training and self.p > 0 and torch.rand(1) < self.p:
            return x * 0
        h = F.silu(self.up(x))
        return self.down(h if self.scale is None else h * self.scale)


class _DroppedLoop(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(16, 4)
        self.experts = nn.ModuleList(_DroppedExpert(**kw) for _ in range(4))

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), 2, -1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


def test_messages_of_adapter_forms():
    """Review helper-82 (peft adapters on experts): a module dropout's branch on a random draw was told "remove
    the branch: the rewritten experts handle empty groups" (break_data_dependent); a per-expert vector in a
    non-linear op was named by its raw graph variable (`l_self_modules_experts_modules_0_parameters_scale_`); a
    graph break while computing a parametrized weight got the generic fix."""
    from moe_compile.passes.unclaimed import Frame, classify_break

    torch._dynamo.reset()
    rep = moe_compile.explain(_DroppedLoop(p=0.3).train(), torch.randn(10, 16))
    assert {b.reason_code for b in rep.graph_breaks} == {"break_random_branch"}, str(rep)
    assert "dropout probability to 0" in rep.graph_breaks[0].fix, rep.graph_breaks[0].fix
    torch._dynamo.reset()
    rep = moe_compile.explain(_DroppedLoop(scale=True), torch.randn(10, 16))
    assert [r.code for r in rep.refused] == ["expert_operand_not_linear"], str(rep)
    assert "`experts.0.scale`" in rep.refused[0].reason, rep.refused[0].reason
    parametrize = torch.nn.utils.parametrize.__file__
    code, _ = classify_break([Frame(__file__, 1, "forward"), Frame(parametrize, 92, "_maybe_set", "dest.set_(src)")],
                             "Unsupported function call")
    assert code == "break_parametrization"


class _RetainInLoop(nn.Module):
    """A per-expert loop that keeps one expert's output gradient for inspection (``y.retain_grad()``)."""

    def __init__(self, h=16, e=4, k=2):
        super().__init__()
        self.e, self.k = e, k
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(SwiGLU(h, 12) for _ in range(e))
        self.kept = None

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), self.k, -1)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            y = self.experts[e](x[tok])
            if e == 1:
                y.retain_grad()
                self.kept = y
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out


def test_untraceable_call_in_an_expert_loop_is_named(caplog):
    """``y.retain_grad()`` inside the expert loop: Dynamo gives up on the loop and reports only its ``for``
    line; the reason gave a tensor-bounds slice as its example and the fix said to select rows with
    torch.where, which the loop does (review helper-89). Now the call in the body is named, and the fix says
    to move it out of the loop. Values and gradients as eager's."""
    x = make_input((10, 16))
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        check_compiled(_RetainInLoop(), [x], expect_rewritten=0, expect_refused=1)
    (w,) = _warnings(caplog, "break_in_expert_loop")
    assert "`y.retain_grad()` at test_never_silent.py:" in w and "move calls Dynamo cannot trace" in w, w


def test_module_backward_hook_inside_the_layer_is_named(caplog):
    """A full backward hook on one expert module: Dynamo gives up on the layer's frame ("Module-level backwards
    hooks require compiled autograd"). It was break_other located at torch's module.py (`BackwardHook(...)`)
    with the fix "move the code Dynamo cannot trace out of the MoE layer", and explain() listed the experts
    also as ran_eagerly, "no graph break in MoE code says why" (review helper-89). Now break_module_backward_hook
    at the layer's frame, with where to put the hook instead; no ran_eagerly row. Values as eager's."""
    model = make_model(spelling="index_add", e=4, k=2)
    model.experts.experts[1].register_full_backward_hook(lambda mod, gin, gout: None)
    x = make_input((10, 16))
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        check_compiled(model, [x], expect_rewritten=0, expect_refused=1)
    (w,) = _warnings(caplog, "break_module_backward_hook")
    assert "module.py" not in w.split("fix:")[0] and "outside the MoE layer" in w, w
    torch._dynamo.reset()
    report = moe_compile.explain(model, x)
    assert [b.reason_code for b in report.graph_breaks] == ["break_module_backward_hook"], report
    assert all(r.code != "ran_eagerly" for r in report.regions), report


def test_subgraph_aliasing_error_names_the_rehome_fix():
    """A nested_compile_region the backend cannot see (neither decorated in the source nor a wrapped method of a
    module on the layer's path) still re-homes: Dynamo's aliasing error then carries the fix."""
    from torch._dynamo.exc import UncapturedHigherOrderOpError

    from moe_compile.backend import _note_break

    exc = UncapturedHigherOrderOpError("Encountered aliasing during higher order op tracing: invoke_subgraph")
    _note_break(exc)
    assert any('"moe.rehome_weights": False' in n for n in getattr(exc, "__notes__", ())), exc


def test_a_frame_whose_failure_is_raised_is_not_said_to_run_eagerly(caplog):
    """moe.strict raises Dynamo's failure on a `.tolist()` of the counts: the call raises, every call does, nothing
    runs eagerly; the warning said "Dynamo gave up on the frame ..., which runs eagerly" (review helper-95)."""
    from zoo_models import DeepSeekLoopMoE

    torch.manual_seed(0)
    torch._dynamo.reset()
    compiled = torch.compile(DeepSeekLoopMoE(16, 12, 4, 2), backend="moe",
                             options={"moe.inductor": False, "moe.strict": True})
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        for _ in range(2):
            with pytest.raises(Exception, match="data-dependent"):
                compiled(make_input((6, 16)))
    assert "runs eagerly" not in caplog.text, caplog.text


class _RefusedLoop(nn.Module):
    """A top-2 loop over ModuleList experts refused three ways: tokens over a capacity dropped (``cap``, no
    form: moe_unmatched), an overwrite (``setitem``: overwrite_topk), rows centred before the expert (``mean``:
    unsupported_row_op)."""

    def __init__(self, how, e=4, h=16):
        super().__init__()
        self.how, self.e = how, e
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(SwiGLU(h, 8) for _ in range(e))

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(2, -1)
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            if self.how == "cap":
                tok, slot = tok[: x.shape[0] // 2], slot[: x.shape[0] // 2]
            rows = x[tok] - x[tok].mean(0, keepdim=True) if self.how == "mean" else x[tok]
            if self.how == "setitem":
                out[tok] = self.experts[e](rows) * w[tok, slot, None]
            else:
                out.index_add_(0, tok, self.experts[e](rows) * w[tok, slot, None])   # _RefusedLoop: expert line
        return out


@pytest.mark.parametrize("how, code, form", [("cap", "moe_unmatched", "unmatched"),
                                             ("setitem", "overwrite_topk", "loop/where+setitem"),
                                             ("mean", "unsupported_row_op", "loop/where+?")])
def test_refused_loops_say_their_router_and_the_blocks_line(how, code, form):
    """Review helper-110: a refused loop's row showed `loop/?` and `-` for experts and top-k where the router was
    known; an unmatched layer's `where` was the expert MLP's own line (its `return self.down(...)`) and its
    evidence an FX node name (`linear_1`). Now the router's numbers, the block's line that calls the expert, and
    the expert's module path."""
    import inspect

    torch._dynamo.reset()
    rep = moe_compile.explain(_RefusedLoop(how), make_input((16, 16)))
    assert [r.code for r in rep.refused] == [code], str(rep)
    r = rep.refused[0]
    assert (r.form, r.num_experts, r.top_k) == (form, 4, 2), str(rep)
    if how == "cap":
        lines, first = inspect.getsourcelines(_RefusedLoop.forward)
        line = first + next(i for i, s in enumerate(lines) if "_RefusedLoop: expert line" in s)
        assert r.where == f"test_never_silent.py:{line}", str(rep)
        assert "(`experts.0." in r.reason and "`linear" not in r.reason, r.reason
