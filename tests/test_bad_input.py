"""Bad input gets a clear error naming the problem and the fix, and changes nothing for the next, good
call (a review of the public API): a call with wrong inputs, compile_blocks given something other than
the model's blocks, the ops given wrong arguments, examples/train.py given wrong flags."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

import moe_compile
from helpers import make_input, make_model
from moe_compile import records
from moe_compile.kernels import ops  # noqa: F401  (registers torch.ops.moe_compile.*)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = torch.ops.moe_compile


def test_a_call_with_wrong_inputs_leaves_the_next_call_rewritten(caplog):
    """Under the capture scope Dynamo swallows its errors: a first call with a wrong width left the frame
    running eagerly for good (never rewritten), with a refused record whose fix blamed the MoE code."""
    torch._dynamo.reset()
    compiled = torch.compile(make_model(spelling="index_add", e=4, k=2, h=16, i=12), backend="moe",
                             options={"moe.inductor": False})
    before = dict(records.counters)
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        compiled(make_input((8, 17)))
    compiled(make_input((8, 16))).sum().backward()
    delta = {k: records.counters[k] - before.get(k, 0) for k in (records.REWRITTEN, records.REFUSED)}
    assert delta == {"rewritten": 1, "refused": 0}, delta
    assert "break_other" not in caplog.text


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = make_model(spelling="index_add", e=4, k=2, h=16, i=12)

    def forward(self, x):
        return x + self.moe(x)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_compile_blocks_refuses_what_is_not_the_models_blocks():
    """A single MoE layer's experts were taken as the blocks (each expert compiled alone, the router eager,
    nothing rewritten); blocks of another model were compiled and the model ran eagerly; a path to a
    module, or ints, failed deep inside with TypeError / AttributeError."""
    with pytest.raises(ValueError, match="look like the experts of an MoE layer .*'router.proj.weight'"):
        moe_compile.compile_blocks(make_model(spelling="index_add", e=4, k=2, h=16, i=12))
    model = _Model()
    with pytest.raises(ValueError, match="is not a submodule of the model"):
        moe_compile.compile_blocks(model, blocks=[_Layer()])
    with pytest.raises(TypeError, match="blocks='embed' is Linear, not a ModuleList"):
        moe_compile.compile_blocks(model, blocks="embed")
    with pytest.raises(TypeError, match="blocks must be modules of the model .* got a int"):
        moe_compile.compile_blocks(model, blocks=[1, 2])
    assert moe_compile.compile_blocks(model, blocks=model.layers[0]) == [model.layers[0]]  # one module: one block


def test_ops_name_a_wrong_argument():
    """Float offsets, 1-D rows and a bias count unlike the experts' failed inside the references
    (TypeError: slice indices, IndexError)."""
    x, w = torch.randn(4, 3), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="grouped_mm: offsets must be integer"):
        OPS.grouped_mm(x, w, torch.tensor([1.0, 4.0]))
    with pytest.raises(ValueError, match=r"unpermute_combine: y must be \[T\*K, H\]"):
        OPS.unpermute_combine(torch.randn(4), torch.arange(4), torch.rand(2, 2), torch.tensor([2, 4], dtype=torch.int32))
    ws = [torch.randn(5, 3), torch.randn(5, 3)]
    with pytest.raises(ValueError, match="grouped_mm_list: 1 biases for 2 experts"):
        OPS.grouped_mm_list(x, ws, torch.tensor([1, 4], dtype=torch.int32), [torch.randn(5)], True)


@pytest.mark.parametrize("argv,message", [
    (["--set", "num_experts"], "--set takes KEY=VALUE"),
    (["--set", "num_experts=abc"], "is not a Python literal"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--layers", "0"], "--layers must be at least 1"),
    (["--noise", "2"], "--noise is a fraction"),
])
def test_train_example_names_a_wrong_flag(argv, message, capsys):
    """Each failed with a traceback (unpacking, literal_eval, ZeroDivisionError after the run, a math
    domain error) or was ignored (--layers 0)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train

    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert message in capsys.readouterr().err


def test_train_example_refuses_a_config_field_it_does_not_have():
    """--set not_a_field=3 was set on the config and ignored: the default model trained."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train

    with pytest.raises(SystemExit, match="has no field 'num_local_expert'"):
        train.make_config(train.parse_args(["--set", "num_local_expert=16"]))


def test_expert_parallel_helpers_name_a_wrong_argument():
    """A None or string mesh, or no model, failed with AttributeError ('NoneType' object has no attribute 'size')."""
    model = make_model(spelling="index_add", e=4, k=2, h=16, i=12)
    for fn in (moe_compile.fully_shard_experts, moe_compile.replicate_experts):
        for mesh in (None, "dp"):
            with pytest.raises(TypeError, match=f"{fn.__name__}: expected a DeviceMesh"):
                fn(model, mesh)
    with pytest.raises(TypeError, match=r"parallelize_experts: expected the model \(an nn.Module\)"):
        moe_compile.parallelize_experts(None, None)
    with pytest.raises(TypeError, match="fsdp_ignored_params: expected a module"):
        moe_compile.fsdp_ignored_params(None)


# fp32 on CPU: the compiled graph and eager run the same reference ops in another order
FORWARD_AD_REL = 1e-5


@pytest.mark.parametrize("inductor", [False, True])
@pytest.mark.parametrize("grad", ["frozen", "no_grad", "trainable"])
def test_forward_mode_ad_through_a_rewritten_region_says_so(inductor, grad):
    """Dual tensors (torch.autograd.forward_ad) reaching a rewritten graph: its fused ops have no
    forward-mode formula, so a frozen model's or a no_grad call's output came back with no tangent, a
    silent zero (review helper-107); now a clear error. With a dual level open and no dual input the
    call runs and matches eager."""
    import contextlib
    import copy

    import torch.autograd.forward_ad as fwad

    torch._dynamo.reset()
    m = make_model(spelling="index_add", e=4, k=2)
    if grad == "frozen":
        m.requires_grad_(False)
    compiled = torch.compile(copy.deepcopy(m), backend="moe", options={"moe.inductor": inductor})
    x, tangent = make_input((6, 16), requires_grad=False), make_input((6, 16), requires_grad=False, seed=1)
    ctx = torch.no_grad if grad == "no_grad" else contextlib.nullcontext
    with ctx(), fwad.dual_level():
        ref = m(x)                        # a level open, no dual tensor: runs as without one
        out = compiled(x)
        assert records.counters[records.REWRITTEN] >= 1
        torch.testing.assert_close(out, ref, rtol=FORWARD_AD_REL, atol=FORWARD_AD_REL)
        eager_tangent = fwad.unpack_dual(m(fwad.make_dual(x, tangent))).tangent
        assert eager_tangent is not None and eager_tangent.abs().sum() > 0
        with pytest.raises(RuntimeError, match="forward-mode AD .* no tangent.* uncompiled model"):
            compiled(fwad.make_dual(x, tangent))
    torch.testing.assert_close(compiled(x), m(x), rtol=FORWARD_AD_REL, atol=FORWARD_AD_REL)


# ----------------------------------------------------------------- public API misuse (review helper-114)
def _experts(n=3):
    return nn.ModuleList(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)) for _ in range(n))


@pytest.mark.parametrize("how", ["frozen_second", "frozen_first", "tied", "same_module", "stacked_already"])
def test_stack_experts_refuses_what_stacking_would_change(how):
    """stack_experts took expert 0's requires_grad for every expert (a frozen expert trained, or every expert
    froze), copied a tied weight into independent rows, and half-converted a module listed twice (KeyError)."""
    experts = _experts()
    if how == "frozen_second":
        experts[1].requires_grad_(False)
    elif how == "frozen_first":
        experts[0][0].weight.requires_grad_(False)
    elif how == "tied":
        experts[2][2].weight = experts[0][2].weight
    elif how == "same_module":
        experts = nn.ModuleList([experts[0], experts[1], experts[0]])
    else:
        moe_compile.stack_experts(experts)
    match = {"frozen_second": r"frozen .* in experts \[1\]", "frozen_first": r"'0.weight' is frozen .* experts \[0\]",
             "tied": "experts 0 and 2 share the Parameter '2.weight'", "same_module": "experts 0 and 2 are the same",
             "stacked_already": "stacked already"}[how]
    before = [type(m) for m in experts.modules()]
    with pytest.raises(ValueError, match=match):
        moe_compile.stack_experts(experts)
    if how != "stacked_already":
        assert [type(m) for m in experts.modules()] == before   # nothing converted
    frozen = moe_compile.stack_experts(_experts().requires_grad_(False))   # all alike: fine
    assert not any(p.requires_grad for p in frozen.parameters())


def test_options_that_would_do_nothing_raise(monkeypatch):
    x = make_input((8, 16))
    with pytest.raises(ValueError, match="stack_expert_params=True stacks the buffers moe.rehome_weights makes"):
        torch.compile(make_model(), backend="moe",
                      options={"moe.rehome_weights": False, "moe.stack_expert_params": True})(x)
    torch._dynamo.reset()
    monkeypatch.setenv("MOE_COMPILE_DEBUG", "none")   # was taken for on
    with pytest.raises(ValueError, match="MOE_COMPILE_DEBUG='none' is neither on"):
        torch.compile(make_model(), backend="moe", options={"moe.inductor": False})(x)


def test_compile_blocks_arguments_are_checked():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(make_model() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    with pytest.raises(TypeError, match="already a torch.compile wrapper.*_orig_mod"):
        moe_compile.compile_blocks(torch.compile(Net(), backend="moe"))
    with pytest.raises(ValueError, match=r"no submodule 'layerz'; its containers: \['layers', "):
        moe_compile.compile_blocks(Net(), blocks="layerz")
    with pytest.raises(TypeError, match="blocks must be a dotted path, a module or an iterable of modules, got int"):
        moe_compile.compile_blocks(Net(), blocks=5)
    with pytest.raises(TypeError, match="loss must be True or False"):
        moe_compile.compile_blocks(Net(), loss="no")


def test_compiled_backward_arguments_are_checked():
    for kwargs, match in [({"options": ["moe.inductor"]}, "options must be a dict"),
                          ({"dynamic": "yes"}, "dynamic must be True, False or None"),
                          ({"mode": "max-autotune"}, "moe.mode")]:
        with pytest.raises(TypeError, match=match):
            with moe_compile.compiled_backward(**kwargs):
                pass


def test_explain_given_the_inputs_as_one_tuple_says_how_to_pass_them():
    """explain(model, (x,)) called the model with a tuple: the model's own error, nothing of explain's
    signature (review helper-114). The model's error stays (it may be the user's real bug), with a note."""
    with pytest.raises(AttributeError, match="reshape") as info:
        moe_compile.explain(make_model(), (make_input((8, 16)),))
    assert any("explain(model, *inputs)" in n for n in getattr(info.value, "__notes__", ())), info.value
