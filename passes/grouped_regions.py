"""find_grouped_regions: MoE forms that process all routed (token, slot) pairs at once (finds; never mutates).

Legend: T tokens, K top-k, N = T*K routed pairs, E experts, H width, I expert width.

Three families, each a chain of "rows" (one row per routed pair, or per (expert, token) for dense)
flowing through an expert function whose linears use one 3-D weight for all experts::

  sorted (HF ``grouped_mm``, torchtitan)          batched (HF ``batched_mm``)
    flat = ids.reshape(-1); s, perm = sort(flat)    h = x.repeat_interleave(K, 0)
    h = x[perm // K]      (or index_select)         h = bmm(W[flat], h.unsqueeze(-1)).squeeze(-1)
    offs = cumsum(histc(s.float(), E, 0, E-1))        (+ .add_(b[flat]))
      | bincount(.., minlength=E) | one_hot(..).sum(0)  ... activation ...
    h = grouped_mm(h.to(W.dtype), W[E,I,H], offs)   h = h * w.reshape(-1).unsqueeze(-1)
      (torch._grouped_mm | F.grouped_mm |           out = h.view(T, K, H).sum(1)
       transformers::grouped_mm_fallback, + .add_(b[s]))
    ... activation (chunk, [..., ::2], clamp, sigmoid ...) ...
    h = h * w.reshape(-1)[perm].unsqueeze(-1)
    inv = empty_like(perm); inv[perm] = arange(N)   (or argsort(perm))
    out = h[inv].view(T, K, H).sum(1)               (weights may also multiply the [T, K, H] view)
      | zeros(T, H).index_add_(0, perm // K, h) | .scatter_add_(0, (perm // K)[:, None].expand, h)

  dense (every token through every expert)
    h = bmm(x.unsqueeze(0).expand(E, T, H), W.transpose(1, 2)) ... activation ... bmm(.., W2^T)
    r = zeros(T, E).scatter(1, ids, w)             (the [T, E] routing matrix, K nonzeros a row)
    out = (h * r.t().unsqueeze(-1)).sum(0)

Found: a ``Region`` whose combine is ``ReplaceOutput`` (the combined output node). The walk
dispatches through two tables: ``ROUTING_RULES`` (ids, sort, counts, offsets, inverse, entry of the
rows, side tensors: ``grouped_routing.py``) and, for ops on a group's rows, ``ROW_RULES`` then
``ROW_TAIL`` (``grouped_rows.py``, ``grouped_combine.py``). Anything not matched is left exactly as
Dynamo gave it; facts that block a rewrite become findings.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import dense_input
from . import grouped_routing as route
from . import grouped_rows as rows
from .grouped_combine import pair_op, unsort_into
from .grouped_state import CASTS, DONE, FLATTEN, GMM_OPS, ROW_KINDS, GRole, Group
from .expert_ids import ID_VIEWS
from .id_range import id_bound, ids_nonnegative
from .normalize import canon, common_module, dtype_of, module_path, shape, val, where_in_user_code
from .region import Candidate, ExpertMLP, Finding, Region, ReplaceOutput, Router, Step

# (ops, role kind the first argument must have or None for any, rule), in the order they are tried
_ROUTING = (
    (FLATTEN, None, route.flat_ids),
    (("sort", "argsort"), None, route.sort_ids),
    (("getitem",), "sort", route.sort_parts),
    (CASTS, None, route.cast_keeps_kind),
    (("getitem",), "flat", route.sorted_by_perm),
    (("floordiv", "div"), "perm", route.token_of_row),
    (("ge", "unsqueeze"), None, route.sentinel),
    (("clamp", "clamp_"), "sorted_ids", route.clamp_ids),
    (("histc",), None, route.counts_histc),
    (("bincount",), None, route.counts_bincount),
    (("one_hot",), None, route.onehot_ids),
    (("sum",), "onehot", route.counts_of_onehot),
    (("cumsum",), "counts", route.offsets),
    (("empty_like",), "perm", route.inverse_alloc),
    (("setitem",), "inv_alloc", route.inverse_fill),
    (("argsort",), "perm", route.inverse_argsort),
    (("getitem",), None, route.enter_getitem),
    (("index_select",), None, route.enter_index_select),
    (("gather",), None, route.enter_gather),
    (("repeat_interleave",), None, route.enter_batched),
    (("expand",), None, route.enter_dense),
    (("getitem",), None, route.side_tensor),
    (("transpose",), "wsel", route.wsel_transpose),
    (("scatter", "scatter_"), None, route.routing_matrix),
    (("t", "transpose", "permute", "unsqueeze", "getitem", "view", "reshape"), "routing", route.routing_view),
)
ROUTING_RULES: dict[str, tuple] = {}
for _ops, _kind, _rule in _ROUTING + dense_input.ROUTING:
    for _op in _ops:
        ROUTING_RULES[_op] = ROUTING_RULES.get(_op, ()) + ((_kind, _rule),)

ROW_RULES: dict[str, tuple] = {
    "masked_fill": (rows.sentinel_mask,), "masked_fill_": (rows.sentinel_mask,),
    **{op: (rows.scatter_back,) for op in ("index_add_", "index_add", "scatter_add_", "scatter_add")},
    **{op: (rows.grouped_gemm,) for op in GMM_OPS},
    "bmm": (rows.dense_linear, rows.batched_bmm), "matmul": (rows.dense_linear,),
    "unsqueeze": (rows.batched_unsqueeze,), "getitem": (rows.batched_unsqueeze,),
    "squeeze": (rows.batched_squeeze,),
    **{op: (rows.bias_add,) for op in ("add_", "add", "iadd", "add_inplace")},
    "mul": (rows.weights_mul,),
    "type_as": (rows.type_as_cast,),
    "setitem": (unsort_into,),
    **{op: (rows.fresh_like,) for op in ("zeros_like", "empty_like", "new_zeros", "new_empty")},
}
for _op, _rules in dense_input.ROW_RULES.items():   # dense experts weighted on their input (Llama 4)
    ROW_RULES[_op] = _rules + ROW_RULES.get(_op, ())
ROW_TAIL = (rows.cast_after_weights, rows.unsort_rows, rows.dense_sum, rows.elementwise)


class Finder:
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.role: dict[fx.Node, GRole] = {}
        self.groups: list[Group] = []
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def r(self, x) -> GRole | None:
        return self.role.get(x) if isinstance(x, fx.Node) else None

    def set(self, n, kind, g=None, info=None):
        self.role[n] = GRole(kind, g, info)
        if g is not None:
            g.nodes.add(n)

    def group(self, family, key) -> Group:
        g = Group(family, key)
        self.groups.append(g)
        return g

    # ------------------------------------------------------------------ the walk
    def run(self) -> list[Candidate]:
        for n in self.gm.graph.nodes:
            if n.op in ("call_function", "call_method"):
                why = ""
                try:
                    self.visit(n, canon(n))
                except (TypeError, IndexError, AttributeError) as exc:  # an unexpected spelling: no role
                    why = f" (matcher error {type(exc).__name__}: {exc})"
                if n not in self.role:
                    self.note_unhandled(n, why)
        return [c for g in self.groups for c in self.finish(g)]

    def visit(self, n: fx.Node, op: str):
        a0 = n.args[0] if n.args else None
        r0 = self.r(a0)
        rk = r0.kind if r0 else None
        for kind, rule in ROUTING_RULES.get(op, ()):
            if (kind is None or kind == rk) and rule(self, n, op, a0, r0, rk) is DONE:
                return
        rows_in = [a for a in n.all_input_nodes if self.r(a) and self.r(a).kind in ROW_KINDS]
        if rows_in:
            g = self.r(rows_in[0]).g
            if any(self.r(a).g is not g for a in rows_in):
                g.note("two_regions_mixed", n, node=n.name)
                return
            for rule in ROW_RULES.get(op, ()) + ROW_TAIL:
                if rule(self, g, n, op, rows_in) is DONE:
                    return
            return
        for kind in ("pair", "pair3", "pair1"):
            ins = [a for a in n.all_input_nodes if self.r(a) and self.r(a).kind == kind]
            if ins:
                pair_op(self, self.r(ins[0]).g, n, op, ins[0], kind)
                return

    def note_unhandled(self, n: fx.Node, why: str = ""):
        for a in n.all_input_nodes:
            ro = self.r(a)
            if ro and ro.g is not None and ro.kind in ROW_KINDS + ("pair", "pair3", "pair1") and not ro.g.findings:
                ro.g.note("unsupported_row_op", n, op=canon(n), at=where_in_user_code(n) or "?", why=why)

    # ------------------------------------------------------------------ building the expert function
    def sorted_group_of(self, ro: GRole, node: fx.Node):
        """The sort group of sorted ids, or of flat ids (counts taken before sorting)."""
        if ro.g is not None:
            return ro.g
        while self.r(node) and self.r(node).kind == "flat" and canon(node) in CASTS:
            node = node.args[0]
        g = next((g for g in self.groups if g.family == "sorted" and g.flat is node), None)
        if g is None and self.r(node) and self.r(node).kind == "flat":   # counts before the sort
            g = route.sort_ahead(self, node)
        return g

    def enter(self, n, x, ri: GRole):
        g = ri.g
        v = val(x)
        if g is None or not isinstance(v, torch.Tensor) or v.dim() != 2 or not v.is_floating_point():
            return
        if ri.kind == "perm" and g.k != 1:
            g.note("topk_mismatch", n, what=f"rows are gathered by perm (not perm // {g.k})", k=g.k)
        if g.x is not None:
            return
        g.x = x
        g.step_of[n] = -1
        self.set(n, "rows", g)

    def _enc(self, g: Group, x):
        if isinstance(x, fx.Node):
            ro = self.r(x)
            if ro is not None and ro.kind in ("rows", "chunks") and ro.g is g:
                i = g.step_of[x]
                return ("in",) if i == -1 else ("step", i)
            g.slots.append((x,))
            return ("slot", len(g.slots) - 1)
        if isinstance(x, (list, tuple)):
            return type(x)(self._enc(g, i) for i in x)
        return x

    def step(self, g: Group, n: fx.Node, kind="rows", linear=None, args=None, target=None) -> None:
        if g.weighted_at is not None:
            g.note("weights_before_last_op", n)
        enc_args = self._enc(g, n.args if args is None else args)
        enc_kw = tuple(sorted((k, self._enc(g, v)) for k, v in n.kwargs.items())) if args is None else ()
        g.steps.append(Step(n.op, n.target if target is None else target, enc_args, enc_kw, linear,
                            dtype_of(n) if linear is not None else None))
        g.step_of[n] = len(g.steps) - 1
        self.set(n, kind, g)

    def linear(self, g: Group, n: fx.Node, rows_node: fx.Node, w3: fx.Node, layout: str) -> None:
        wv = val(w3)
        if not isinstance(wv, torch.Tensor) or wv.dim() != 3:
            g.note("weight_not_3d", n, node=w3.name)
            return
        if g.e is None:
            g.e = wv.shape[0]
        elif wv.shape[0] != g.e:
            g.note("expert_count_mismatch", n, node=w3.name, weights=wv.shape[0], router=g.e)
        g.slots.append((w3,))
        slot = len(g.slots) - 1
        g.linears += 1
        self.step(g, n, linear=(slot, None, layout), args=(rows_node, ("slot", slot)))

    def add_bias(self, g: Group, lin: fx.Node, bias2d: fx.Node, n: fx.Node) -> bool:
        i = g.step_of.get(lin)
        st = g.steps[i] if i is not None and i >= 0 else None
        if st is None or st.linear is None or st.linear[1] is not None:
            return False
        bv = val(bias2d)
        if not isinstance(bv, torch.Tensor) or bv.dim() != 2 or bv.shape[0] != g.e:
            g.note("bias_not_per_expert", n, node=bias2d.name)
            return False
        g.slots.append((bias2d,))
        g.steps[i] = Step(st.op, st.target, st.args, st.kwargs, (st.linear[0], len(g.slots) - 1, st.linear[2]),
                          st.dtype, bias_after=True, sum_dtype=dtype_of(n))
        g.step_of[n] = i
        self.set(n, "rows", g)
        return True

    # ------------------------------------------------------------------ results
    def finish(self, g: Group) -> list[Candidate]:
        if not g.linears:
            return []  # a sort or expand that never fed an expert linear: not an MoE region
        anchor = g.output or g.key
        module = common_module([m for m in g.nodes if m.op != "placeholder"]) or module_path(anchor)
        where = where_in_user_code(g.output or next(m for m in g.nodes if g.step_of.get(m, -2) >= 0))
        form = f"{g.family}/{'index_add' if g.aliases else 'gather-sum'}"
        findings = self.findings(g)
        if findings:
            return [Candidate(module, form, where, None, tuple(findings), g.e or 0, g.k or 0)]
        nodes = tuple(sorted(g.nodes, key=self.order.__getitem__))
        on_input = g.input_weights is not None
        router = Router(ids=g.ids, weights=g.input_weights if on_input else g.weights, top_k=g.k, num_experts=g.e,
                        scale_input=on_input, per_expert=on_input and g.family == "dense", input_dtype=g.input_dtype)
        combine = ReplaceOutput(g.output, val(g.output).dtype, tuple(g.aliases),
                                tuple(sorted(set(g.erase) | {g.output}, key=self.order.__getitem__)), g.base)
        region = Region(module, form, where, g.x, router, ExpertMLP(tuple(g.steps[:g.end + 1]), tuple(g.slots)),
                        combine, nodes)
        return [Candidate(module, form, where, region, (), g.e, g.k)]

    def findings(self, g: Group) -> list[Finding]:
        if g.findings:
            return g.findings[:1]
        if g.output is None:
            return [Finding.of("not_combined")]
        if g.ids is None or g.k is None or g.e is None or g.x is None:
            return [Finding.of("router_unknown")]
        if g.end is None or (g.weighted_at is not None and g.weighted_at != g.end):
            return [Finding.of("weights_before_last_op")]
        if g.input_weights is not None and g.weights is not None:   # on the input and on the output
            return [Finding.of("weights_twice")]
        for node, bound in g.clamps:   # clamp(max=E - 1) only: another bound moves rows to another expert
            if bound != g.e - 1:
                return [Finding.of("sentinel_mismatch", node, sentinel=bound + 1, experts=g.e)]
        if g.clamped_counts is not None and not ((b := id_bound(g.ids)) is not None and b <= g.e):
            return [Finding.of("clamped_counts", g.clamped_counts, node=g.clamped_counts.name, e=g.e,
                               bound=b if b is not None else "?")]
        if g.family != "dense" and not ids_nonnegative(g.ids):   # (dense: eager's scatter raises on them)
            if _graph_input(g.ids):
                return [Finding.of("ids_from_graph_input", g.ids, node=g.ids.name)]
            return [Finding.of("ids_may_be_negative", g.ids, node=g.ids.name)]
        if shape(g.x)[0] * g.k != val(g.ids).numel():
            return [Finding.of("token_count_mismatch", None, tokens=shape(g.x)[0], k=g.k, ids=val(g.ids).numel())]
        for m in g.nodes:  # every row-valued node must be consumed inside the region
            if m is g.output or m in g.aliases:
                continue
            if self.r(m).kind in ("rows", "chunks", "pair", "pair3", "pair1", "unsq", "bmm", "inv", "inv_alloc",
                                   "sw"):
                outside = [u for u in m.users if u not in g.nodes]
                if outside:
                    return [Finding.of("escaping_intermediate", m, node=m.name, user=outside[0].name)]
        return []


def _graph_input(ids: fx.Node) -> bool:
    """The ids are an input of the graph (through views and casts): the router ran in another graph."""
    for _ in range(8):
        if not isinstance(ids, fx.Node) or ids.op == "placeholder":
            break
        if not ids.args or (canon(ids) not in ID_VIEWS and canon(ids) not in CASTS and canon(ids) not in FLATTEN):
            return False
        ids = ids.args[0]
    return isinstance(ids, fx.Node) and ids.op == "placeholder"


def find_grouped_regions(gm: fx.GraphModule) -> list[Candidate]:
    """Sorted/grouped, batched and dense MoE regions of a Dynamo graph (see the module docstring), and
    retrieval experts (rows of an embedding table per routed id: refused, ``retrieval_regions``)."""
    from .retrieval_regions import find_retrieval_regions

    return Finder(gm).run() + find_retrieval_regions(gm)
