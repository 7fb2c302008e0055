"""ModuleList expert weights enter the compiled graph as one stacked input per buffer, one autograd leaf
whose gradient is handed to the Parameters (lowering/expert_stack.py, moe_compile/expert_inputs.py).

Every test checks gradients of every Parameter against eager, and that the stacking fired (the graph
ran grouped_mm, no weight list, and the Parameters' gradients are slices of one buffer: they came
from the hand-over, not from per-Parameter autograd)."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from helpers import FP32_REL, assert_close_rel, check_compiled, make_input, make_model, spy_static_inputs
from moe_compile import records

# four SGD steps of fp32 training: each step's gradients differ by ~1e-7 (FP32_REL's summation
# order) and the weights carry it into the next step; 10x margin (as tests/test_rehome.py)
STEPS_REL = 10 * FP32_REL
LR = 0.05


def _experts(model):
    return [p for e in model.experts.experts for p in (e.w1.weight, e.w3.weight, e.w2.weight)]


def _compile(model, **options):
    torch._dynamo.reset()
    return torch.compile(model, backend="moe", options={"moe.inductor": False, **options})


def _stacked(graphs) -> bool:
    recs = [r for g in graphs for r in g if r.status == records.REWRITTEN]
    assert recs, "nothing was rewritten"
    return all("grouped_mm" in r.ops and not any(o.startswith("grouped_mm_list") for o in r.ops)
               and any("stacked input" in n for n in r.notes) for r in recs)


def _handed_over(model) -> bool:
    """The expert gradients are slices of shared buffers (the hand-over's), not separate tensors."""
    grads = [p.grad for p in _experts(model)]
    return all(g is not None for g in grads) and len({g.untyped_storage().data_ptr() for g in grads}) <= 2


def _train(model, ref, compiled, steps, set_to_none=True, micro=1, loss_of=lambda y: y.square().mean(),
           shape=(3, 5, 16)):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(steps):
        for m in range(micro):
            x = make_input(shape, seed=10 * step + m).to(next(model.parameters()).device)
            out, out_ref = compiled(x), ref(x.detach().clone().requires_grad_())
            assert_close_rel(out.detach(), out_ref.detach(), STEPS_REL, f"step {step}.{m}: output")
            loss_of(out).backward()
            loss_of(out_ref).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close_rel(p.grad, q.grad, STEPS_REL, f"step {step}: grad of {name}")
        if step == steps - 1:
            return
        opt.step()
        opt_ref.step()
        opt.zero_grad(set_to_none=set_to_none)
        opt_ref.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("inductor", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_stacked_experts_train_like_eager(inductor, set_to_none):
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    ref = copy.deepcopy(model)
    ids = [id(p) for p in model.parameters()]
    with records.recording() as graphs:
        compiled = _compile(model, **{"moe.inductor": inductor})
        _train(model, ref, compiled, steps=3, set_to_none=set_to_none)
    assert _stacked(graphs), graphs
    assert _handed_over(model) or not set_to_none   # zeroed in place: accumulated into step 1's buffers
    assert [id(p) for p in model.parameters()] == ids, "Parameter objects must be kept"


def test_gradient_accumulation_over_micro_batches():
    """Two forwards and backwards per step without zeroing in between: the second hand-over adds."""
    model = make_model(spelling="where_setitem", expert="swiglu", e=4, k=2)
    ref = copy.deepcopy(model)
    with records.recording() as graphs:
        _train(model, ref, _compile(model), steps=2, micro=2)
    assert _stacked(graphs)


def test_backward_twice_through_one_graph():
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    ref = copy.deepcopy(model)
    compiled = _compile(model)
    x = make_input((2, 6, 16))
    out, out_ref = compiled(x), ref(x.detach().clone())
    for _ in range(2):
        out.square().sum().backward(retain_graph=True)
        out_ref.square().sum().backward(retain_graph=True)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_rel(p.grad, q.grad, FP32_REL, f"grad of {name}")
    assert _handed_over(model)


@pytest.mark.parametrize("case", ["top1", "zero_tokens", "empty_experts", "one_hot_expert", "bf16"])
def test_edge_cases_match_eager(case):
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    model = make_model(dtype=dtype, spelling="index_add", expert="swiglu", e=5, k=1 if case == "top1" else 2,
                       routing={"one_hot_expert": "hot", "empty_experts": "empty"}.get(case, "random"))
    shape = (0, 16) if case == "zero_tokens" else (3, 7, 16)
    with records.recording() as graphs:
        check_compiled(model, (make_input(shape, dtype=dtype),), expect_rewritten=1, fresh_inputs=1)
    assert _stacked(graphs)


def test_frozen_experts_get_no_gradient():
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    for p in _experts(model):
        p.requires_grad_(False)
    with records.recording() as graphs:
        check_compiled(model, (make_input((3, 5, 16)),), expect_rewritten=1)
    assert _stacked(graphs)


def test_tensor_hooks_run(caplog):
    """A gradient hook on an expert Parameter must run: those steps stack the weights differentiably."""
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    ref = copy.deepcopy(model)
    seen = []
    for m in (model, ref):
        m.experts.experts[1].w2.weight.register_hook(lambda g, m=m: seen.append(m) or g * 3)
    compiled = _compile(model)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        _train(model, ref, compiled, steps=2)
    assert seen.count(model) == 2 and seen.count(ref) == 2, "the hook did not run on every step"
    assert sum("gradient hooks" in r.getMessage() for r in caplog.records) == 1, caplog.text
    with caplog.at_level(logging.WARNING, logger="moe_compile"):   # new token counts: graphs recompiled
        _train(model, ref, compiled, steps=2, shape=(3, 7, 16))
        _train(model, ref, compiled, steps=1, shape=(2, 3, 16))
    assert sum("gradient hooks" in r.getMessage() for r in caplog.records) == 1, caplog.text   # once (helper-72)


@pytest.mark.parametrize("how", ["data", "parameter", "module", "data_kept"])
def test_replaced_weights_are_read_where_they_are(how, caplog):
    """A weight replaced after compiling (``p.data = ...``, a new Parameter, a new expert module) leaves the
    stacked buffer: the next steps read it where it is, never the stale buffer. Where nothing else holds the
    old buffer or the new weight, the experts are laid out as one buffer again (they were stacked as a copy
    on every step, with a warning that their .data was replaced: review helper-85); where the user keeps
    the new tensor (``data_kept``: a tie the backend must not cut), a copy per step, warned once."""
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    compiled = _compile(model)
    compiled(make_input((3, 5, 16))).sum().backward()   # the shapes _train uses: no recompile
    expert = model.experts.experts[2]
    kept = torch.randn_like(expert.w1.weight)
    with torch.no_grad():
        if how.startswith("data"):
            expert.w1.weight.data = kept if how == "data_kept" else kept.clone()
        elif how == "parameter":
            expert.w1.weight = torch.nn.Parameter(kept.clone())
        else:
            torch.manual_seed(3)
            model.experts.experts[2] = type(expert)(*expert.w1.weight.shape[::-1])
    del expert
    ref = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        _train(model, ref, compiled, steps=3)
    warned = sum("stacking a copy" in r.getMessage() for r in caplog.records)
    experts = model.experts.experts
    one_buffer = all(len({e.get_parameter(n).untyped_storage().data_ptr() for e in experts}) == 1
                     for n in ("w1.weight", "w2.weight"))
    assert (warned, one_buffer) == ((1, False) if how == "data_kept" else (0, True)), caplog.text
    if how == "data_kept":
        assert experts[2].w1.weight.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()


def test_can_be_disabled():
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    with records.recording() as graphs:
        check_compiled(model, (make_input((3, 5, 16)),), expect_rewritten=1,
                       options={"moe.stack_expert_params": False})
    recs = [r for g in graphs for r in g if r.status == records.REWRITTEN]
    assert any(o.startswith("grouped_mm_list") for o in recs[0].ops) and not _stacked(graphs)


def test_stacks_are_static_inputs(monkeypatch):
    """Each stack is a static input of the compiled graph, as the Parameters it replaces were: CUDA
    graphs would otherwise copy every expert weight into their input buffer on every replay."""
    seen = spy_static_inputs(monkeypatch)
    if seen is None:
        pytest.skip("this torch has no _try_get_metadata_from_dynamo")
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    with records.recording() as graphs:
        _compile(model)(make_input((3, 5, 16))).sum().backward()
    assert _stacked(graphs)
    others = len(list(model.parameters())) - len(_experts(model))
    assert len(seen["static"]) == others + 2, seen   # the router's Parameters + w1|w3 and w2 stacks


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_inference_after_training(mode):
    """The stack is a fresh leaf per call: under no_grad / inference_mode it is a plain view, no hook."""
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    with records.recording() as graphs:
        compiled = _compile(model)
        compiled(make_input((3, 5, 16))).sum().backward()
        x = make_input((3, 5, 16), requires_grad=False, seed=3)
        with mode():
            got, ref = compiled(x), model(x)
    assert _stacked(graphs)
    assert_close_rel(got, ref, FP32_REL, f"output under {mode.__name__}")


def _named_warnings(caplog) -> int:
    return sum("delivers gradients only to the tensors it names" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("how", ["autograd_grad", "backward_inputs"])
def test_backward_to_named_tensors_warns_once(caplog, how):
    """``torch.autograd.grad`` / ``.backward(inputs=...)`` cannot reach expert Parameters that were stacked
    (the stack leaf is their only autograd input): the first such backward through the graph warns, with
    the fix. What it does deliver (here the input's gradient, or the router's) matches eager."""
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    ref = copy.deepcopy(model)
    compiled = _compile(model)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        compiled(make_input((3, 5, 16))).sum().backward()   # plain backward: exact, no warning
        assert _named_warnings(caplog) == 0, caplog.text
        model.zero_grad(set_to_none=True)
        for step in range(2):
            x = make_input((3, 5, 16), seed=step)
            x_ref = x.detach().clone().requires_grad_()
            if how == "autograd_grad":
                (got,) = torch.autograd.grad(compiled(x).square().sum(), [x])
                (want,) = torch.autograd.grad(ref(x_ref).square().sum(), [x_ref])
            else:
                gate, gate_ref = model.router.proj.weight, ref.router.proj.weight
                compiled(x).square().sum().backward(inputs=[gate])
                ref(x_ref).square().sum().backward(inputs=[gate_ref])
                got, want = gate.grad, gate_ref.grad
            assert_close_rel(got, want, STEPS_REL, f"step {step}: gradient of the named tensor")
    assert _named_warnings(caplog) == 1, caplog.text
    if how == "backward_inputs":
        assert all(p.grad is None for p in _experts(model)), "backward(inputs=) must not touch other Parameters"


def test_backward_to_expert_parameters_needs_unstacked_inputs(caplog):
    """The fix the warning names: with ``moe.stack_expert_params=False`` ``torch.autograd.grad`` w.r.t. every
    Parameter, experts included, matches eager; with stacking it warns (and torch reports the experts as
    not used in the graph)."""
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    ref = copy.deepcopy(model)
    x = make_input((3, 5, 16))
    want = torch.autograd.grad(ref(x.detach().clone()).square().sum(), list(ref.parameters()))
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            torch.autograd.grad(_compile(model)(x).square().sum(), list(model.parameters()))
    assert _named_warnings(caplog) == 1, caplog.text
    with records.recording() as graphs:
        got = torch.autograd.grad(_compile(model, **{"moe.stack_expert_params": False})(x).square().sum(),
                                  list(model.parameters()))
    assert not _stacked(graphs)
    for (name, _), g, w in zip(model.named_parameters(), got, want):
        assert_close_rel(g, w, FP32_REL, f"grad of {name}")


# ----------------------------------------------------- found by an adversarial review of this feed
@pytest.mark.parametrize("kind", ["tensor", "post_accumulate"])
def test_hooks_registered_between_forward_and_backward_run(kind):
    """A hook an expert Parameter gets after the compiled forward (the feed checked for hooks then) runs
    when the gradient is handed over, as eager runs it (was skipped: that weight's gradient 1/3 of
    eager's, relative error 0.67)."""
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    ref = copy.deepcopy(model)
    compiled = _compile(model)
    x = make_input((3, 5, 16))
    out, out_ref = compiled(x), ref(x.detach().clone().requires_grad_())
    seen = []
    for m in (model, ref):
        w = m.experts.experts[1].w2.weight
        if kind == "tensor":
            w.register_hook(lambda g, m=m: seen.append(m) or g * 3)
        else:
            w.register_post_accumulate_grad_hook(lambda p, m=m: (seen.append(m), p.grad.mul_(3)) and None)
    out.square().mean().backward()
    out_ref.square().mean().backward()
    assert seen.count(model) == 1 and seen.count(ref) == 1
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_rel(p.grad, q.grad, FP32_REL, f"grad of {name}")


@pytest.mark.parametrize("case", ["trained", "frozen_experts", "input_grad_only"])
def test_weight_written_between_forward_and_backward_raises_as_eager(case):
    """Eager's backward raises when a weight it saved was written in place after the forward; the stack
    leaf shares only the first expert's version counter, so a write to another expert went unseen and
    the backward used the new values (relative error 0.5). The hand-over checked every counter, but only
    for a stack that gets a gradient: with frozen experts (a LoRA-style base) or a backward of the input's
    gradient alone (torch.autograd.grad(loss, x)) the backward used the new weights silently (relative
    error ~4, review of global modes). The call's backward node checks them now."""
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    if case == "frozen_experts":
        for p in model.experts.experts.parameters():
            p.requires_grad_(False)
    ref = copy.deepcopy(model)
    compiled = _compile(model)
    x = make_input((3, 5, 16))
    with records.recording() as graphs:
        compiled(x.detach().clone().requires_grad_()).sum().backward()   # compiled (and re-homed) first
    assert _stacked(graphs)
    before = dict(records.counters)
    for m, run in ((ref, ref), (model, compiled)):
        xi = x.detach().clone().requires_grad_()
        out = run(xi)
        with torch.no_grad():
            m.experts.experts[2].w2.weight.mul_(0.5)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            if case == "input_grad_only":
                torch.autograd.grad(out.square().mean(), xi)
            else:
                out.square().mean().backward()
    assert dict(records.counters) == before   # no recompile: the checked call ran the stacked graph


@pytest.mark.parametrize("case", ["checkpointed_frozen", "input_without_grad"])
def test_weight_written_where_eager_saved_none_trains_as_eager(case):
    """The other side of the check above: where eager saved no copy of the written weight (a non-reentrant
    checkpoint recomputes what it saved; an input without grad makes eager save no weight of the first
    linear), eager's backward runs, and so must ours, with eager's gradients: the stack's version counter is
    moved only for autograd to check where the backward unpacks it (a review found the first form raising
    where eager does not)."""
    import torch.utils.checkpoint as cp

    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    if case == "checkpointed_frozen":
        for p in model.experts.experts.parameters():
            p.requires_grad_(False)
    ref = copy.deepcopy(model)
    compiled = _compile(model)
    x = make_input((3, 5, 16), requires_grad=False)
    x_grad = case != "input_without_grad"
    call = (lambda f, a: cp.checkpoint(f, a, use_reentrant=False)) if case == "checkpointed_frozen" else (lambda f, a: f(a))
    with records.recording() as graphs:
        call(compiled, x.detach().clone().requires_grad_(x_grad)).sum().backward()
    assert _stacked(graphs)
    for m, run in ((ref, ref), (model, compiled)):
        m.zero_grad(set_to_none=True)
        out = call(run, x.detach().clone().requires_grad_(x_grad))
        with torch.no_grad():
            expert = m.experts.experts[2]
            (expert.w2.weight if case == "checkpointed_frozen" else expert.w1.weight).mul_(0.5)
        out.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert_close_rel(p.grad, q.grad, FP32_REL, f"grad of {name}")
        else:
            assert p.grad is None, name


def test_create_graph_gradients_are_not_views():
    """backward(create_graph=True) gives each expert Parameter a gradient of its own (as AccumulateGrad's
    clone), so a later zero_grad(set_to_none=False) can detach it in place (it raised 'Can't detach
    views in-place')."""
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    ref = copy.deepcopy(model)
    compiled = _compile(model)
    x = make_input((3, 5, 16))
    for m, run in ((ref, ref), (model, compiled)):
        run(x.detach().clone()).square().mean().backward(create_graph=True)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_rel(p.grad.detach(), q.grad.detach(), FP32_REL, f"grad of {name}")
    model.zero_grad(set_to_none=False)
    assert all(not p.grad.abs().sum() for p in model.parameters())


def test_not_stacked_with_a_process_group_or_shared_memory(tmp_path):
    """Not stacked where per-Parameter gradient machinery Python cannot see may run: an initialized process
    group (DDP's reducer, DeepSpeed and Megatron hook AccumulateGrad nodes, also at world size 1); not
    re-homed where the storage is shared memory (model.share_memory(): Hogwild workers update it)."""
    import torch.distributed as dist

    from moe_compile.lowering.expert_stack import why_not_stacked

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    assert why_not_stacked() is None
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "f"), 1), rank=0, world_size=1)
    try:
        assert "process group" in why_not_stacked()
        model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
        ref = copy.deepcopy(model)
        calls = []
        for m in (model, ref):   # Megatron's pattern: a hook on each Parameter's AccumulateGrad node
            w = m.experts.experts[1].w1.weight
            m._acc = w.expand_as(w).grad_fn.next_functions[0][0]
            m._acc.register_hook(lambda *a, m=m: calls.append(m))
        with records.recording() as graphs:
            _train(model, ref, _compile(model), steps=2)
        assert not _stacked(graphs) and calls.count(model) == calls.count(ref) == 2
    finally:
        dist.destroy_process_group()
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2).share_memory()
    ref = copy.deepcopy(model)
    _train(model, ref, _compile(model), steps=2)
    assert all(p.untyped_storage().is_shared() for p in _experts(model)), "moved out of shared memory"


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(make_model(spelling="index_add", expert="swiglu", e=4, k=2, seed=s)
                                          for s in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_layers_compiled_one_by_one_share_the_graph_and_the_layout(caplog):
    """``for l in layers: l.compile(backend="moe")`` (torch's regional compile): one compiled graph serves
    both layers, but only the first layer's experts were laid out by its compile, so from the second
    call the second layer's were stacked as a copy on every step, with a warning that their .data was
    replaced (found by a review). They are now laid out by the graph's first call with them: no warning,
    same Parameters, gradients as eager's over the steps."""
    model = _TwoLayers()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    for layer in model.layers:
        layer.compile(backend="moe", options={"moe.inductor": False})
    ids = [id(p) for p in model.parameters()]
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        _train(model, ref, model, steps=3)
    assert "stacking a copy" not in caplog.text, caplog.text
    assert [id(p) for p in model.parameters()] == ids
    for layer in model.layers:
        w1 = [e.w1.weight for e in layer.experts.experts]
        assert len({w.untyped_storage().data_ptr() for w in w1}) == 1, "a layer's experts are not laid out as one"


def test_layers_compiled_one_by_one_first_called_under_inference_mode_still_train():
    """The second layer's experts are laid out on the graph's first call with them: under inference_mode
    that made them inference tensors, and training then raised (found by a review)."""
    model = _TwoLayers()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    for layer in model.layers:
        layer.compile(backend="moe", options={"moe.inductor": False})
    with torch.inference_mode():
        model(make_input((3, 5, 16), requires_grad=False))
    assert not any(p.is_inference() for p in model.parameters())
    _train(model, ref, model, steps=2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_model_to_with_handed_over_gradients_held(dtype):
    """After a backward the expert gradients share the stacked gradient's storage. ``model.to(dtype)`` with
    them held (zero_grad(set_to_none=False), gradient accumulation) replaces each one's ``.data``; as autograd
    views of the stacked gradient they kept its fp32 base, Dynamo's next trace of the layer failed on them
    and the layer ran eagerly from then on, warned as an unrelated graph break (review helper-72). They are
    no views now: the layer is rewritten again and matches eager."""
    from helpers import BF16_REL

    torch._dynamo.reset()
    model = make_model(spelling="index_add", e=4, k=2)
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    compiled(make_input((9, 16))).sum().backward()
    assert _handed_over(model)
    model.to(dtype)
    x = make_input((9, 16)).to(dtype)
    with records.recording() as graphs:
        got = compiled(x)
    found = [(r.status, r.code) for g in graphs for r in g]   # float64 experts stay float64: refused as such
    assert found == [("refused", "float64") if dtype == torch.float64 else ("rewritten", "")], found
    assert_close_rel(got.double(), model(x).double(), BF16_REL if dtype == torch.bfloat16 else FP32_REL, "output")


def test_model_to_with_swapped_parameters_after_a_copy_warning(caplog, swap_params_on_conversion):
    """The stacking-a-copy warning's once-only table held weak references to Parameters, and
    torch.utils.swap_tensors refuses a tensor something weakly references: model.to(dtype) and
    load_state_dict under swap_module_params_on_conversion failed after the warning (review helper-73)."""
    torch._dynamo.reset()
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    model.experts.experts[1].w2.weight.register_hook(lambda g: g * 3)
    compiled = _compile(model)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        compiled(make_input((3, 5, 16))).sum().backward()
    assert "gradient hooks" in caplog.text
    state = copy.deepcopy(model.state_dict())
    model.to(torch.float64)
    model.load_state_dict(state)
    assert all(p.dtype == torch.float64 for p in model.parameters())


def test_gradient_kept_by_a_hook_is_not_accumulated_into():
    """A tensor hook that keeps the gradient it is given (registered after the first forward, so the hand-over
    runs it): eager's AccumulateGrad clones a gradient someone else holds; the hand-over made it p.grad and
    the next micro-batch's accumulation changed the kept tensor (1.39 relative; review helper-73)."""
    model = make_model(spelling="index_add", expert="swiglu", e=4, k=2)
    ref = copy.deepcopy(model)
    compiled = _compile(model)
    kept = {"model": [], "ref": []}
    for step in range(2):
        x = make_input((3, 5, 16))
        out, want = compiled(x), ref(x)
        if step == 0:
            for m, key in ((model, "model"), (ref, "ref")):
                m.experts.experts[0].w1.weight.register_hook(lambda g, key=key: kept[key].append(g))
        out.square().mean().backward()
        want.square().mean().backward()
    assert_close_rel(kept["model"][0], kept["ref"][0], FP32_REL, "the gradient the hook kept")
    assert_close_rel(model.experts.experts[0].w1.weight.grad, ref.experts.experts[0].w1.weight.grad, FP32_REL, "grad")
