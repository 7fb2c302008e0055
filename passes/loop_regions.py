"""find_loop_regions: per-expert MoE loops in a Dynamo graph, as ``region.Candidate``s (finds; never mutates).

Before (any spelling that ``loop_dataflow`` understands; here the Mixtral reference)::

    ids = topk(logits, K)[1]; acc = zeros_like(x)
    for e in range(E):                                   # unrolled by Dynamo
        tok, slot = where(ids == e)
        acc[tok] += w[tok, slot, None] * expert_e(x[tok])  # or index_add_ / scatter_add_ / masks
    readers(acc)

Found: a ``Region`` whose combine is ``AccumulateInPlace`` (the accumulator, its writes and the
readers of the finished sum) and whose ``ExpertMLP`` is expert 0's function with every per-expert
operand in a slot (expert 0..E-1's node each). Facts that block the rewrite become findings: the
experts are not 0..E-1 of one router, read different inputs or weights, differ in structure, have
intermediates used outside the loop, or the output is read half-accumulated.
After lowering (``lowering/region.py``)::

    perm, inv, offs = route_permute(ids, E); h = permute_rows(x, perm, inv, offs, K)
    h = <expert function once, each linear -> grouped_mm over all experts' weights>
    out = unpermute_combine(h, inv, w, offs)     (+ base, .to(acc dtype));  readers(out)
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from .id_range import id_bound
from .loop_dataflow import Analysis, analyze
from .loop_roles import Contrib, Ids, RowFn, Rows, Storage, TokMask, expert_key
from .normalize import canon, common_module, dtype_of, module_path, val, where_in_user_code
from .region import AccumulateInPlace, Candidate, ExpertMLP, Finding, Region, Router, Step
from .writes import storage_base


def _function_nodes(a: Analysis, c: Contrib, order: dict) -> list[fx.Node]:
    """The nodes of one expert's function, in graph order."""
    seen, stack = set(), [c.out]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(a.r(n), RowFn):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return sorted(seen, key=order.__getitem__)


def _slot_of(args, kwargs, name: str, position: int):
    """The slot index of operand ``name`` (positional ``position`` or keyword) if it is a slot."""
    if len(args) > position and isinstance(args[position], tuple) and args[position][:1] == ("slot",):
        return args[position][1]
    for k, v in kwargs:
        if k == name and isinstance(v, tuple) and v[:1] == ("slot",):
            return v[1]
    return None


def _build_steps(a: Analysis, nodes: list[fx.Node]):
    """Steps and per-slot operand nodes of one expert's function."""
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
            _, b, layout = a.linears[n]
            lin = (args[1][1], None if b is None else _slot_of(args, kwargs, "bias", 2), layout)
            if n in bias_of:
                lin = (lin[0], enc(a.bias_adds[bias_of[n]][1])[1], layout)
        steps.append(Step(n.op, n.target, args, kwargs, lin, dtype_of(n) if lin is not None else None,
                          n in bias_of, dtype_of(bias_of[n]) if n in bias_of else None))
    return steps, operands


def _numbers(x, out: list):
    """``x`` with its Python numbers (not bools) taken out into ``out`` in order; the encoded operands
    ("step", i), ("slot", s), ("in",) are kept whole (their indices are positions, not numbers)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        out.append(x)
        return "#"
    if isinstance(x, tuple) and x and x[0] in ("step", "slot", "in"):
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_numbers(i, out) for i in x)
    return x


def _differs(ours: list, theirs: list, expert: int) -> Finding:
    """Why expert ``expert``'s steps are not expert 0's: only Python numbers (a per-expert scale or clamp
    bound: every step the same but for them), or their structure (review helper-90: the first said
    "differs in structure" too)."""
    first = None
    if len(ours) != len(theirs):
        return Finding.of("experts_differ", None, expert=expert)
    for a, b in zip(ours, theirs):
        na, nb = [], []
        a_masked = dataclasses.replace(a, args=_numbers(a.args, na), kwargs=_numbers(a.kwargs, na))
        b_masked = dataclasses.replace(b, args=_numbers(b.args, nb), kwargs=_numbers(b.kwargs, nb))
        if a_masked != b_masked:
            return Finding.of("experts_differ", None, expert=expert)
        if first is None and na != nb:
            x, y = next((x, y) for x, y in zip(na, nb) if x != y)
            first = dict(op=getattr(a.target, "__name__", str(a.target)), ours=x, theirs=y)
    if first is None:
        return Finding.of("experts_differ", None, expert=expert)
    return Finding.of("expert_numbers_differ", None, expert=expert, **first)


def _form(a: Analysis, rows: list[Rows], nodes, write: fx.Node | None) -> str:
    """``loop/<grouping>+<combine>`` of expert rows ``rows`` written back by ``write``."""
    ops = {canon(n) for n in nodes}
    one_hot = "one_hot" in ops or any(r.enum[0] == "where" for r in rows)
    grouping = "one_hot" if one_hot else ("mask" if any(isinstance(a.r(n), TokMask) for n in nodes) or
                                          write is not None and any(isinstance(a.r(i), TokMask)
                                                                    for i in write.all_input_nodes) else "where")
    return f"loop/{grouping}+{canon(write) if write is not None else '?'}"


def _router_numbers(ids: Ids) -> tuple[int, int]:
    """(E, top-k) of a refused loop's router ids, for its row in explain(); E 0 where unknown."""
    return id_bound(ids.root) or 0, ids.k


def _findings(a: Analysis, s: Storage, functions: dict, order: dict) -> list[Finding]:
    """Facts that block the rewrite of accumulator ``s``, most specific first."""
    if s.findings:
        return s.findings[:1]
    experts = sorted(s.contribs)
    if experts != list(range(len(experts))):
        return [Finding.of("expert_set", None, experts=experts, last=experts[-1])]
    cs = list(s.contribs.values())
    if len({c.rows.ids.root for c in cs}) != 1:
        return [Finding.of("two_routers")]
    if len({c.rows.x for c in cs}) != 1:
        return [Finding.of("two_inputs")]
    if len({c.w for c in cs}) != 1:
        return [Finding.of("mixed_weights")]
    for c in cs:
        if a.row_findings.get(expert_key(c)):
            return a.row_findings[expert_key(c)][:1]
    early = [n for n, v in s.row_reads if v < s.version]
    if early:   # the next layer's rows read a partial sum (loop_combine.expert_rows)
        return [Finding.of("rows_of_next_layer", early[0], reader=early[0].name, at=where_in_user_code(early[0]))]
    partial = [n for n, v in s.readers if 0 < v < s.version]
    if partial:
        return [Finding.of("partial_read", partial[0], reader=partial[0].name, at=where_in_user_code(partial[0]))]
    early = _early_views(a, s, order)
    if early:   # reads through it see the finished sum, which the rewrite puts in a new tensor
        return [Finding.of("view_before_sum", early[0], reader=early[0].name, at=where_in_user_code(early[0]))]
    inside = set()
    for nodes in functions.values():
        inside.update(nodes)
    for e, nodes in functions.items():
        out = s.contribs[e].out
        for n in nodes:
            outside = [u for u in n.users if u not in inside] if n is not out else []
            if outside:
                return [Finding.of("escaping_intermediate", n, node=n.name, user=outside[0].name)]
        if not nodes:
            return [Finding.of("no_expert_function", None, expert=e)]
    return []


def _early_views(a: Analysis, s: Storage, order: dict) -> list[fx.Node]:
    """Views of accumulator ``s`` taken before its first write (``res = out.view(T, H)``), other than the
    pattern's own reads: they alias the storage the expert loop writes into."""
    if not s.mutations:
        return []
    first = min(order[m] for m in s.mutations)
    return [u for u in s.alloc.users if order[u] < first and u not in a.pattern and a.r(u) is None
            and storage_base(u, {}) is s.alloc]


# row findings (ops on an expert's rows) that, found on a write into an accumulator, make it an MoE layer's
EXPERT_ROW_CODES = ("unsupported_row_op", "expert_checkpointed")


def find_loop_regions(gm: fx.GraphModule, analysis: Analysis | None = None) -> list[Candidate]:
    a = analysis or analyze(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found: list[Candidate] = []
    for s in a.storages:
        if not s.contribs and s in a.refused_writes:  # every expert write was refused: say why
            n, c = a.refused_writes[s]
            found.append(Candidate(module_path(n) or module_path(s.alloc), _form(a, [c.rows], (), n),
                                   where_in_user_code(n), None, tuple(s.findings[:1]),
                                   *_router_numbers(c.rows.ids)))
            continue
        if not s.contribs and s.findings and s.findings[0].code in EXPERT_ROW_CODES:
            f = s.findings[0]  # expert outputs made by an op the rewrite does not take: say which
            rows = [r.rows if isinstance(r, RowFn) else r for i in f.node.all_input_nodes
                    if isinstance(r := a.r(i), (Rows, RowFn))][:1]
            found.append(Candidate(module_path(f.node) or module_path(s.alloc), _form(a, rows, (), None) if rows
                                   else "loop/?", where_in_user_code(f.node), None, (f,),
                                   *(_router_numbers(rows[0].ids) if rows else ())))
            continue
        if not s.contribs or s.forked:
            continue  # nothing added, or an intermediate of a functional index_add chain
        functions = {e: _function_nodes(a, c, order) for e, c in s.contribs.items()}
        if not any(functions.values()):
            continue  # rows scattered back with no expert function applied: a top-k gather, not an MoE
        nodes = set(s.mutations)
        for fn_nodes in functions.values():
            nodes.update(fn_nodes)
        module = module_path(s.mutations[0]) or common_module(nodes)
        where = where_in_user_code(s.mutations[0])
        form = _form(a, [c.rows for c in s.contribs.values()], nodes, s.mutations[0] if s.mutations else None)
        c0 = s.contribs[min(s.contribs)]
        k = c0.rows.ids.k
        findings = _findings(a, s, functions, order)
        if not findings:
            built = [_build_steps(a, functions[e]) for e in sorted(s.contribs)]
            differs = next((e for e, (steps, _) in enumerate(built) if steps != built[0][0]), None)
            if differs is not None:
                findings = [_differs(built[0][0], built[differs][0], differs)]
        if findings:
            found.append(Candidate(module, form, where, None, tuple(findings), len(s.contribs), k))
            continue
        slots = tuple(zip(*(operands for _, operands in built)))  # slot i -> expert 0..E-1's operand
        combine = AccumulateInPlace(
            acc=s.alloc, base=s.base, dtype=val(s.alloc).dtype, aliases=tuple(s.aliases),
            mutations=tuple(s.mutations), readers=tuple(n for n, v in s.readers + s.row_reads if v == s.version),
            overwrite=s.overwrite and s.base is not None)
        router = Router(ids=c0.rows.ids.root, weights=c0.w, top_k=k, num_experts=len(s.contribs))
        region = Region(module, form, where, c0.rows.x, router, ExpertMLP(tuple(built[0][0]), slots), combine,
                        tuple(sorted(nodes, key=order.__getitem__)))
        found.append(Candidate(module, form, where, region, (), len(s.contribs), k))
    return found
