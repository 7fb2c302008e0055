"""moe_compile.explain(): regions rewritten (module, form, status, ops) and refused (with a reason), notes
once per region, and no side effects on the user's model or compiled model."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

import moe_compile
from helpers import make_input, make_model
from moe_compile import records


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
    for op in ("route_permute", "permute_rows", "weighted_swiglu", "unpermute_sum"):
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


class RowEdits(nn.Module):
    """A where + index_add_ loop whose odd experts read detached rows, or that edits its own input rows."""

    def __init__(self, edit, h=16, i=24, e=4, k=2):
        super().__init__()
        self.edit, self.e, self.k = edit, e, k
        self.gate = nn.Linear(h, e, bias=False)
        self.up = nn.ModuleList(nn.Linear(h, i, bias=False) for _ in range(e))
        self.down = nn.ModuleList(nn.Linear(i, h, bias=False) for _ in range(e))

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(self.k, -1)
        out, xin = torch.zeros_like(x), x.clone()
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            xs = xin[tok].detach() if self.edit == "detach_odd" and e % 2 else xin[tok]
            out.index_add_(0, tok, self.down[e](torch.relu(self.up[e](xs))) * w[tok, slot, None])
            if self.edit == "input_edit":
                xin[tok] = xin[tok] * 0.5
        return out


def test_refusal_names_the_op_on_the_rows():
    """Was `unsupported_write` ("unsupported index_add_", fixed by the very spelling used) for detached rows,
    and a second `overwrite_topk` record for an edit of the experts' input: one record, the row op named."""
    for edit, op in (("detach_odd", "detach"), ("input_edit", "setitem")):
        torch.manual_seed(0)
        rep = moe_compile.explain(RowEdits(edit), make_input((32, 16)))
        assert [r.code for r in rep.refused] == ["unsupported_row_op"], str(rep)
        assert f"`{op}`" in rep.refused[0].reason, str(rep)


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


def test_explain_notes_many_list_weights(monkeypatch):
    """ModuleList experts with many experts: the report says that the compile stacks them (one graph
    input per buffer), or, where it cannot, the per-parameter host cost and the fixes."""
    many = moe_compile.explain(make_model(h=16, i=8, e=32, k=2, spelling="index_add"), make_input((7, 16)))
    few = moe_compile.explain(make_model(h=16, i=8, e=4, k=2, spelling="index_add"), make_input((7, 16)))
    (r,) = many.rewritten
    assert any("96 per-expert weight tensors" in n and "one stacked input per buffer" in n for n in r.notes), r.notes
    assert not any("per-expert weight tensors" in n for r in few.rewritten for n in r.notes)
    # where stacking cannot apply (FSDP2, several processes) the cost note and its fixes stay
    import moe_compile.lowering.expert_stack as expert_stack

    monkeypatch.setattr(expert_stack, "why_not_stacked", lambda: "a multi-process job")
    (r,) = moe_compile.explain(make_model(h=16, i=8, e=32, k=2, spelling="index_add"), make_input((7, 16))).rewritten
    assert any("96 per-expert weight tensors" in n and "reduce-overhead" in n for n in r.notes), r.notes


class Counting(nn.Module):
    """An MoE block whose forward also updates a buffer and draws random numbers (dropout)."""

    def __init__(self):
        super().__init__()
        self.moe = Block(spelling="index_add", e=4, k=2)
        self.register_buffer("calls", torch.zeros(()))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        self.calls.add_(1)
        return self.drop(self.moe(x))


def _compiled_once(**options):
    """A Counting model compiled with a counting moe backend and called once."""
    from moe_compile.backend import capture_ctx

    torch._dynamo.reset()
    model, calls = Counting(), []

    def backend(gm, example_inputs):
        calls.append(1)
        return moe_compile.moe_backend(gm, example_inputs, options={"moe.inductor": False, **options})

    backend.moe_capture_ctx = capture_ctx
    compiled = torch.compile(model, backend=backend)
    compiled(make_input((2, 5, 16)))
    return model, compiled, calls


def test_explain_keeps_the_compiled_code():
    """compile, call, explain (more often than Dynamo's recompile limit, on the model and on the compiled
    model), call again: no recompile, and every explain sees the region."""
    model, compiled, calls = _compiled_once()
    x = make_input((2, 5, 16))
    for _ in range(torch._dynamo.config.recompile_limit + 2):
        for target in (model, compiled):
            rep = moe_compile.explain(target, x)
            assert len(rep.rewritten) == 1 and not rep.refused, str(rep)
    frames = torch._dynamo.utils.counters["frames"]["total"]
    for seed in range(3):
        compiled(make_input((2, 5, 16), seed=seed))
    assert torch._dynamo.utils.counters["frames"]["total"] == frames, "the compiled model recompiled after explain"
    assert len(calls) == 1


def test_explain_leaves_weights_buffers_and_rng():
    """The same parameter storages (explain does not re-home ModuleList weights), buffers and RNG state."""
    model, compiled, _ = _compiled_once(**{"moe.rehome_weights": False})
    ptrs = [p.data_ptr() for p in model.parameters()]
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.random.get_rng_state()
    rep = moe_compile.explain(compiled, make_input((2, 5, 16)))
    assert len(rep.rewritten) == 1, str(rep)
    assert [p.data_ptr() for p in model.parameters()] == ptrs, "explain() moved parameters"
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers()), "explain() changed buffers"
    assert torch.equal(torch.random.get_rng_state(), rng), "explain() consumed random numbers"


def test_explain_leaves_the_counters():
    """moe_compile.counters counted explain's trace as one more rewritten region (review helper-94)."""
    model = make_model(spelling="index_add")
    before = dict(moe_compile.counters)
    rep = moe_compile.explain(model, make_input((6, 16)))
    assert len(rep.rewritten) == 1 and dict(moe_compile.counters) == before, (before, moe_compile.counters)


@pytest.mark.parametrize("backend", ["aot_eager", "moe"])
def test_explain_of_a_model_whose_forward_is_compiled_traces_it_itself(backend):
    """``model.forward = torch.compile(model.forward, ...)`` (transformers' docs; review helper-116): explain
    ran the user's compile inside its trace, so it reported nothing for another backend ("0 rewritten, 0
    graphs") and spent the user's recompile budget with backend="moe" (their later calls ran eagerly). Now
    its own trace of the class's forward: the region, the note, the user's forward left as it was."""
    torch._dynamo.reset()
    model = Block(spelling="index_add", e=4, k=2)
    compiled_forward = torch.compile(model.forward, backend=backend)
    model.forward = compiled_forward
    model(make_input((6, 16)))
    rep = moe_compile.explain(model, make_input((7, 16)))
    assert rep.graphs == 1 and len(rep.rewritten) == 1, str(rep)
    assert any(f"backend={backend!r}" in n for n in rep.notes) == (backend != "moe"), str(rep)
    assert model.forward is compiled_forward
    with torch._dynamo.config.patch(recompile_limit=2):   # the user's compile: one graph so far, and one more
        records.counters.clear()
        moe_compile.explain(model, make_input((9, 16)))
        model(make_input((5, 16)))
        assert records.counters.get("rewritten", 0) == (backend == "moe"), dict(records.counters)
    # what the compiled forward wraps is traced, not the class's forward (review helper-119): here no MoE at all
    other = Block(spelling="index_add", e=4, k=2)
    other.forward = torch.compile(other.mlp.router.forward, backend=backend)
    assert not moe_compile.explain(other, make_input((7, 16))).rewritten
    # the instance's compiled forward is what runs under the module's own model.compile(backend="moe")
    inner = Block(spelling="index_add", e=4, k=2)
    inner.compile(backend="moe")
    inner.forward = torch.compile(inner.forward, backend=backend)
    assert any(f"backend={backend!r}" in n for n in moe_compile.explain(inner, make_input((7, 16))).notes) == \
        (backend != "moe")


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([make_model(spelling="index_add", e=4, k=2) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("how", ["torch.compile", "compile_blocks"])
def test_explain_reports_a_region_whose_inductor_compile_failed(monkeypatch, how):
    """A rewritten graph that only Inductor fails on (here a post_grad pass) is compiled unrewritten (compile_error,
    warned); explain(), whose trace runs no Inductor, reported the region as rewritten (review helper-95; under
    compile_blocks too: helper-97)."""
    import moe_compile.lowering.wgrad_order as wgrad_order

    def boom(graph):
        raise RuntimeError("injected post_grad failure")

    monkeypatch.setattr(wgrad_order, "hoist_weight_gradients", boom)
    torch._dynamo.reset()
    if how == "torch.compile":
        model = compiled = torch.compile(make_model(spelling="index_add"), backend="moe",
                                         options={"fx_graph_cache": False})
    else:
        model = compiled = _TwoLayers()
        moe_compile.compile_blocks(model, blocks="layers", options={"fx_graph_cache": False}, loss=False)
    compiled(make_input((6, 16))).sum().backward()
    rep = moe_compile.explain(model, make_input((6, 16)))
    assert rep.regions and {(r.status, r.code) for r in rep.regions} == {("refused", "compile_error")}, str(rep)
    assert "injected post_grad failure" in rep.regions[0].reason


def test_a_compile_error_is_withdrawn_when_a_later_compile_rewrites_the_region():
    """The compile_error explain() reports for a compiled model goes once a recompile (another input shape) of the
    same region succeeds (review helper-97)."""
    from moe_compile.records import REFUSED, REWRITTEN, RegionRecord, Session

    session = Session(quiet=True)
    session.count([RegionRecord("moe", "loop", REFUSED, "failed", (), "m.py:3", code="compile_error")])
    assert ("moe", "m.py:3") in session.compile_errors
    session.count([RegionRecord("moe", "loop", REWRITTEN, "", ("grouped_mm",), "m.py:3")])
    assert not session.compile_errors


def test_host_sync_note_says_what_to_do():
    """The note named the ops left ("where x4") and nothing else (review helper-76)."""
    from test_static_counts import LoopWithLenCounts   # each expert's tok.shape[0] as a Python number

    rep = moe_compile.explain(LoopWithLenCounts("python"), make_input((12, 16)))
    assert len(rep.rewritten) == 1, str(rep)
    (note,) = [n for n in rep.rewritten[0].notes if "host syncs left" in n]
    assert "size read outside the rewritten region" in note and "histc" in note, note


class _PythonRandomDrop(nn.Module):
    """Each call drops its MoE layer with probability 0.5 by Python's ``random`` (a LayerDrop written so)."""

    def __init__(self):
        super().__init__()
        self.moe = Block(spelling="index_add", e=4, k=2)

    def forward(self, x):
        return x if random.random() < 0.5 else self.moe(x)


def test_explain_leaves_pythons_random_state():
    """Python's ``random`` advanced by explain's run: the next draws of the user's training loop changed
    (review helper-74)."""
    random.seed(3)
    state = random.getstate()
    moe_compile.explain(_PythonRandomDrop(), make_input((2, 5, 16)))
    assert random.getstate() == state, "explain() consumed Python random numbers"


def test_explain_before_compile_changes_nothing():
    """A model explained before it is compiled compiles as if explain had never run."""
    torch._dynamo.reset()
    x = make_input((2, 5, 16))
    fresh = Counting()
    moe_compile.explain(fresh, x)
    with records.recording() as graphs:
        torch.compile(fresh, backend="moe", options={"moe.inductor": False})(x)
    assert [r.status for g in graphs for r in g] == ["rewritten"]


def test_explain_notes_once_per_region():
    """Each region carries its own notes; the report prints each note once, naming its regions."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = make_model(h=16, i=8, e=32, k=2, spelling="index_add")
            self.b = make_model(h=16, i=8, e=4, k=2, spelling="index_add")

        def forward(self, x):
            return self.b(self.a(x))

    rep = moe_compile.explain(Two(), make_input((7, 16)))
    a, b = sorted(rep.rewritten, key=lambda r: r.module)
    assert any("96 per-expert weight tensors" in n for n in a.notes), a.notes
    assert not any("per-expert weight tensors" in n for n in b.notes), b.notes   # a's note is a's only
    text = str(rep)
    for note in set(a.notes) | set(b.notes):
        assert text.count(note) == 1, (note, text)


class Layers(nn.Module):
    """Two MoE layers called from a loop with a graph break in it: Dynamo compiles each layer's forward
    as a nested frame, so one graph (its module paths spelled from the layer: ``mlp``) serves both."""

    def __init__(self, second="where_setitem"):
        super().__init__()
        self.layers = nn.ModuleList([Block(spelling="where_setitem", e=4, k=2), Block(spelling=second, e=4, k=2)])

    def forward(self, x):
        for layer in self.layers:
            torch._dynamo.graph_break()
            x = layer(x)
        return x


def test_explain_places_nested_frames_per_layer():
    """Each layer of a graph compiled for a nested frame is its own record, at its path from the model."""
    x = make_input((2, 5, 16))
    rep = moe_compile.explain(Layers(), x)
    found = [(r.module, r.status) for r in rep.regions]
    assert found == [("layers.0.mlp", "rewritten"), ("layers.1.mlp", "rewritten")], str(rep)
    assert rep.graphs == 1, "the test needs one graph serving both layers"
    rep = moe_compile.explain(Layers(second="assign"), x)
    found = [(r.module, r.status) for r in rep.regions]
    assert found == [("layers.0.mlp", "rewritten"), ("layers.1.mlp", "refused")], str(rep)
    assert "layers.1.mlp" in str(rep)


class TiedLayers(Layers):
    """Layers whose routers share one weight, and a second name for layer 1 (``last``): a tensor or a
    module with several names in the model must not move a record to another layer's path."""

    def __init__(self, graph_break: bool):
        super().__init__()
        self.graph_break = graph_break
        self.layers[1].mlp.router.proj.weight = self.layers[0].mlp.router.proj.weight
        self.last = self.layers[1]

    def forward(self, x):
        for layer in self.layers:
            if self.graph_break:
                torch._dynamo.graph_break()
            x = layer(x)
        return x


def test_explain_places_layers_with_tied_weights_and_aliases():
    """Found by a review: the last name of a shared tensor won, so layer 0's record moved to
    ``layers.1.mlp`` (and merged with layer 1's), top-level frame included; an aliased module renamed
    a top-level record. Each input now takes the name that matches its own path best, and inputs
    still ambiguous (a tied weight seen from a layer's frame) do not place it."""
    x = make_input((2, 5, 16))
    for graph_break in (False, True):
        rep = moe_compile.explain(TiedLayers(graph_break), x)
        found = [(r.module, r.status) for r in rep.regions]
        assert found == [("layers.0.mlp", "rewritten"), ("layers.1.mlp", "rewritten")], (graph_break, str(rep))


def test_refusal_is_one_word():
    """User-visible text calls a refusal "refused", never anything else."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    files = [*root.glob("moe_compile/*.py"), *root.glob("passes/*.py"), *root.glob("lowering/*.py"),
             root / "README.md", *root.glob("docs/*.md")]
    hits = [f"{f.name}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1)
            if re.search(r"\breject", line, re.I)]
    assert not hits, hits


def test_docs_and_tests_name_no_outside_files():
    """No machine paths in tests, no references to files outside the repository in docs or README."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    bad = re.compile(r"(/work/|/root/|/home/|/tmp/|\.\./shared|shared/notes|[A-Z]:\\\\)")
    files = [*root.glob("tests/**/*.py"), root / "README.md", *root.glob("docs/*.md")]
    hits = [f"{f.relative_to(root)}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1)
            if bad.search(line) and f.name != "test_explain.py"]
    assert not hits, hits


def _dropout_model():
    torch.manual_seed(0)
    m = make_model(spelling="index_add", expert="gelu_seq")
    for ex in m.experts.experts:
        ex.insert(2, nn.Dropout(0.1))
    return m.train()


def test_explain_of_a_compiled_model_uses_its_options():
    """explain(torch.compile(m, backend="moe", options=...)) reports what that compile does: its
    moe.disable, its moe.inductor (dropout in the experts is refused where the compile keeps eager's
    draws), its Inductor fallback_random; for a compiled module and a compiled function. The model
    itself is explained as the default compile runs it."""
    x = make_input((6, 16))
    model = Block(spelling="index_add", e=4, k=2)
    for compiled in (torch.compile(model, backend="moe", options={"moe.disable": ["loop_regions"]}),
                     torch.compile(lambda t: model(t), backend="moe", options={"moe.disable": ("loop_regions",)})):
        rep = moe_compile.explain(compiled, x)
        assert [r.code for r in rep.refused] == ["moe_unmatched"] and not rep.rewritten, str(rep)
        assert "disabled by moe.disable" in rep.refused[0].reason
    assert len(moe_compile.explain(model, x).rewritten) == 1
    dropout = _dropout_model()
    assert len(moe_compile.explain(dropout, x).rewritten) == 1   # the default compile (Inductor's draws)
    for options in ({"moe.inductor": False}, {"fallback_random": True}):
        rep = moe_compile.explain(torch.compile(dropout, backend="moe", options=options), x)
        assert [r.code for r in rep.refused] == ["random_in_experts"], (options, str(rep))
    rep = moe_compile.explain(torch.compile(dropout, backend="inductor"), x)   # not ours: the default's
    assert len(rep.rewritten) == 1, str(rep)


@pytest.mark.parametrize("first", [False, True])
def test_explain_follows_the_fallback_random_its_compile_ran_with(first):
    """Compiled (and called) under one global fallback_random, explained under the other: explain() read the
    global at explain time and reported what the compiled model does not run (review helper-74)."""
    torch._dynamo.reset()
    x = make_input((6, 16))
    with torch._inductor.config.patch(fallback_random=first):
        compiled = torch.compile(_dropout_model(), backend="moe")   # Inductor: its own draws unless fallback_random
        with records.recording() as graphs:
            compiled(x)
    ran = [(r.status, r.code) for g in graphs for r in g]
    assert ran == ([("refused", "random_in_experts")] if first else [("rewritten", "")]), ran
    with torch._inductor.config.patch(fallback_random=not first):
        rep = moe_compile.explain(compiled, x)
    assert [(r.status, r.code) for r in rep.regions] == ran, str(rep)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_explain_of_a_model_compiled_with_another_backend_says_so(backend):
    """Such a compile rewrites nothing; explain() reported "rewritten" with no word of that."""
    x = make_input((6, 16))
    rep = moe_compile.explain(torch.compile(Block(spelling="index_add", e=4, k=2), backend=backend), x)
    assert len(rep.rewritten) == 1 and any(f"backend={backend!r}" in n and "rewrites no MoE region" in n
                                           for n in rep.notes), str(rep)
    assert not moe_compile.explain(torch.compile(Block(spelling="index_add"), backend="moe"), x).notes


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block(spelling="index_add", e=4, k=2) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_explain_of_compile_blocks_follows_that_calls_backend_and_options():
    """compile_blocks(model, options=...): explain() of the model, and of one block, reports what that
    call's compiles do (here: refused, loop_regions disabled); it ignored them and said "rewritten". With
    another backend: rewritten by the moe backend, and a note that that compile rewrites nothing."""
    torch._dynamo.reset()
    x = make_input((6, 16))
    model = _TwoLayers()
    moe_compile.compile_blocks(model, options={"moe.disable": ["loop_regions"], "moe.inductor": False})
    for target, paths in ((model, ["layers.0.mlp", "layers.1.mlp"]), (model.layers[0], ["mlp"])):
        rep = moe_compile.explain(target, x)
        assert [(r.module, r.code) for r in rep.refused] == [(p, "moe_unmatched") for p in paths], str(rep)
        assert not rep.rewritten, str(rep)
    torch._dynamo.reset()
    other = _TwoLayers()
    moe_compile.compile_blocks(other, backend="aot_eager")
    rep = moe_compile.explain(other, x)
    assert len(rep.rewritten) == 2 and len(rep.notes) == 1 and "backend='aot_eager'" in rep.notes[0], str(rep)
    rep = moe_compile.explain(other.layers[0], x)
    assert len(rep.rewritten) == 1 and "backend='aot_eager'" in rep.notes[0], str(rep)
    # the whole model compiled with backend="moe" after that: its compile is the one explained (helper-77)
    rep = moe_compile.explain(torch.compile(other, backend="moe"), x)
    assert len(rep.rewritten) == 2 and not rep.notes, str(rep)


@pytest.mark.parametrize("options", [{}, {"moe.rehome_weights": False}, {"moe.disable": ["rehome_weights"]},
                                     {"moe.stack_expert_params": False}])
def test_explain_notes_follow_the_compiles_weight_options(options):
    """The notes on ModuleList expert weights said "the compile moves them into one buffer" and "gives the
    graph one stacked input" whatever the compile's moe.rehome_weights / moe.stack_expert_params said."""
    model = make_model(h=16, i=8, e=32, k=2, spelling="index_add")
    (r,) = moe_compile.explain(torch.compile(model, backend="moe", options=options), make_input((7, 16))).rewritten
    moved = [n for n in r.notes if "moves them into one buffer" in n]
    stacked = [n for n in r.notes if "one stacked input per buffer instead" in n]
    separate = [n for n in r.notes if "96 per-expert weight tensors enter the compiled graph one by one" in n]
    rehome = not ("moe.rehome_weights" in options or "rehome_weights" in options.get("moe.disable", ()))
    stack = rehome and "moe.stack_expert_params" not in options
    assert (bool(moved), bool(stacked), bool(separate)) == (rehome, stack, not stack), r.notes


@pytest.mark.parametrize("called,disable", [(False, ()), (True, ("loop_regions",))])
def test_explain_of_a_model_compiled_in_place(called, disable):
    """model.compile(backend="moe", options=...): explain ran the user's compiled call before its first
    call (Inductor and the weights' re-homing included: the expert weights moved), and reported 0 graphs
    after it; it now traces the module with that compile's options, changing nothing."""
    torch._dynamo.reset()
    model = make_model(spelling="index_add", e=4, k=2, h=16, i=12)
    model.compile(backend="moe", options={"moe.disable": disable})
    x = make_input((10, 16))
    if called:
        model(x)
    where = [p.data_ptr() for p in model.experts.parameters()]
    report = moe_compile.explain(model, x)
    expected = [("refused", "moe_unmatched")] if disable else [("rewritten", "")]
    assert [(r.status, r.code) for r in report.regions] == expected, str(report)
    assert where == [p.data_ptr() for p in model.experts.parameters()]


class _CalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = make_model(spelling="index_add", e=4, k=2)

    def forward(self, x):
        return self.a(x + self.a(x))


def test_a_module_called_twice_is_one_row_that_says_so():
    """The compile counts both calls (2 rewritten); explain listed one row with nothing to say there
    were two."""
    torch._dynamo.reset()
    rep = moe_compile.explain(_CalledTwice(), make_input((9, 16)))
    assert [r.module for r in rep.rewritten] == ["a"], str(rep)
    assert rep.rewritten[0].notes[0].startswith("found 2 times in the traced graphs"), str(rep)


def test_skipped_frame_records_do_not_outlive_a_dynamo_reset():
    """A frame Dynamo gave up on (past the recompile limit, say) is compiled again after torch._dynamo.reset():
    its record must not be listed by a later explain() (found writing test_blocks' recorder test: another
    test's per-layer recompile limit was listed for a model that never hit it)."""
    from moe_compile import skipped_frames

    rec = records.RegionRecord("", "skipped frame", records.REFUSED, "r", (), "m.py:3", code="recompile_limit")
    skipped_frames.live_skips()[("m.py", 3)] = (("m.py", 1, "forward"), rec)
    skipped_frames._mark_epoch()
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))   # compiles run the marker: still listed
    assert ("m.py", 3) in skipped_frames.live_skips()
    torch._dynamo.reset()
    assert ("m.py", 3) not in skipped_frames.live_skips()


@pytest.mark.parametrize("how", ["in_place", "assigned_back", "other_backend"])
def test_explain_of_a_model_whose_submodule_alone_is_compiled(how):
    """Only one layer compiled (``layer.mlp.compile(backend="moe")``, or ``torch.compile(layer)`` assigned back):
    explain() traces the whole model and said "2 rewritten" with no word that the other layer runs eagerly
    (review helper-90). Now notes name the compiled submodule and the regions outside it; a submodule compiled
    with another backend counts as not compiled with ours."""
    torch._dynamo.reset()
    x = make_input((6, 16))
    model = _TwoLayers()
    if how == "in_place":
        model.layers[1].mlp.compile(backend="moe", options={"moe.inductor": False})
    elif how == "assigned_back":
        model.layers[1] = torch.compile(model.layers[1], backend="moe", options={"moe.inductor": False})
    else:
        model.layers[1].mlp.compile(backend="aot_eager")
    model(x)
    rep = moe_compile.explain(model, x)
    if how == "other_backend":
        assert not rep.notes, str(rep)
        return
    compiled = "layers.1.mlp" if how == "in_place" else "layers.1"
    assert len(rep.notes) == 2 and f"({compiled})" in rep.notes[0], str(rep)
    assert rep.notes[1].startswith("layers.0.mlp: outside every submodule compiled"), str(rep)
