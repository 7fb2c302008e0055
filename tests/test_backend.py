"""The backend as a user meets it: must-not-match graphs, recompiles, options, pass disabling,
matcher failures, debug logging, the entry point, and a light ``import moe_compile``."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_compile
import moe_compile.pipeline as pipeline
from moe_compile import records
from helpers import FP32_REL, assert_close_rel, check_compiled, make_input, make_model, spy_static_inputs

HERE = os.path.dirname(__file__)


# ------------------------------------------------------------------------------ must not match
class DenseMLP(nn.Module):
    def __init__(self, h=16, i=24):
        super().__init__()
        self.up, self.down = nn.Linear(h, i), nn.Linear(i, h)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    def __init__(self, h=16, heads=2):
        super().__init__()
        self.qkv, self.o, self.heads = nn.Linear(h, 3 * h), nn.Linear(h, h), heads

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(att.transpose(1, 2).reshape(b, s, h))


class TopkNoExperts(nn.Module):
    """A top-k selection and a scatter-add into zeros, but no expert function: not an MoE."""

    def __init__(self, h=16, e=4):
        super().__init__()
        self.router, self.e = nn.Linear(h, e), e

    def forward(self, x):
        x = x.reshape(-1, x.shape[-1])
        w, ids = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for i in range(self.e):
            tok, slot = torch.where(ids == i)
            out.index_add_(0, tok, x[tok] * w[tok, slot, None])
        return out


@pytest.mark.parametrize("model", [DenseMLP, Attention, TopkNoExperts], ids=lambda c: c.__name__)
def test_must_not_match(model):
    torch.manual_seed(0)
    check_compiled(model(), [make_input((2, 5, 16))], expect_rewritten=0, expect_refused=0)


# ------------------------------------------------------------------------------ recompiles
class CountingBackend:
    """Counts graphs handed to the moe backend (one per Dynamo compile)."""

    def __init__(self, **options):
        self.calls, self.options = 0, options
        from moe_compile.backend import capture_ctx

        self.moe_capture_ctx = capture_ctx

    def __call__(self, gm, example_inputs):
        self.calls += 1
        return moe_compile.moe_backend(gm, example_inputs, options={"moe.inductor": False, **self.options})


def test_no_recompile_when_only_routing_changes():
    torch._dynamo.reset()
    m = make_model(spelling="where_setitem", k=2, e=4)
    backend = CountingBackend()
    cm = torch.compile(m, backend=backend)
    before = records.counters["rewritten"]
    x = make_input((2, 5, 16))
    torch.testing.assert_close(cm(x), m(x))
    assert backend.calls == 1 and records.counters["rewritten"] == before + 1
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed, routing_bias in enumerate([0.0, 30.0, -30.0]):  # new routings, incl. one hot expert
        with torch.no_grad():
            m.router.proj.bias[0] = routing_bias
        x = make_input((2, 5, 16), seed=seed + 1)
        torch.testing.assert_close(cm(x), m(x))
    assert backend.calls == 1, "a routing change recompiled the graph"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


# ------------------------------------------------------------------------------ options
class FloatAttrMoE(nn.Module):
    """A float attribute the forward branches on: under dynamic=True Dynamo keeps it symbolic, and
    compiling the graph raises Dynamo's TensorifyScalarRestartAnalysis (trace again, specialised)."""

    def __init__(self):
        super().__init__()
        self.inner, self.scale = make_model(), 1.0

    def forward(self, x):
        return self.inner(x) * self.scale if self.scale != 1 else self.inner(x)


@pytest.mark.parametrize("options", [{"moe.inductor": False}, {}])
def test_dynamo_restart_is_not_a_compile_failure(options):
    """Was: the restart was caught as a failure of the rewritten graph, so the layer was compiled
    unrewritten (refused, compile_error) on every dynamic=True compile of such a model."""
    model, x = FloatAttrMoE(), make_input((7, 16))
    torch._dynamo.reset()
    with records.recording() as published:
        out = torch.compile(model, backend="moe", options=options, dynamic=True)(x)
    assert [(r.status, r.code) for g in published for r in g] == [("rewritten", "")], published
    assert_close_rel(out.detach(), model(x).detach(), FP32_REL, "output")


def test_unknown_option_lists_allowed_keys():
    torch._dynamo.reset()
    cm = torch.compile(DenseMLP(), backend="moe", options={"moe.foo": 1})
    with pytest.raises(Exception) as info:
        cm(make_input((3, 16)))
    err = info.value
    while not isinstance(err, ValueError) and err.__cause__ is not None:
        err = err.__cause__
    assert isinstance(err, ValueError)
    assert "moe.foo" in str(err) and "moe.debug" in str(err) and "moe.disable" in str(err)


@pytest.mark.parametrize("key, value, expect", [
    ("epilogue_fusionn", False, "did you mean 'epilogue_fusion'"),   # a typo in an Inductor option
    ("max_autotune", "yes", "must be a bool"),                        # a value of the wrong type
    ("moe.debugg", True, "did you mean 'moe.debug'"),
])
def test_bad_option_raises_before_tracing(key, value, expect):
    """A bad option reaches the user as ValueError on the first call, naming the key and the allowed
    ones, before Dynamo traces anything: raised inside the backend, Dynamo's suppress_errors (on in the
    capture scope) would run the model eagerly with exit code 0."""
    torch._dynamo.reset()
    before = dict(records.counters)
    frames = torch._dynamo.utils.counters["frames"]["total"]
    cm = torch.compile(make_model(spelling="index_add"), backend="moe", options={key: value})
    with pytest.raises(ValueError) as info:
        cm(make_input((6, 16)))
    assert repr(key) in str(info.value) and expect in str(info.value)
    assert "moe.debug" in str(info.value) or "must be" in str(info.value)  # the allowed keys are listed
    assert dict(records.counters) == before
    assert torch._dynamo.utils.counters["frames"]["total"] == frames, "Dynamo traced a frame with a bad option"


def test_unknown_inductor_option_error_is_short():
    """An unknown key named Inductor's whole key list (~20,000 characters) after the close matches;
    the error now points at torch._inductor.list_options()."""
    from moe_compile.config import MoEConfig

    with pytest.raises(ValueError) as info:
        MoEConfig.from_options(None, {"epilogue_fusionn": False})
    text = str(info.value)
    assert "did you mean 'epilogue_fusion'" in text and "torch._inductor.list_options()" in text
    assert len(text) < 2000, len(text)


@pytest.mark.parametrize("options, expect", [
    ({"moe.disable": None}, "moe.disable must be a pass name or a list of pass names, got None"),
    ({"moe.disable": 5}, "moe.disable must be a pass name or a list of pass names, got 5"),
    ([("moe.debug", True)], "options must be a dict of option names to values, got list"),
    ({1: True}, "option names are strings, got 1"),
])
def test_malformed_options_name_the_problem(options, expect):
    """Were bare TypeError / AttributeError from inside the config."""
    from moe_compile.config import MoEConfig

    with pytest.raises(ValueError, match=re.escape(expect)):
        MoEConfig.from_options(None, options)


@pytest.mark.parametrize("mode, options, expect", [
    (None, {"moe.inductor": False, "max_autotune": True}, r"moe.inductor=False .* \['max_autotune'\] would have no"),
    ("max-autotune", {"moe.inductor": False}, r"moe.inductor=False .* \['mode'\]"),
    (None, {"moe.inductor": False, "moe.mode": "reduce-overhead"}, r"\['mode'\]"),
    (None, {"moe.stack_expert_params": True, "moe.disable": ["stack_expert_params"]}, "keep one of them"),
    (None, {"moe.rehome_weights": True, "moe.disable": "rehome_weights"}, "keep one of them"),
    (None, {"moe.ep_overlap_chunks": 2, "moe.disable": ["ep_overlap"]}, "ep_overlap_chunks=2 splits"),
])
def test_options_that_undo_each_other_raise(mode, options, expect):
    """Were accepted, one of them silently without effect (review helper-95)."""
    from moe_compile.config import MoEConfig

    with pytest.raises(ValueError, match=expect):
        MoEConfig.from_options(mode, options)
    MoEConfig.from_options(None, {"moe.inductor": False, "fallback_random": True})   # read without Inductor too


def test_custom_pass_option_of_the_wrong_type_names_the_key():
    """Typed Optional[Callable] in Inductor's config, so the type check let 5 through: compiling failed twice deep
    in Inductor ("'int' object is not callable"), the unrewritten fallback included (review helper-95)."""
    from moe_compile.config import MoEConfig

    with pytest.raises(ValueError, match="'post_grad_custom_post_pass' must be None, a callable"):
        MoEConfig.from_options(None, {"post_grad_custom_post_pass": 5})
    MoEConfig.from_options(None, {"post_grad_custom_post_pass": lambda graph: None, "joint_custom_pre_pass": None})


def test_explain_of_a_model_compiled_with_inductor_options():
    """explain() runs without Inductor: the compile's Inductor options and mode are not passed on to it."""
    for options in ({"max_autotune": False, "moe.mode": "max-autotune"}, {"moe.rehome_weights": True}):
        compiled = torch.compile(make_model(spelling="index_add"), backend="moe", options=options)
        rep = moe_compile.explain(compiled, make_input((6, 16)))
        assert [r.status for r in rep.regions] == ["rewritten"], str(rep)


def test_api_calls_on_the_wrong_object_name_the_problem():
    with pytest.raises(TypeError, match="expected a model .* got the class Linear"):
        moe_compile.explain(nn.Linear, make_input((3, 16)))
    with pytest.raises(TypeError, match="expected a model .* got str"):
        moe_compile.explain("model", make_input((3, 16)))
    with pytest.raises(TypeError, match="compile_blocks: expected an nn.Module .* got str"):
        moe_compile.compile_blocks("model")
    from moe_compile.parallel import clip_grad_norm_   # torch's calling convention: an AttributeError (helper-98)
    with pytest.raises(TypeError, match=r"takes the model .* not clip_grad_norm_\(model.parameters\(\)"):
        clip_grad_norm_(nn.Linear(2, 2).parameters(), 1.0)


def test_bad_mode_raises_before_tracing():
    """The error names the argument given: torch.compile's mode= (it named moe.mode: helper-75)."""
    torch._dynamo.reset()
    cm = torch.compile(make_model(spelling="index_add"), backend="moe", mode="fastest")
    with pytest.raises(ValueError, match="torch.compile's mode='fastest'.*max-autotune"):
        cm(make_input((6, 16)))
    cm = torch.compile(make_model(spelling="index_add"), backend="moe", options={"moe.mode": "fastest"})
    with pytest.raises(ValueError, match="moe.mode='fastest'.*max-autotune"):
        cm(make_input((6, 16)))


def test_inductor_options_normalised():
    from moe_compile.config import MoEConfig

    _, rest = MoEConfig.from_options(None, {"max-autotune": False, "triton.cudagraphs": False})
    assert rest == {"max_autotune": False, "triton.cudagraphs": False}


def test_config_validation():
    from moe_compile.config import MoEConfig

    with pytest.raises(ValueError, match="moe.mode"):
        MoEConfig.from_options(None, {"moe.mode": "fastest"})
    with pytest.raises(ValueError, match="unknown passes"):
        MoEConfig.from_options(None, {"moe.disable": ("nope",)})
    with pytest.raises(ValueError, match="conflicts"):
        MoEConfig.from_options("max-autotune", {"moe.mode": "reduce-overhead"})
    cfg, rest = MoEConfig.from_options("max-autotune", {"moe.debug": True, "max_autotune": False})
    assert cfg.mode == "max-autotune" and cfg.debug and rest == {"max_autotune": False}
    cfg, _ = MoEConfig.from_options(None, {"moe.mode": "reduce-overhead"})
    assert cfg.mode == "reduce-overhead"


def test_moe_mode_option_and_mode_kwarg_run(monkeypatch):
    """`mode=` and `options={"moe.mode": ...}` both reach the backend's config, and the model runs.
    (The Inductor hand-over is replaced by AOTAutograd here: `mode=` cannot be combined with options.)"""
    import moe_compile.backend as backend
    from torch._dynamo.backends.debugging import aot_eager

    seen = []

    def fake_compile(gm, example_inputs, config, inductor_options, records=(), notes=None):
        seen.append(config.mode)
        return aot_eager(gm, example_inputs)

    monkeypatch.setattr(backend, "_compile_rewritten", fake_compile)
    m = make_model(spelling="index_add")
    x = make_input((6, 16))
    torch._dynamo.reset()
    out = torch.compile(m, backend="moe", options={"moe.mode": "max-autotune-no-cudagraphs"})(x)
    torch.testing.assert_close(out, m(x))
    torch._dynamo.reset()
    out = torch.compile(m, backend="moe", mode="max-autotune-no-cudagraphs")(x)
    torch.testing.assert_close(out, m(x))
    assert seen == ["max-autotune-no-cudagraphs"] * 2


def test_inductor_options_forwarded(monkeypatch):
    """Non-moe options go to Inductor as config patches; the rewritten model compiles with Inductor."""
    import torch._inductor.compile_fx as cfx

    patches_seen = []
    orig = cfx.compile_fx

    def spy(gm, inputs, config_patches=None, **kw):
        patches_seen.append(dict(config_patches or {}))
        return orig(gm, inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    m = make_model(spelling="index_add", h=8, i=8, e=3, k=2)
    check_compiled(m, [make_input((5, 8))], expect_rewritten=1, inductor=True, fresh_inputs=0,
                   options={"epilogue_fusion": False})
    assert patches_seen and patches_seen[0].get("epilogue_fusion") is False  # later calls: compile_fx recursing
    # ModuleList experts stacked (one input per linear, the default): Inductor's defaults stand
    assert "size_asserts" not in patches_seen[0]
    # ModuleList experts that reach the ops as per-expert lists: the backend turns Inductor's per-input
    # size asserts off (Dynamo guards cover them) ...
    patches_seen.clear()
    check_compiled(m, [make_input((5, 8))], expect_rewritten=1, inductor=True, fresh_inputs=0,
                   options={"moe.stack_expert_params": False})
    assert patches_seen[0].get("size_asserts") is False
    # ... unless the user asks for them
    patches_seen.clear()
    check_compiled(m, [make_input((5, 8))], expect_rewritten=1, inductor=True, fresh_inputs=0,
                   options={"size_asserts": True, "moe.stack_expert_params": False})
    assert patches_seen[0].get("size_asserts") is True


def test_inductor_defaults_only_for_list_regions():
    from moe_compile.backend import inductor_defaults
    from moe_compile.records import RegionRecord

    def rec(status, *ops):
        return RegionRecord("m", "loop", status, "", ops, "here")

    assert inductor_defaults([rec("rewritten", "grouped_mm_list_cat", "grouped_mm_list")]) == {"size_asserts": False}
    assert inductor_defaults([rec("rewritten", "grouped_mm")]) == {}  # 3-D weights: one input per linear
    assert inductor_defaults([rec("refused")]) == {}


def test_disable_pass_leaves_model_unrewritten():
    """Without its finder the loop is not rewritten, and not silently: the unclaimed-MoE detector
    lists it, naming the disabled finder."""
    m = make_model(spelling="where_setitem")
    with records.recording() as graphs:
        check_compiled(m, [make_input((6, 16))], expect_rewritten=0, expect_refused=1,
                       options={"moe.disable": ("loop_regions",)})
    (r,) = {r for g in graphs for r in g}
    assert r.code == "moe_unmatched" and "loop_regions are disabled by moe.disable: remove them from it first" in r.reason, r


def test_matcher_exception_leaves_graph_unchanged(monkeypatch, caplog):
    import moe_compile.passes.loop_regions as mr

    def boom(gm, analysis=None):
        raise RuntimeError("matcher bug")

    monkeypatch.setattr(mr, "find_loop_regions", boom)
    m = make_model(spelling="where_setitem")
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        check_compiled(m, [make_input((6, 16))], expect_rewritten=0, expect_refused=1,
                       options={"moe.strict": False})
    assert "matcher bug" in caplog.text
    torch._dynamo.reset()
    with pytest.raises(Exception, match="matcher bug"):
        torch.compile(make_model(spelling="where_setitem"), backend="moe",
                      options={"moe.strict": True, "moe.inductor": False})(make_input((6, 16)))


@pytest.mark.parametrize("how", ["option", "env"])
def test_debug_logs_graphs(how, monkeypatch, caplog):
    opts = {"moe.inductor": False}
    if how == "option":
        opts["moe.debug"] = True
    else:
        monkeypatch.setenv("MOE_COMPILE_DEBUG", "1")
    torch._dynamo.reset()
    m = make_model(spelling="index_add")
    x = make_input((6, 16))
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        torch.testing.assert_close(torch.compile(m, backend="moe", options=opts)(x), m(x))
    assert "dynamo graph" in caplog.text and "after lower" in caplog.text
    assert "index_add_" in caplog.text and "moe_compile.grouped_mm" in caplog.text
    assert "rewritten" in caplog.text
    # the ModuleList weights were stacked after the dynamo stage: the table and graph of what compiles
    compiled_table = caplog.text.split("MoE region(s), as compiled")[-1]
    assert "after stack_expert_params" in compiled_table and "grouped_mm_list" not in compiled_table


def test_debug_logs_the_table_when_nothing_is_rewritten(caplog):
    torch._dynamo.reset()
    m = make_model(spelling="index_add")
    opts = {"moe.inductor": False, "moe.debug": True, "moe.disable": ("loop_regions", "grouped_regions")}
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        torch.compile(m, backend="moe", options=opts)(make_input((6, 16)))
    assert "1 MoE region(s) in" in caplog.text and "moe_unmatched" in caplog.text, caplog.text
    # with both finders disabled the layer is still found, and the reason says why it was not rewritten
    assert "the finders loop_regions, grouped_regions are disabled by moe.disable" in caplog.text
    # and the graph the finders read is logged, to see what they saw (it was the table alone: helper-75)
    assert "as captured (nothing rewritten)" in caplog.text and "index_add_" in caplog.text, caplog.text


def test_no_debug_logging_by_default(monkeypatch, caplog):
    monkeypatch.delenv("MOE_COMPILE_DEBUG", raising=False)
    torch._dynamo.reset()
    m = make_model(spelling="index_add")
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        torch.compile(m, backend="moe", options={"moe.inductor": False})(make_input((6, 16)))
    assert "dynamo graph" not in caplog.text


# ------------------------------------------------------------------------------ subprocesses
def _run_py(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MOE_COMPILE_DEBUG", "TORCH_LOGS")}
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_entry_point_without_import():
    out = _run_py("""
        import sys, torch
        from helpers import make_model, make_input   # helpers import moe_compile.records: drop it
        for k in [k for k in sys.modules if k.startswith("moe_compile")]:
            del sys.modules[k]
        m = make_model(spelling="where_setitem"); x = make_input((6, 16))
        y = torch.compile(m, backend="moe", options={"moe.inductor": False})(x)
        torch.testing.assert_close(y, m(x))
        import moe_compile.records as r
        print("rewritten", r.counters["rewritten"])
    """)
    assert "rewritten 1" in out


def test_import_is_light_and_scoped():
    out = _run_py("""
        import sys, torch
        import moe_compile
        assert "triton" not in sys.modules, "import moe_compile imported triton"
        assert not torch.cuda.is_initialized()
        assert torch._dynamo.config.capture_dynamic_output_shape_ops is False
        seen = []
        def other_backend(gm, example_inputs):
            seen.append(torch._dynamo.config.capture_dynamic_output_shape_ops)
            return gm.forward
        def f(x):
            return torch.nonzero(x > 0).float().sum() + x.sum()
        x = torch.randn(8)
        torch.testing.assert_close(torch.compile(f, backend=other_backend)(x), f(x))
        # the moe backend was looked up in the same process: still no global flag
        torch.compile(lambda x: x.relu() + 1, backend="moe", options={"moe.inductor": False})(x)
        assert torch._dynamo.config.capture_dynamic_output_shape_ops is False
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(f, backend=other_backend)(x), f(x))
        assert seen and not any(seen), seen
        assert not torch.cuda.is_initialized()   # (torch's own AOTAutograd imports triton when compiling)
        print("ok")
    """)
    assert "ok" in out


def test_rewritten_graph_keeps_dynamo_annotations(monkeypatch):
    """The rewritten copy of Dynamo's graph keeps what AOTAutograd reads from it: the parameter
    sources and each placeholder's source, so the parameters stay static inputs (CUDA graphs would
    otherwise copy every expert weight on every replay) and their guards stay deduplicated."""
    seen = spy_static_inputs(monkeypatch)
    graphs = {}
    real = pipeline.run_dynamo_stage

    def record(gm, example_inputs, config):
        new, records = real(gm, example_inputs, config)
        graphs.update(before=gm, after=new, records=records)
        return new, records

    monkeypatch.setattr(pipeline, "run_dynamo_stage", record)
    m = make_model(spelling="index_add", h=8, i=8, e=3, k=2)
    torch._dynamo.reset()
    # (stacked ModuleList weights replace placeholders after this stage: tests/test_expert_stack.py)
    torch.compile(m, backend="moe", options={"moe.inductor": False, "moe.stack_expert_params": False})(
        make_input((5, 8))).sum().backward()
    before, after = graphs["before"], graphs["after"]
    assert after is not before and [r.status for r in graphs["records"]] == ["rewritten"]
    assert after._param_name_to_source is before._param_name_to_source
    assert after.meta.get("dynamo_compile_id") == before.meta.get("dynamo_compile_id") is not None
    src = lambda g: [getattr(n, "_dynamo_source", None) for n in g.graph.find_nodes(op="placeholder")]  # noqa: E731
    assert src(after) == src(before) and None not in src(before)
    if seen is not None:  # every parameter is a static input of the compiled graph
        assert len(seen["static"]) == len(list(m.parameters()))


def test_dynamo_stage_generates_no_code(monkeypatch):
    """The dynamo stage copies Dynamo's lazy GraphModule as a lazy one and edits its graph in several
    passes without generating Python code for it: the code is generated once, where AOTAutograd first
    runs the graph (each generation of a 12k-node graph's code took ~0.2 s: the copy and four passes
    each made one). The compiled model still matches eager, forward and backward."""
    import torch.fx as fx

    counts = {"in stage": 0, "after": 0}
    where = ["after"]
    real_recompile, real_stage = fx.GraphModule.recompile, pipeline.run_dynamo_stage

    def counting(self, *a, **k):
        counts[where[0]] += 1
        return real_recompile(self, *a, **k)

    def stage(gm, example_inputs, config):
        where[0] = "in stage"
        try:
            new, recs = real_stage(gm, example_inputs, config)
        finally:
            where[0] = "after"
        assert new is not gm and [r.status for r in recs] == ["rewritten"], recs
        return new, recs

    monkeypatch.setattr(fx.GraphModule, "recompile", counting)
    monkeypatch.setattr(pipeline, "run_dynamo_stage", stage)
    check_compiled(make_model(spelling="index_add", e=4, k=2), [make_input((7, 16))], expect_rewritten=1)
    assert counts["in stage"] == 0 and counts["after"] >= 1, counts


def test_compiled_module_pickles_and_the_copy_is_rewritten():
    """torch.save / pickle of an OptimizedModule pickles its Dynamo context, the backend's capture scope
    factory included: it was a closure ("Can't pickle local object 'capture_ctx.<locals>.ctor'"). The
    copy compiles with backend="moe" again (its own session) and matches eager."""
    import io

    from helpers import FP32_REL, assert_close_rel, make_input, make_model
    from moe_compile import records

    model = make_model(spelling="index_add", e=4, k=2)
    x = make_input((12, 16), requires_grad=False)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend="moe", options={"moe.inductor": False})
    compiled(x)
    buf = io.BytesIO()
    torch.save(compiled, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    torch._dynamo.reset()
    before = records.counters[records.REWRITTEN]
    got = again(x)
    assert records.counters[records.REWRITTEN] - before == 1
    assert_close_rel(got, model(x), FP32_REL, "output of the unpickled compiled model")


@pytest.mark.parametrize("inductor", [False, True])
def test_model_to_with_swapped_parameters_after_a_compile(inductor, swap_params_on_conversion):
    """``model.to(dtype)`` under ``set_swap_module_params_on_conversion(True)`` swaps each Parameter's
    contents in place, which torch refuses for a tensor something holds a weak reference to. The
    rewritten graph copy kept Dynamo's graph args (weak references to every Parameter input, the
    stacked experts' erased placeholders too): "Couldn't swap Linear.weight" after any moe compile
    (review helper-60). Now it converts, and the compiled model matches eager in the new dtype."""
    torch._dynamo.reset()
    model = make_model(spelling="index_add", e=4, k=2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": inductor})
    compiled(make_input((9, 16))).sum().backward()
    model.to(torch.float64)
    ref.to(torch.float64)
    x = make_input((9, 16)).double()
    assert_close_rel(compiled(x), ref(x), FP32_REL, "output after .to(float64)")


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "invalidate_compile_context_weakrefs"),
                    reason="torch < 2.13 keeps the weak references of every compile")
def test_model_to_with_swapped_parameters_after_explain(swap_params_on_conversion):
    """explain() compiles with a backend of its own, not a registered one, for which Dynamo kept the weak
    references its fake tensor converter holds to every Parameter: "Couldn't swap Linear.weight" at the
    next ``model.to(dtype)`` (review helper-67). Now the model converts after explain."""
    torch._dynamo.reset()
    model = make_model(spelling="index_add", e=4, k=2)
    ref = copy.deepcopy(model)
    assert moe_compile.explain(model, make_input((9, 16))).rewritten
    model.to(torch.float64)
    ref.to(torch.float64)
    compiled = torch.compile(model, backend="moe")
    x = make_input((9, 16)).double()
    assert_close_rel(compiled(x), ref(x), FP32_REL, "output after explain and .to(float64)")
