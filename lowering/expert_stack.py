"""stack_expert_params: one graph input per buffer of ModuleList expert weights, not one per Parameter.

A 128-expert SwiGLU layer written as a ModuleList of nn.Linear experts enters the compiled graph as
384 Parameters: AOTAutograd's wrapper, the custom ops' list arguments, Inductor's input views and
the autograd engine (one AccumulateGrad node each) pay for every one of them on every step, ~10 us
each on a CPU host (docs/benchmarks.md 2.6). This pass gives the graph one input per linear instead
(or per pair of sibling linears), the buffer the weights are re-homed into (``lowering/rehome.py``),
and ``moe_compile/expert_inputs.py`` feeds it at run time as one autograd leaf whose gradient is
handed to the Parameters (same objects, same ``.grad`` values as with per-Parameter accumulation).

Before (after ``lower``)::

    w1_0 .. w1_{E-1}, w3_0 .. w3_{E-1}: placeholders (nn.Linear weights [N, K], Parameters)
    y = grouped_mm_list_cat(h, [w1_0, ...], [w3_0, ...], offs, True)
    z = grouped_mm_list(a, [w2_0, ...], offs, [], True)

After::

    s0: placeholder [E, N1 + N3, K]  (w1_e = s0[e, :N1], w3_e = s0[e, N1:], one buffer)
    s1: placeholder [E, H, I]        (w2_e = s1[e])
    y = grouped_mm(h, s0.transpose(1, 2), offs)
    z = grouped_mm(a, s1.transpose(1, 2), offs)

The weights' placeholders are removed; ``StackPlan`` says which of Dynamo's inputs the compiled
graph still takes and, per stack, which inputs (Parameters) it is made of. Kernels and formulas are
those of the 3-D-weight form (transformers' experts), so values and gradients are too.

Applies only when nothing but the autograd engine could observe the per-Parameter gradients:
not under FSDP2 (it owns the storage: ``rehome.fsdp_in_use``) and not in a multi-process job
(data-parallel wrappers such as DDP or DeepSpeed hook each Parameter's gradient accumulation, which
would no longer run); then the graph reads the weights one by one as before, and the report says
why. Per call, the wrapper checks that the Parameters are still where the stack is (else it stacks
a copy, with a warning) and that none has a gradient hook (else it stacks them differentiably, so
the hooks run). Gradients reach the Parameters through ``.backward()`` only: a backward restricted
to named tensors (``torch.autograd.grad``, ``.backward(inputs=...)``) cannot reach them through the
stack leaf, and the wrapper warns once when one runs through the graph (``expert_inputs.py``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from moe_compile.passes.normalize import arg, canon

from .graph_edit import GraphBuilder, eliminate_dead_code
from .rehome import _params, _placeholder_of, _rehome, _shared_storage, cast_dtype, fsdp_in_use, uncast

OPS = torch.ops.moe_compile


@dataclasses.dataclass(frozen=True)
class Stack:
    """One stacked input [E, sum(rows), *tail]: expert e of segment s is rows [row0_s, row0_s + rows_s)
    of slice e. ``positions[s][e]``: that Parameter's position among Dynamo's inputs."""
    positions: tuple[tuple[int, ...], ...]
    rows: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def flat_positions(self) -> tuple[int, ...]:
        """Segment-major: every expert of segment 0, then of segment 1."""
        return tuple(i for seg in self.positions for i in seg)


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """The compiled graph's inputs: Dynamo's inputs at ``keep``, then one tensor per stack."""
    keep: tuple[int, ...]
    stacks: tuple[Stack, ...]

    def inputs(self, example_inputs: list, stack_tensors: list) -> list:
        return [example_inputs[i] for i in self.keep] + list(stack_tensors)


@dataclasses.dataclass(frozen=True)
class _Candidate:
    node: fx.Node
    weights: tuple[tuple[fx.Node, ...], ...]   # per segment: the E weight operands as the op gets them
    placeholders: tuple[tuple[fx.Node, ...], ...]
    params: tuple[tuple[torch.Tensor, ...], ...]
    nk: bool                                   # operands are [N, K] weights used as W.T
    offsets: fx.Node
    dtype: object = None                       # each operand is cast to this dtype (torch.autocast)


def why_not_stacked() -> str | None:
    """A reason to leave per-expert weights as separate graph inputs, or None."""
    if fsdp_in_use():
        return "FSDP2 owns the storage of the parameters it gathers"
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        # also at world size 1: DDP's reducer, DeepSpeed and Megatron hook each Parameter's AccumulateGrad
        # node (C++ hooks Python cannot see), which a stacked input's gradient hand-over never runs
        return ("a distributed job (a process group is initialized): data-parallel wrappers (DDP, DeepSpeed, "
                "Megatron) hook each Parameter's gradient accumulation")
    return None


def _candidate(node: fx.Node, index: dict, example_inputs) -> _Candidate | None:
    op = getattr(node.target, "_opname", "") if node.op == "call_function" else ""
    if op == "grouped_mm_list":
        if node.args[3]:
            return None  # biases: stays a list (the bias gradients have no stacked form yet)
        segments = (tuple(node.args[1]),)
    elif op == "grouped_mm_list_cat":
        segments = (tuple(node.args[1]), tuple(node.args[2]))
    else:
        return None
    dtypes = {cast_dtype(w) for s in segments for w in s}
    if len(dtypes) != 1:
        return None  # some weights cast and others not
    bases = [uncast(w) for s in segments for w in s]
    if arg(node, 4, "transposed", False):
        nk = all(w.op == "placeholder" for w in bases)
        if not nk and (op == "grouped_mm_list_cat" or not all(canon(w) == "t" for w in bases)):
            return None   # some W_e and some W_e.t(): no one layout of the stack serves them all
    else:
        nk = all(canon(w) == "t" for w in bases)
        if not nk and (op == "grouped_mm_list_cat" or not all(w.op == "placeholder" for w in bases)):
            return None
    phs = tuple(tuple(_placeholder_of(w) for w in s) for s in segments)
    params = tuple(_params(list(s), index, example_inputs) for s in segments)
    if any(p is None for p in params):
        return None
    first = params[0][0]
    if any(p.shape[1:] != first.shape[1:] or p.dtype != first.dtype or p.requires_grad != first.requires_grad
           for s in params for p in s):
        return None
    offsets = node.args[3] if op == "grouped_mm_list_cat" else node.args[2]
    return _Candidate(node, segments, phs, tuple(tuple(s) for s in params), nk, offsets, dtypes.pop())


def _chain(w: fx.Node, ph: fx.Node) -> list[fx.Node]:
    """The nodes from the op's operand ``w`` down to its placeholder ``ph``: [w, (.t()), ph]."""
    out = [w]
    while out[-1] is not ph:
        out.append(out[-1].args[0])
    return out


def _only_used_by(c: _Candidate) -> bool:
    """Every weight placeholder feeds this op alone (directly, or through a ``.t()`` and / or a cast
    used only here)."""
    for seg_w, seg_ph in zip(c.weights, c.placeholders):
        for w, ph in zip(seg_w, seg_ph):
            chain = _chain(w, ph)
            if set(w.users) != {c.node} or any(set(lower.users) != {upper} for upper, lower in zip(chain, chain[1:])):
                return False
    return True


def _rows(params: tuple[tuple[torch.Tensor, ...], ...]) -> tuple[int, ...]:
    """Rows of each segment (the per-expert weights' first dimension)."""
    return tuple(s[0].shape[0] for s in params)


def _laid_out_segments(params: tuple[tuple[torch.Tensor, ...], ...]) -> bool:
    """``laid_out`` for Parameters grouped by segment."""
    return laid_out(tuple(p for s in params for p in s), _rows(params), len(params[0]))


def laid_out(params: tuple, rows: tuple[int, ...], experts: int) -> bool:
    """The Parameters (segment-major: every expert of segment 0, then of segment 1) sit as
    ``_rehome`` puts them: one storage holding [E, sum(rows), *tail], expert e of segment s at
    rows [row0_s, row0_s + rows_s) of slice e."""
    first = params[0]
    row = first[0].numel() if first.dim() > 1 else 1
    slice_elems = sum(rows) * row
    base, storage = first.storage_offset(), first.untyped_storage()
    row0 = 0
    for s, n in enumerate(rows):
        for e, p in enumerate(params[s * experts:(s + 1) * experts]):
            if p.untyped_storage().data_ptr() != storage.data_ptr() \
                    or p.storage_offset() != base + e * slice_elems + row0 * row:
                return False
        row0 += n
    return (base + experts * slice_elems) * first.element_size() <= storage.nbytes()


def stack_view(first: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The contiguous [E, R, *tail] view of the buffer that starts at ``first`` (expert 0, segment 0)."""
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return first.detach().as_strided(shape, tuple(reversed(strides)), first.storage_offset())


def stack_expert_params(gm: fx.GraphModule, example_inputs, may_move: bool = True
                        ) -> tuple[StackPlan | None, list, list, list[str]]:
    """Rewrite every eligible per-expert weight list of gm into one stacked placeholder (in place).
    ``may_move``: the Parameters may be re-homed into one buffer (else only those already laid out
    as one are stacked). Returns (the plan or None, the compiled graph's example inputs, the groups
    of Parameters to re-home once the graph is compiled (``rehome_groups``), report notes).

    Nothing is moved here: AOTAutograd fakifies the Parameters it still takes (and, if this graph
    fails to compile, the original graph's) with the storage offsets Dynamo saw."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    found = [c for n in list(gm.graph.nodes) if (c := _candidate(n, index, example_inputs)) is not None]
    if not found:
        return None, list(example_inputs), [], []
    reason = why_not_stacked()
    if reason is not None:
        n = sum(len(s) for c in found for s in c.params)
        return None, list(example_inputs), [], [f"{n} per-expert weights stay separate graph inputs: {reason}"]
    seen: set = set()
    chosen = []
    for c in found:
        phs = [p for s in c.placeholders for p in s]
        if not _only_used_by(c) or seen & set(phs) or len(set(phs)) != len(phs):
            continue
        if not _laid_out_segments(c.params) and (not may_move or _shared_storage([p for s in c.params for p in s])):
            continue   # not ours to move: rehome_weights off, or a storage others hold too (rehome._shared_storage)
        seen.update(phs)
        chosen.append(c)
    if not chosen:
        return None, list(example_inputs), [], []
    stacks, fakes, groups = [], [], []
    last_ph = placeholders[-1]
    for j, c in enumerate(chosen):
        first, rows = c.params[0][0], _rows(c.params)
        shape = (len(c.params[0]), sum(rows), *first.shape[1:])
        mode = GraphBuilder.fake_mode_of(c.node, "stack_expert_params")
        with mode:
            fake = torch.empty(shape, dtype=first.dtype, device=first.device).requires_grad_(first.requires_grad)
        with gm.graph.inserting_after(last_ph):
            s = gm.graph.placeholder(f"moe_expert_stack_{j}")
        last_ph = s
        s.meta["example_value"] = fake
        s.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}  # a parameter: static for CUDA graphs
        s._dynamo_source = None
        b = GraphBuilder(gm.graph, c.node.prev, mode, c.node)
        w = b.method("to", s, c.dtype) if c.dtype is not None else s   # under autocast: the stack, cast once
        w = b.method("transpose", w, 1, 2) if c.nk else w
        new = b.fn(OPS.grouped_mm.default, c.node.args[0], w, c.offsets, None)
        c.node.replace_all_uses_with(new)
        gm.graph.erase_node(c.node)
        for seg_w, seg_ph in zip(c.weights, c.placeholders):
            for w_node, ph in zip(seg_w, seg_ph):
                for n in _chain(w_node, ph):
                    n.meta.pop("grapharg", None)   # its weak reference to the Parameter (backend._drop_graph_args)
                    gm.graph.erase_node(n)
        stacks.append(Stack(tuple(tuple(index[p] for p in seg) for seg in c.placeholders), rows, shape))
        # the compile's example input is the fake value: AOTAutograd would give a real tensor it has
        # not seen from Dynamo sizes of its own (symbols with no source, which break Dynamo's guards)
        fakes.append(fake)
        groups.append(c.params)
    eliminate_dead_code(gm.graph)
    gm.recompile()
    removed = {i for st in stacks for i in st.flat_positions}
    plan = StackPlan(tuple(i for i in range(len(placeholders)) if i not in removed), tuple(stacks))
    notes = [f"{len(removed)} expert weights enter the compiled graph as {len(stacks)} stacked input(s), one "
             "autograd leaf each (gradients handed to the same Parameters): no per-Parameter autograd or "
             "wrapper cost (Dynamo still checks each Parameter); backward(inputs=...) and torch.autograd.grad "
             "with respect to expert weights need moe.stack_expert_params=False"]
    return plan, plan.inputs(list(example_inputs), fakes), groups, notes


def rehome_groups(groups: list) -> list[str]:
    """After compiling: put each stacked group's Parameters (by segment) into one buffer
    (``rehome._rehome``) unless they already are; the stacked inputs are then views of that buffer."""
    return [_rehome([list(s) for s in g]) for g in groups if not _laid_out_segments(g)]
