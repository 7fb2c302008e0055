"""What ``passes/unclaimed.py`` and ``passes/unrouted.py`` share: the record of MoE-looking code no
candidate region covers (``Unclaimed``) and the graph helpers the scans use, expert-choice routing's
shape among them (finds, never mutates)."""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .normalize import arg, canon, source_name, val
from .token_paths import MATMULS, PARAM_VIEWS, param_of
from .writes import written

_GATHERS = {"getitem", "index_select", "embedding", "take", "gather", "F.embedding"}


@dataclasses.dataclass(frozen=True)
class Unclaimed:
    module: str
    where: str
    num_experts: int
    top_k: int
    detail: dict            # fills reasons.REASONS[code]
    code: str = "moe_unmatched"   # or another code of reasons.py's never-silent section (router_draws, ...)


def _dims(n: fx.Node) -> tuple:
    v = val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _near(n: fx.Node, is_matmul, hops: int = 4) -> bool:
    """``n`` is the output of a matmul for which ``is_matmul(node)`` holds, through at most ``hops``
    single-input ops."""
    return near_node(n, is_matmul, hops) is not None


def near_node(n: fx.Node, is_matmul, hops: int = 4) -> fx.Node | None:
    """The matmul of ``_near``, else None."""
    while isinstance(n, fx.Node) and hops >= 0:
        if is_matmul(n):
            return n
        ins = n.all_input_nodes
        if (canon(n) or "") in MATMULS or not ins:
            return None
        n = ins[0]
        hops -= 1
    return None


def sliced_inputs(gm: fx.GraphModule, params: set) -> set[fx.Node]:
    """Stacked expert weights passed to the compiled function as arguments (``fn(x, gate_w, w1, w2)``:
    plain tensors, which ``graph_params`` does not count): graph inputs of 3+ dims, not Parameters or
    buffers, of which a matmul-class op takes two or more constant slices along dim 0 (``x @ w1[e]`` in
    a Python loop over the experts). Only that form: an input read whole or gathered by ids may be
    anything (a KV cache or a kNN bank gathered by top-k ids, an activation), as a buffer may."""
    inputs = {n for n in gm.graph.nodes if n.op == "placeholder" and n not in params
              and "_buffers" not in source_name(n) and len(_dims(n)) >= 3}
    slices: dict = {}
    for n in gm.graph.nodes:
        i = _dim0_constant(n)
        p = param_of(n.args[0], inputs) if i is not None and isinstance(n.args[0], fx.Node) else None
        if p is not None and _into_matmul(n):
            slices.setdefault(p, set()).add(i)
    return {p for p, found in slices.items() if len(found) >= 2}


def _dim0_constant(n: fx.Node) -> int | None:
    """The integer ``i`` of ``t[i]``, ``t[i, ...]`` or ``t.select(0, i)``, else None."""
    op = canon(n)
    if op == "getitem" and len(n.args) > 1:
        i = n.args[1][0] if isinstance(n.args[1], tuple) and n.args[1] else n.args[1]
    elif op == "select" and arg(n, 1, "dim", None) == 0:
        i = arg(n, 2, "index", None)
    else:
        return None
    return i if isinstance(i, int) and not isinstance(i, bool) else None


def _into_matmul(n: fx.Node, hops: int = 4) -> bool:
    """``n`` is an operand of a matmul-class op, through at most ``hops`` views and casts."""
    todo = [(n, 0)]
    while todo:
        m, h = todo.pop()
        for u in m.users:
            if (canon(u) or "") in MATMULS:
                return True
            if (canon(u) or "") in PARAM_VIEWS and h < hops:
                todo.append((u, h + 1))
    return False


def _same_block(a: str, b: str) -> bool:
    """One dotted module path is the other or contains it."""
    if a == b:
        return True
    short, long_ = sorted((a, b), key=len)
    return short == "" or long_.startswith(short + ".")


def _claimed_by(module: str, claimed: str, evidence: str) -> bool:
    """A candidate found at ``module`` (its router and evidence; ``evidence``: the evidence's own
    module) is the layer of a region found at ``claimed``: the same block. At the compiled root ("")
    only where the evidence is in the region's block (a layer whose router sits on the root and its
    experts in a child): the root contains every module, so a region anywhere would hide a layer
    whose expert compute is on the root itself."""
    return _same_block(module, claimed) and (module != "" or _same_block(evidence, claimed)
                                             and (evidence != "" or claimed == ""))


def _expert_choice(router: fx.Node, params: set = frozenset()) -> tuple[int, str] | None:
    """(E, words) for a top-k over the token dim of a 2-D score matrix (each expert picks its tokens:
    expert-choice routing): the first dim of [T, E] scores, or the last dim of their transpose
    (``s.t().topk(c, -1)``: the top-k reads [E, T], the router's linear wrote [T, E]), else None."""
    if canon(router) != "topk" or not isinstance(x := router.args[0], fx.Node) or len(_dims(x)) != 2:
        return None
    dim, k = arg(router, 2, "dim", -1), arg(router, 1, "k", 1)
    if not isinstance(dim, int):
        return None
    if dim % 2 == 0:
        return _dims(x)[1], f"an expert-choice router (each expert takes its top-{k} tokens)"
    if canon(x) in ("t", "transpose", "permute") and _transposed_scores(x.args[0], _dims(x)[0], params):
        return _dims(x)[0], f"an expert-choice router (each expert takes its top-{k} tokens)"
    return None


def _transposed_scores(n, e: int, params: set, hops: int = 4) -> bool:
    """``n`` is (through at most ``hops`` single-input ops: softmax, sigmoid, casts) the output of a
    matmul on a 2-D Parameter that writes [T, E]: the scores a transpose turned into [E, T]."""
    while isinstance(n, fx.Node) and hops >= 0:
        if (canon(n) or "") in MATMULS:
            return _dims(n)[-1:] == (e,) and any(len(_dims(p)) == 2 and e in _dims(p)
                                                 for a in n.all_input_nodes if (p := param_of(a, params)) is not None)
        ins = n.all_input_nodes
        if len(ins) != 1:
            return False
        n, hops = ins[0], hops - 1
    return False


def _routed_matmul(n: fx.Node, inner: set) -> bool:
    """A matmul past the output that the routing itself feeds: its group ends (``grouped_mm(.., offs)``)
    or its rows gathered by a routed index (``h[tok]``). A dense head after the layer whose input also
    carries an auxiliary loss term built from the ids is not one."""
    if (canon(n) or "") not in MATMULS:
        return False
    return any(a in inner or (canon(a) or "") in _GATHERS and any(b in inner for b in a.all_input_nodes[1:])
               for a in n.all_input_nodes)


def _past_output(inner: set, after: set, claimed: set, hops: int = 3) -> set[fx.Node]:
    """Nodes of ``after`` (what reads a region's combined output) outside every region (``claimed``) that
    read the routing ``inner`` itself, and their users up to ``hops`` further: a second expert set run on
    the first one's output with the same sort (``h = combine(a(x[tok]), offs)``; ``b(h[tok], offs)``)
    reads both (a region's own combine, e.g. a bmm with the top-k weights after the unsort, is no such
    node; past the output only matmuls the routing feeds count as evidence, ``_routed_matmul``).
    Bounded, so the search still stays in the layer."""
    out = {u for n in inner for u in n.users if u in after and u not in claimed}
    edge = set(out)
    for _ in range(hops):
        edge = {u for n in edge for u in n.users if u.op != "output" and u not in claimed} - out
        out |= edge
    return out


def disabled_note(disabled) -> str:
    """The ``{disabled}`` of a record on MoE-like code found while finders were off (``moe.disable``)."""
    if not disabled:
        return ""
    return f" (the finders {', '.join(disabled)} are disabled by moe.disable: remove them from it first)"


def chained(members: dict) -> bool:
    """One member's input is computed from another expert's member: a stack of layers run one after the
    other (a layer drop mask ``keep[:, i]`` picking the rows of layer i), not experts side by side."""
    owner = {m: i for m, i in members.items() if i is not None}
    order = {n: j for j, n in enumerate(next(iter(owner)).graph.nodes)} if owner else {}
    for m, i in owner.items():
        seen, stack = set(), [a for a in m.all_input_nodes]
        while stack:
            n = stack.pop()
            if n in seen or n.op == "placeholder":
                continue
            seen.add(n)
            if owner.get(n, i) != i:
                return True
            stack.extend(n.all_input_nodes)
            # what an in-place write put into n before m ran (x[keep] = layer(x[keep]): the next layer reads
            # x); not a later one (``h += out`` after every expert: review helper-77)
            stack.extend(a for u in n.users if written(u) is n and order.get(u, 0) < order.get(m, 0)
                         for a in u.all_input_nodes)
    return False
