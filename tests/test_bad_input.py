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
