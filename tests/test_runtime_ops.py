"""kernels/runtime_ops.py + lowering/runtime_ops.py: differentiated graphs call each moe_compile op's
twin ``torch.ops.moe_compile_rt.<op>`` (the same function, no custom-op Python layers); the public
ops keep one overload each; values and gradients unchanged."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import moe_compile.kernels.ops  # noqa: F401  (registers every moe_compile op)
from moe_compile.kernels.runtime_ops import NAMESPACE, OPS, RUNTIME, profiler_names
from moe_compile.lowering import runtime_ops as lowering_runtime_ops
from moe_compile.passes.normalize import canon

from helpers import check_compiled, make_input, make_model

MOE = torch.ops.moe_compile
RT = getattr(torch.ops, NAMESPACE)


def test_every_compute_op_has_a_twin_with_the_same_schema_and_tags():
    assert len(RUNTIME) == len(OPS), sorted(OPS)
    for name in OPS:
        default, twin = getattr(MOE, name).default, getattr(RT, name).default
        assert RUNTIME[default] is twin
        assert str(twin._schema) == str(default._schema).replace("moe_compile::", f"{NAMESPACE}::", 1)
        assert twin.tags == default.tags
        assert getattr(MOE, name).overloads() == ["default"]   # opcheck and friends take the packet


def _routing_args():
    x = make_input((6, 4), seed=1)
    ids = torch.tensor([[0, 2], [2, 1], [0, 0], [1, 2], [2, 2], [0, 1]])
    perm, inv, offs = MOE.route_permute(ids, 3)
    return x, perm, inv, offs


def test_public_op_stays_differentiable_and_opcheck_takes_its_packet():
    x, perm, inv, offs = _routing_args()
    y = MOE.permute_rows(x, perm, inv, offs, 2)
    assert y.grad_fn is not None and "permute_rows_default" in type(y.grad_fn).__name__, type(y.grad_fn)
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    torch.library.opcheck(MOE.permute_rows, (x.detach().requires_grad_(), perm, inv, offs, 2))


def test_twin_computes_what_the_op_computes():
    x, perm, inv, offs = _routing_args()
    with torch.no_grad():
        assert torch.equal(RT.permute_rows(x, perm, inv, offs, 2), MOE.permute_rows(x, perm, inv, offs, 2))
        ids = torch.tensor([[1, 0], [0, 1], [3, 0]])   # 3: dropped
        assert all(torch.equal(a, b) for a, b in zip(RT.route_permute(ids, 2), MOE.route_permute(ids, 2)))


def test_twins_pass_opcheck_schema_and_fake():
    """The aliasing and fake checks the custom op's wrapper would make, made here once: outputs
    alias no input, and the fake implementation matches the real one."""
    x, perm, inv, offs = _routing_args()
    x = x.detach()
    g = torch.Generator().manual_seed(2)
    h = torch.randn(12, 8, generator=g)
    w = torch.randn(3, 4, 5, generator=g)
    weights = torch.rand(6, 2, generator=g)
    xp = RT.permute_rows(x, perm, inv, offs, 2)
    y = torch.randn(12, 4, generator=g)
    for op, args in ((RT.permute_rows, (x, perm, inv, offs, 2)), (RT.route_permute, (torch.tensor([[0, 2], [1, 1]]), 3)),
                     (RT.swiglu, (h,)), (RT.swiglu_backward, (h, torch.randn(12, 4, generator=g))),
                     (RT.grouped_mm, (xp, w, offs, None)), (RT.unpermute_combine, (y, inv, weights, offs)),
                     (RT.unpermute_combine_backward, (torch.randn(6, 4, generator=g), y, inv, weights, offs)),
                     (RT.grouped_mm_wgrad_lowp, (xp, torch.randn(12, 5, generator=g), offs, 3)),
                     (RT.router_topk, (torch.randn(6, 3, generator=g), 2))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_twin_warns_when_differentiated():
    """Only for differentiated graphs: a backward through one is PyTorch's autograd fallback, which
    warns (not silent)."""
    x, perm, inv, offs = _routing_args()
    y = RT.permute_rows(x, perm, inv, offs, 2)
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        y.sum().backward()


def test_profiler_names_both():
    x, perm, inv, offs = _routing_args()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        MOE.permute_rows(x, perm, inv, offs, 2)
        RT.permute_rows(x, perm, inv, offs, 2)
    names = {e.name for e in prof.events()}
    assert set(profiler_names("permute_rows")) <= names, names


def test_the_pass_swaps_only_ops_with_a_twin():
    g = fx.Graph()
    x, ids = g.placeholder("x"), g.placeholder("ids")
    route = g.call_function(MOE.route_permute.default, (ids, 3))
    ep = g.call_function(MOE.ep_plan.default, (ids, 3, 1, 1, "g")) if hasattr(MOE, "ep_plan") else None
    mm = g.call_function(torch.ops.aten.mm.default, (x, x))
    g.output((route, mm, ep))
    assert lowering_runtime_ops.use_runtime_ops(g) == 1
    assert route.target is RT.route_permute.default and mm.target is torch.ops.aten.mm.default
    assert ep is None or ep.target is MOE.ep_plan.default
    assert canon(route) == "moe_compile::route_permute"
    assert lowering_runtime_ops.use_runtime_ops(g) == 0


@pytest.mark.parametrize("inductor", [True, False])
def test_compiled_graphs_call_twins_and_gradients_match(monkeypatch, no_compile_cache, inductor):
    """Forward and backward graphs of a rewritten layer end with only twins of the moe_compile
    compute ops (so the swap fired in both); outputs and every gradient match eager. Disabled: none
    swapped."""
    seen = []

    def spy(graph):
        n = real(graph)
        left = [node.target for node in graph.nodes if node.op == "call_function" and node.target in RUNTIME]
        seen.append((n, left))
        return n

    real = lowering_runtime_ops.use_runtime_ops
    monkeypatch.setattr(lowering_runtime_ops, "use_runtime_ops", spy)
    model = make_model()
    x = make_input((2, 12, 16))
    check_compiled(model, (x,), expect_rewritten=1, inductor=inductor)
    assert len(seen) >= 2 and all(n > 0 and not left for n, left in seen), seen   # forward and backward
    seen.clear()
    check_compiled(model, (x,), expect_rewritten=1, inductor=inductor, options={"moe.disable": ("runtime_ops",)})
    assert seen == []


def test_loop_form_with_stacked_weights_uses_twins_and_gradients_match(monkeypatch, no_compile_cache):
    """The ModuleList form (stacked weight inputs, gradient hand-over) under Inductor."""
    swapped = []
    real = lowering_runtime_ops.use_runtime_ops
    monkeypatch.setattr(lowering_runtime_ops, "use_runtime_ops", lambda graph: swapped.append(real(graph)) or swapped[-1])
    model = make_model(e=6, k=2)
    x = make_input((3, 7, 16), seed=3)
    check_compiled(model, (x,), expect_rewritten=1, inductor=True, fresh_inputs=2)
    assert len(swapped) >= 2 and min(swapped) > 0, swapped
