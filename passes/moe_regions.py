"""find_moe_regions: per-expert MoE loops in a Dynamo graph, as frozen matches (never mutates).

Before (any spelling that ``dataflow.py`` understands; here the Mixtral reference)::

    ids = topk(logits, K)[1]; acc = zeros_like(x)
    for e in range(E):                                   # unrolled by Dynamo
        tok, slot = where(ids == e)
        acc[tok] += w[tok, slot, None] * expert_e(x[tok])  # or index_add_ / scatter_add_ / masks
    readers(acc)

After lowering (``lowering/moe_region.py``) the region is one static-shape, sync-free chain::

    perm, inv, offs = route_permute(ids, E)
    h = permute_rows(x, perm, inv, offs, K)
    h = <expert template replayed once, each linear -> grouped_mm(h, W[E], offs)>
    out = unpermute_combine(h, inv, w, offs)     (+ base, .to(acc dtype))
    readers(out)

``check_region`` accepts or refuses a match, always with a reason. Refused: experts that are not
all E of one router exactly once; experts whose MLPs differ in structure; expert intermediates
used outside the loop; reads of a half-accumulated output; per-expert operands other than linear
weights and biases; ``out[idx] = ...`` (overwrite) with top-k > 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .dataflow import Analysis, analyze
from .normalize import canon, common_module, module_path, val, where_in_user_code
from .roles import Contrib, RowFn, Rows, Storage, TokMask


@dataclass(frozen=True)
class Step:
    """One op of the expert template. ``args``/``kwargs`` hold ("in",) for the rows, ("step", i)
    for an earlier step, ("slot", s) for a per-expert operand, or a constant."""
    op: str                   # fx op: call_function | call_method
    target: object
    args: tuple
    kwargs: tuple             # sorted (key, value) pairs
    linear: tuple | None      # (weight slot, bias slot or None, layout "nk" | "kn") for linears


@dataclass(frozen=True)
class Template:
    steps: tuple[Step, ...]
    slots: tuple[tuple[fx.Node, ...], ...]   # slot s -> the operand node of each expert 0..E-1


@dataclass(frozen=True)
class MoERegion:
    module: str
    form: str
    where: str
    x: fx.Node
    ids: fx.Node
    top_k: int
    num_experts: int
    weights: fx.Node | None
    template: Template
    acc: fx.Node
    acc_dtype: torch.dtype
    base: fx.Node | None
    aliases: tuple[fx.Node, ...]
    mutations: tuple[fx.Node, ...]
    readers: tuple[fx.Node, ...]
    expert_nodes: tuple[fx.Node, ...]
    # forms with no in-place accumulator (passes/grouped_regions.py): every user of ``output`` (and
    # of ``aliases`` after it) reads the lowered result; ``erase`` lists the region's side-effecting
    # nodes (setitem/add_/index_add_ on region-internal tensors) that the lowering removes.
    # Template weight/bias slots may then hold one 3-D [E, in, out] weight / [E, out] bias node.
    output: fx.Node | None = None
    erase: tuple[fx.Node, ...] = ()


@dataclass(frozen=True)
class Refused:
    module: str
    form: str
    where: str
    reason: str


@dataclass(frozen=True)
class Accept:
    region: MoERegion


@dataclass(frozen=True)
class Reject:
    reason: str


def _template_nodes(a: Analysis, c: Contrib, order: dict) -> list[fx.Node]:
    seen, stack = set(), [c.out]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(a.r(n), RowFn):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return sorted(seen, key=order.__getitem__)


def _build_steps(a: Analysis, c: Contrib, nodes: list[fx.Node]):
    """Steps and per-slot operand nodes of one expert's template."""
    # x @ W[e] + b[e]: the add is folded into the linear (its bias), when the linear has no bias
    fused = {add: lin for add, (lin, _) in a.bias_adds.items() if add in nodes and lin in nodes}
    kept = [n for n in nodes if n not in fused]
    index = {n: i for i, n in enumerate(kept)}
    index.update({add: index[lin] for add, lin in fused.items()})
    bias_of = {lin: add for add, lin in fused.items()}
    operands: list[fx.Node] = []

    def enc(x):
        if isinstance(x, fx.Node):
            if x in index:
                return ("step", index[x])
            if isinstance(a.r(x), Rows):
                return ("in",)
            operands.append(x)
            return ("slot", len(operands) - 1)
        if isinstance(x, (list, tuple)):
            return type(x)(enc(i) for i in x)
        return x

    steps = []
    for n in kept:
        args = enc(n.args)
        kwargs = tuple(sorted((k, enc(v)) for k, v in n.kwargs.items()))
        lin = None
        if n in a.linears:
            w, b, layout = a.linears[n]
            lin = (args[1][1], None if b is None else enc_lookup(args, kwargs), layout)
            if n in bias_of:
                lin = (lin[0], enc(a.bias_adds[bias_of[n]][1])[1], layout)
        steps.append(Step(n.op, n.target, args, kwargs, lin))
    return steps, operands


def enc_lookup(args, kwargs):
    if len(args) > 2 and isinstance(args[2], tuple) and args[2][:1] == ("slot",):
        return args[2][1]
    for k, v in kwargs:
        if k == "bias" and isinstance(v, tuple) and v[:1] == ("slot",):
            return v[1]
    return None


def _form(a: Analysis, s: Storage, nodes) -> str:
    ops = {canon(n) for n in nodes}
    one_hot = "one_hot" in ops or any(c.rows.enum[0] == "where" for c in s.contribs.values())
    grouping = "one_hot" if one_hot else ("mask" if any(isinstance(a.r(n), TokMask) for n in nodes) or
                                          any(isinstance(a.r(i), TokMask) for m in s.mutations[:1]
                                              for i in m.all_input_nodes) else "where")
    combine = canon(s.mutations[0]) if s.mutations else "?"
    return f"loop/{grouping}+{combine}"


def _region_nodes(a: Analysis, s: Storage, templates) -> list[fx.Node]:
    nodes = set(s.mutations)
    for tn in templates.values():
        nodes.update(tn)
    return list(nodes)


def find_moe_regions(gm: fx.GraphModule, analysis: Analysis | None = None) -> list[MoERegion | Refused]:
    a = analysis or analyze(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found: list[MoERegion | Refused] = []
    for s in a.storages:
        if not s.contribs and s in a.refused_writes:  # every expert write was refused: say why
            n = a.refused_writes[s]
            found.append(Refused(module_path(n) or module_path(s.alloc), f"loop/?+{canon(n)}",
                                 where_in_user_code(n), s.problem))
            continue
        if not s.contribs or s.forked:
            continue  # nothing added, or an intermediate of a functional index_add chain
        templates = {e: _template_nodes(a, c, order) for e, c in s.contribs.items()}
        if not any(templates.values()):
            continue  # rows scattered back with no expert function applied: a top-k gather, not an MoE
        nodes = _region_nodes(a, s, templates)
        module = module_path(s.mutations[0]) or common_module(nodes)
        where = where_in_user_code(s.mutations[0])
        form = _form(a, s, nodes)
        why = _refusal(a, s, templates, order)
        if why:
            found.append(Refused(module, form, where, why))
            continue
        experts = sorted(s.contribs)
        c0 = s.contribs[0]
        built = [_build_steps(a, s.contribs[e], templates[e]) for e in experts]
        steps0 = built[0][0]
        differs = next((e for e, (steps, _) in zip(experts, built) if steps != steps0), None)
        if differs is not None:
            found.append(Refused(module, form, where, f"expert {differs}'s MLP differs in structure from expert 0's"))
            continue
        slots = tuple(zip(*(operands for _, operands in built)))  # slot i -> expert 0..E-1's operand
        readers = tuple(n for n, v in s.readers if v == s.version)
        found.append(MoERegion(
            module=module, form=form, where=where, x=c0.rows.x, ids=c0.rows.ids.root, top_k=c0.rows.ids.k,
            num_experts=len(experts), weights=c0.w, template=Template(tuple(steps0), slots),
            acc=s.alloc, acc_dtype=val(s.alloc).dtype, base=s.base, aliases=tuple(s.aliases),
            mutations=tuple(s.mutations), readers=readers, expert_nodes=tuple(nodes)))
    return found


def _refusal(a: Analysis, s: Storage, templates, order) -> str:
    if s.problem:
        return s.problem
    experts = sorted(s.contribs)
    if experts != list(range(len(experts))):
        return f"the loop covers experts {experts}, not 0..{len(experts) - 1} of one router"
    cs = list(s.contribs.values())
    if len({c.rows.ids.root for c in cs}) != 1:
        return "the experts are selected by different routers"
    if len({c.rows.x for c in cs}) != 1:
        return "the experts read different input tensors"
    if len({c.w for c in cs}) != 1:
        return "the experts use different routing-weight tensors (or only some are weighted)"
    for e in experts:
        if a.problems.get(e):
            return f"expert {e}: " + "; ".join(sorted(set(a.problems[e]))[:2])
    partial = [n for n, v in s.readers if 0 < v < s.version]
    if partial:
        return f"the output is read half-accumulated by `{partial[0].name}` at {where_in_user_code(partial[0])}"
    inside = set()
    for tn in templates.values():
        inside.update(tn)
    for e, tn in templates.items():
        out = s.contribs[e].out
        for n in tn:
            if n is out:
                continue
            outside = [u for u in n.users if u not in inside]
            if outside:
                return f"expert {e}'s intermediate `{n.name}` is also used outside the MoE loop (by `{outside[0].name}`)"
        if not tn:
            return f"expert {e} applies no function to its rows"
    if s.base is not None and s.base.op == "placeholder":
        return "the accumulator is a graph input (mutating it in place is a side effect the rewrite would drop)"
    return ""


def check_region(region: MoERegion | Refused) -> Accept | Reject:
    """Legality of a match, from its captured facts only."""
    if isinstance(region, Refused):
        return Reject(region.reason)
    t = region.template
    for st in t.steps:
        if st.linear is None:
            for x in _flat(st.args) + _flat([v for _, v in st.kwargs]):
                if isinstance(x, tuple) and x[:1] == ("slot",) and len(set(t.slots[x[1]])) != 1:
                    return Reject(f"expert-specific operand `{t.slots[x[1]][0].name}` in a non-linear op "
                                  f"`{st.target if isinstance(st.target, str) else getattr(st.target, '__name__', st.target)}`"
                                  " (only linear weights and biases may differ per expert)")
        else:
            w_slot, b_slot, _ = st.linear
            for slot in (w_slot, b_slot):
                if slot is not None:
                    shapes = {tuple(val(n).shape) for n in t.slots[slot]}
                    if len(shapes) != 1:
                        return Reject(f"expert weights have different shapes {sorted(shapes)}")
    if not t.steps or not any(st.linear for st in t.steps):
        return Reject("the expert function has no linear layer")
    xv = val(region.x)
    if not isinstance(xv, torch.Tensor) or xv.dim() != 2:
        return Reject(f"expert input must be [tokens, hidden], got {getattr(xv, 'shape', None)}")
    return Accept(region)


def _flat(x):
    out = []
    if isinstance(x, (list, tuple)) and not (len(x) == 2 and x[:1] == ("slot",)) and x[:1] not in (("step",), ("in",)):
        for i in x:
            out.extend(_flat(i))
    else:
        out.append(x)
    return out
