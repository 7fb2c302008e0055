"""Run a graph whose per-expert weights were stacked (``lowering/expert_stack.py``): each call passes
one tensor per stack instead of the E Parameters it is made of, and hands its gradient back to them.

Per call and stack (Dynamo's inputs still include every Parameter, which is what is checked):
- the Parameters sit where the plan's layout says, in one live storage: the stack is a view of that
  storage made into a fresh autograd leaf; when the backward has accumulated its gradient [E, R, K],
  a post-accumulate-grad hook gives each Parameter its slice (``p.grad = g[e, rows]`` if it had
  none, else ``p.grad += g[e, rows]``, out of place under ``create_graph``): the values per-Parameter
  accumulation would give, without one autograd node, wrapper step and input view per Parameter;
- Parameters no compile laid out (another block of the class that one graph serves: a per-layer
  ``layer.compile(backend="moe")``) are re-homed on the first call with them, as the compile re-homes
  its own (``_Feed._lay_out``: plain leaf Parameters with a storage of their own, ``moe.rehome_weights``
  on, no FSDP2); from then on their stack is a view too;
- otherwise (``.data`` replaced, e.g. by ``model.to()`` with a new dtype handled by a recompile, or
  by a user's assignment; or a Parameter with a tensor hook, which must run) the Parameters are
  stacked with ``torch.stack``, differentiably: each gets its gradient through autograd as usual, at
  the cost of a copy per step; a warning says so once per stack.

A Parameter written in place between the forward and the backward: the stack shares the first
Parameter's version counter only, so autograd's check of saved tensors would see writes to that one
alone (a frozen expert's weight, or a backward of the input's gradient alone, used the new values
silently). A pre-hook on the call's backward node (``_BeforeBackward``) compares every Parameter's
counter with the forward's and, where one moved, moves the stack's: autograd then raises exactly where
the backward unpacks the saved stack, as eager raises where it unpacks a saved weight (not when the
backward needs no weight, nor under a non-reentrant checkpoint, which recomputes what it saved). Under
compiled autograd (``moe_compile.compiled_backward`` around the forward) no pre-hook is registered: the
hand-over hook raises for stacks that get a gradient, and other stacks are not checked.

A backward restricted to named tensors (``torch.autograd.grad``, ``.backward(inputs=...)``) does not
accumulate into the stack leaf, so it cannot give those Parameters gradients (they are not autograd
inputs of the graph; an edge per Parameter would cost the per-Parameter engine work this saves,
~3.5 us each on a CPU): a pre-hook on the call's backward node sees such a backward pass and warns
once per compiled graph, naming ``moe.stack_expert_params=False``, with which they are exact (~5 us
per call while no such backward has run).

The layout check costs one address read per Parameter (cached per set of addresses, as
``kernels/layout.strided_stack`` does) plus two hook-attribute reads; the full layout check runs once
per set of addresses (e.g. once per block under ``compile_blocks``).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import operator
import sys
from typing import NamedTuple

import torch

from moe_compile.lowering.expert_stack import StackPlan, laid_out, stack_view

log = logging.getLogger(__name__)

_DATA_PTR = torch.Tensor.data_ptr
_GRAD = operator.attrgetter("grad")
_TENSOR_HOOKS = operator.attrgetter("_backward_hooks")
_ACC_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")
_VERSION = operator.attrgetter("_version")
_NONES = itertools.repeat(None)   # an endless None operand for map(operator.is_not, ...): a C-level scan
# ops run below autograd's view tracking: aliases of one storage without a view base
_NO_VIEW_TRACKING = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", contextlib.nullcontext)


def _compiled_autograd() -> bool:
    """Compiled autograd traces node hooks into its graph: the named-inputs check stays out of it
    (compiled autograd runs whole backwards)."""
    return bool(getattr(sys.modules.get("torch._dynamo.compiled_autograd"), "compiled_autograd_enabled", False))


class _HandOver:
    """Post-accumulate-grad hook of one call's stack leaf: its gradient, sliced, to the Parameters.
    ``versions``: the Parameters' version counters when the forward ran, checked here (``_check_versions``)
    unless the call's backward node checks them first (``_BeforeBackward``, which sets them to None).
    Hooks a Parameter got after the forward (the feed checks for hooks when it runs) run here as eager
    runs them: tensor hooks on its gradient, then the accumulation, then post-accumulate-grad hooks."""

    __slots__ = ("params", "rows", "versions")

    def __init__(self, params: tuple, rows: tuple[int, ...], versions: tuple[int, ...]):
        self.params, self.rows, self.versions = params, rows, versions

    def __call__(self, leaf: torch.Tensor) -> None:
        if torch.compiler.is_dynamo_compiling():
            # compiled autograd (moe_compile.compiled_backward) traces this hook, and Dynamo reads a
            # Parameter's hook dicts as empty there (a hook registered between the forward and the
            # backward was skipped: 0.67 relative error), nor would a cached graph re-read them:
            # hand over outside the trace (one graph break per stack leaf)
            return _hand_over_untraced(self, leaf)
        g, leaf.grad = leaf.grad, None
        if g is None:
            return
        params = self.params
        if self.versions is not None:
            _check_versions(params, self.versions, tuple(g.shape))
        parts = g.split(self.rows, dim=1) if len(self.rows) > 1 else (g,)
        out_of_place = torch.is_grad_enabled()        # create_graph=True: as AccumulateGrad does
        # one tensor per Parameter on g's storage (segment-major, as params); not autograd views unless
        # create_graph needs their history: a view's .data replaced by model.to(dtype) kept its fp32 base,
        # on which Dynamo's next trace of the layer failed, so it ran eagerly (review helper-72)
        with contextlib.nullcontext() if out_of_place else _NO_VIEW_TRACKING():
            views = [v for part in parts for v in part.unbind(0)]
        if any(map(_TENSOR_HOOKS, params)) or any(map(_ACC_HOOKS, params)):
            _hand_over_hooked(params, views, out_of_place)
            return
        grads = list(map(_GRAD, params))
        if not out_of_place and not any(map(operator.is_not, grads, _NONES)):   # the usual case
            for p, v in zip(params, views):
                p.grad = v
            return
        old, new = [], []
        for p, have, v in zip(params, grads, views):
            if have is not None and not out_of_place:   # summed in place, in one foreach call below
                old.append(have)
                new.append(v)
            else:
                _accumulate(p, have, v, out_of_place)
        if old:
            torch._foreach_add_(old, new)


def _moved(params: tuple, versions: tuple) -> bool:
    return tuple(map(_VERSION, params)) != versions


def _bump_version(t: torch.Tensor) -> None:
    """Move ``t``'s version counter on (its views' too): autograd's check of a saved ``t`` then fails."""
    try:
        torch._C._autograd._unsafe_set_version_counter((t,), (t._version + 1,))
    except (AttributeError, TypeError):  # pragma: no cover - a torch without the sequence form
        with torch.no_grad():
            t.mul_(1)


def _check_versions(params: tuple, versions: tuple, shape: tuple) -> None:
    """Raise as eager's backward does if a Parameter of a stack was written in place since the forward
    read it (the stack shares the first Parameter's version counter only, so autograd's own check of
    saved tensors sees writes to that one alone)."""
    if _moved(params, versions):
        changed = next(i for i, (p, v) in enumerate(zip(params, versions)) if p._version != v)
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: weight {changed} (counted over the segments of this stack, expert by expert) of the "
            f"stacked expert weights {shape} was written in place between the compiled forward and its "
            "backward (eager's backward raises the same for a weight it saved); write weights after the "
            "backward (e.g. optimizer.step() after loss.backward())")


@torch._dynamo.disable(recursive=True)
def _hand_over_untraced(hand_over: _HandOver, leaf: torch.Tensor) -> None:
    hand_over(leaf)


def _accumulate(p, have, v, out_of_place: bool) -> None:
    """``p.grad`` as AccumulateGrad leaves it, ``have`` its gradient so far: ``v`` where there was none (a
    clone under create_graph: not a view, which zero_grad could not detach), else the sum (out of place
    under create_graph)."""
    if have is None:
        p.grad = v.clone() if out_of_place else v
    elif out_of_place:
        p.grad = have + v
    else:
        have.add_(v)


def _hand_over_hooked(params, views, out_of_place: bool) -> None:
    """Each Parameter's slice as eager's AccumulateGrad gives it: tensor hooks (registration order, a
    hook's result replaces the gradient), accumulation, then post-accumulate-grad hooks."""
    for p, v in zip(params, views):
        hooks = tuple((p._backward_hooks or {}).values())
        for hook in hooks:
            r = hook(v)
            v = v if r is None else r
        if hooks and p.grad is None and not out_of_place:
            v = v.clone()   # a hook may keep what it was given: AccumulateGrad then clones it (review helper-73)
        _accumulate(p, p.grad, v, out_of_place)
        for hook in tuple((p._post_accumulate_grad_hooks or {}).values()):
            if hook(p) is not None:   # as eager's AccumulateGrad
                raise RuntimeError("Tensor post accumulate grad hooks should return None.")


class Fed(NamedTuple):
    """What one stack input got on one call."""

    stack: torch.Tensor          # the graph's input: a view of the Parameters' buffer, or a stacked copy
    params: tuple                # the Parameters stacked
    versions: tuple              # their version counters at the call
    hand_over: _HandOver | None  # the stack leaf's hook that hands its gradient to the Parameters
    counter: torch.Tensor        # the tensor whose version counter the stack shares: the first Parameter, or the copy


class _Feed:
    """The tensor one stack input gets on each call."""

    __slots__ = ("get", "rows", "shape", "experts", "numel", "layouts", "warned", "what", "may_move")

    def __init__(self, stack, what: str, may_move: bool = False):
        self.get = operator.itemgetter(*stack.flat_positions)
        self.rows, self.shape, self.experts = stack.rows, stack.shape, stack.shape[0]
        self.numel = math.prod(stack.shape)
        self.layouts: dict = {}   # addresses -> laid out (True), or how many calls found them not laid out
        self.warned = False
        self.what = what
        self.may_move = may_move   # the compile may re-home Parameters (moe.rehome_weights)

    def _in_place(self, params: tuple) -> bool:
        key = tuple(map(_DATA_PTR, params))
        ok = self.layouts.get(key)
        if ok is not True:
            if len(self.layouts) > 1024:
                self.layouts.clear()
            ok = laid_out(params, self.rows, self.experts) or self._lay_out(params) or (ok or 0) + 1
            self.layouts[tuple(map(_DATA_PTR, params)) if ok is True else key] = ok
        if ok is not True:
            # warned from the second call with the same addresses (Parameters _lay_out may not move):
            # compile_blocks' mirror may still lay them out after the model's first call (moe_compile/blocks.py)
            if ok >= 2:
                self._warn(self._why_apart(params), params[0])
            return False
        # the addresses are those of a checked layout; it still holds if the stack lies inside the
        # first Parameter's (live) storage: memory inside it belongs to views of it alone
        first, last = params[0], params[-1]
        storage = first.untyped_storage()
        if last.untyped_storage().data_ptr() != storage.data_ptr():
            return False
        return (first.storage_offset() + self.numel) * first.element_size() <= storage.nbytes()

    def _lay_out(self, params: tuple) -> bool:
        """Re-home Parameters this graph runs with that no compile laid out, once, as the compile lays out
        the ones it compiled with (``lowering/rehome.py``): another block of the class that one compiled graph
        serves (a per-layer ``layer.compile(backend="moe")``; compile_blocks mirrors the layout itself), or
        a ``.data``, a Parameter or an expert module that was replaced. Only plain leaf Parameters whose
        storage is theirs alone (never a tie, a bucket view, shared memory), or held by them alone (the old
        layout of the ones not replaced: ``rehome.held_only_by``), and never under FSDP2; True if they are
        laid out now."""
        from moe_compile.lowering.rehome import _rehome, _shared_storage, fsdp_in_use, held_only_by, plain_group

        e = self.experts
        segs = [params[s * e:(s + 1) * e] for s in range(len(self.rows))]
        first = params[0]
        if not self.may_move or not all(map(plain_group, segs)) or not all(
                p.is_leaf and p.dtype == first.dtype and p.device == first.device and p.shape[1:] == first.shape[1:]
                for p in params) or _shared_storage(params) and not held_only_by(params) or fsdp_in_use():
            return False
        with torch.inference_mode(False):   # a first call under inference_mode: a normal buffer, not an inference one
            _rehome([list(seg) for seg in segs])
        return laid_out(params, self.rows, self.experts)

    def _why_apart(self, params: tuple) -> str:
        from moe_compile.lowering.rehome import _shared_storage

        # some still share a buffer a compile laid out: another one's .data was replaced
        if len({p.untyped_storage().data_ptr() for p in params}) == len(params) and _shared_storage(params):
            return ("they are not in one buffer, and the backend does not move them there: a weight shares its "
                    "storage (an alias such as p.detach(), a view into a larger buffer, or shared memory)")
        return ("they no longer share the buffer they were stacked from (a weight's .data, a Parameter or an expert "
                "module was replaced), and another tensor holds the old buffer or a new weight, so the backend "
                "does not move them back into one")

    def _warn(self, why: str, first: torch.Tensor) -> None:
        """Once per reason for these Parameters, however many graphs (recompiles) feed them (review helper-72)."""
        if not self.warned:
            self.warned = True
            # the reasons warned about, kept on the Parameter itself: a table of weak references to Parameters
            # made torch.utils.swap_tensors refuse them (model.to under swap failed, review helper-73)
            seen = first.__dict__.setdefault("_moe_copy_warned", set())
            if why not in seen:
                seen.add(why)
                log.warning("moe_compile: %s: %s; stacking a copy of them on every step (correct, slower)",
                            self.what, why)

    def __call__(self, args) -> Fed:
        params = self.get(args)
        versions = tuple(map(_VERSION, params))
        hooked = any(map(_TENSOR_HOOKS, params)) or any(map(_ACC_HOOKS, params))
        if not hooked and self._in_place(params):
            leaf = stack_view(params[0], self.shape)
            hand_over = None
            if params[0].requires_grad:
                leaf.requires_grad_()
                hand_over = _HandOver(params, self.rows, versions)
                leaf.register_post_accumulate_grad_hook(hand_over)
            return Fed(leaf, params, versions, hand_over, params[0])   # a view: the first Parameter's counter
        if hooked:
            self._warn("some have gradient hooks, which must run", params[0])
        e = self.experts
        segs = [torch.stack(params[s * e:(s + 1) * e]) for s in range(len(self.rows))]
        stack = segs[0] if len(segs) == 1 else torch.cat(segs, dim=1)
        return Fed(stack, params, versions, None, stack)


def _backward_node(outputs):
    """The compiled call's backward node (AOTAutograd's ``CompiledFunctionBackward``), reached from
    the first output that has a grad_fn, through at most a few view nodes; None if there is none."""
    for out in outputs:
        node = getattr(out, "grad_fn", None)
        for _ in range(4):
            if node is None:
                break
            if node.name().startswith("CompiledFunction"):
                return node
            nexts = node.next_functions
            node = nexts[0][0] if nexts else None
    return None


def _restricted(acc) -> bool:
    """During a backward: True if the engine will not accumulate into this leaf, i.e. the backward
    delivers gradients only to the tensors it names (``.backward(inputs=...)``: False from the
    engine; ``torch.autograd.grad``: the engine refuses leaf nodes while it captures)."""
    try:
        return not torch._C._will_engine_execute_node(acc)
    except RuntimeError:
        return True


class _BeforeBackward:
    """Pre-hook of a call's backward node. (1) Where a stacked Parameter was written in place since the
    forward (``fed``: (the tensor whose version counter the stack shares, Parameters, versions) per stack:
    the first Parameter for a view of their buffer, else the stacked copy), moves that counter on, so that
    autograd raises where the backward unpacks the saved stack, as eager does for a saved weight (module
    docstring). (2) Warns once
    per compiled graph when a backward that delivers gradients only to named tensors runs through it
    (``accs``: the stack leaves' AccumulateGrad nodes). The stacked leaf is the only autograd input of
    those Parameters here, so such a backward cannot reach them: ``torch.autograd.grad`` returns None
    for them (or raises 'not used in the graph') and ``.backward(inputs=[...])`` leaves their ``.grad`` as
    it was. The engine does not say which tensors were named, so the warning comes whenever such a
    backward passes (also when it named none of these Parameters)."""

    __slots__ = ("owner", "fed", "accs")

    def __init__(self, owner, fed, accs):
        self.owner, self.fed, self.accs = owner, fed, accs

    def __call__(self, grad_outputs):
        for counter, params, versions in self.fed:
            if _moved(params, versions):
                _bump_version(counter)
        if self.accs and not self.owner.named_warned and any(map(_restricted, self.accs)):
            self.owner.named_warned = True
            log.warning(
                "moe_compile: a backward that delivers gradients only to the tensors it names "
                "(torch.autograd.grad, or .backward(inputs=...)) ran through a compiled graph that takes "
                "%s as stacked inputs (one autograd leaf per buffer): such a backward gives those expert "
                "Parameters no gradient (torch.autograd.grad returns None for them or raises 'not used in "
                "the graph'). If you need their gradients this way, compile with "
                "options={\"moe.stack_expert_params\": False}; .backward() without inputs= is exact either way",
                " and ".join(f.what for f in self.owner.feeds))
        return None


class StackedInputs:
    """The compiled graph called with Dynamo's inputs: kept ones passed on, stacks built per call."""

    def __init__(self, fn, plan: StackPlan, may_move: bool = False):
        self.fn, self.keep = fn, plan.keep
        self.feeds = [_Feed(s, f"{len(s.flat_positions)} expert weights {tuple(s.shape)}", may_move)
                      for s in plan.stacks]
        self.named_warned = False

    def __call__(self, *args):  # Dynamo calls compiled graphs unboxed (one argument per input)
        new = [args[i] for i in self.keep]
        fed = [feed(args) for feed in self.feeds]
        stacks = [f.stack for f in fed]
        out = self.fn(*new, *stacks)
        if torch.is_grad_enabled() and not _compiled_autograd():
            node = _backward_node(out)
            if node is not None:
                accs = ()
                if not self.named_warned:   # the stack leaves' AccumulateGrad nodes are among its next functions
                    leaves = {id(s) for s in stacks if s.is_leaf and s.requires_grad}
                    accs = [n for n, _ in node.next_functions if id(getattr(n, "variable", None)) in leaves]
                node.register_prehook(_BeforeBackward(self, [(f.counter, f.params, f.versions) for f in fed], accs))
                for f in fed:   # checked by the pre-hook, which runs before any hand-over
                    if f.hand_over is not None:
                        f.hand_over.versions = None
        return out

    def __getattr__(self, name):  # anything else Dynamo or Inductor read from the compiled function
        return getattr(self.__dict__["fn"], name)
