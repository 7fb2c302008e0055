"""lower_moe_region: replace one accepted MoE region with the moe_compile ops (the only mutation).

Before: see ``passes/moe_regions.py`` (E unrolled per-expert blocks: where/nonzero, gathers, the
expert MLP, weighted accumulation into ``acc``, plus Dynamo's runtime asserts on the
data-dependent sizes).

After, inserted after the region's last write::

    perm, inv, offs = moe_compile.route_permute(ids, E)          # static shapes, no host sync
    h0 = moe_compile.permute_rows(x, perm, inv, offs, K)
    h_i = <template step i>     linears -> moe_compile.grouped_mm(h, W[E,K,N], offs, bias)
                                           or grouped_mm_list(h, [W_e], offs, [b_e], transposed=True)
                                              (ModuleList nn.Linear weights [N, K], no per-expert view)
                sibling linears of one input (SwiGLU w1, w3) -> one grouped_mm_list_cat(h, [W1_e], [W3_e], ...)
    out = moe_compile.unpermute_combine(h_last, inv, weights[T,K] | ones, offs).to(acc.dtype) (+ base)

Every reader of the finished accumulator reads ``out``; the writes into ``acc``, the per-expert
nodes and the runtime asserts that guarded their sizes are removed; dead code is eliminated with an
impurity check that keeps every other in-place op. ``meta["example_value"]`` is computed for each
new node under the graph's fake mode. Invariant: no node of the region, and no unbacked symbol it
introduced, is left in the graph.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from moe_compile.kernels import ops as _ops  # noqa: F401  (registers torch.ops.moe_compile.*)
from moe_compile.passes.moe_regions import MoERegion
from moe_compile.passes.normalize import canon, val

OPS = torch.ops.moe_compile
_ASSERT_TARGETS = {"_assert_scalar", "sym_constrain_range_for_size", "sym_constrain_range", "_assert_async",
                   "_check_is_size", "_check"}


class LoweringError(RuntimeError):
    """Raised when a region cannot be rewritten; the driver then keeps the original graph."""


def _fake_mode(region: MoERegion):
    v = val(region.x)
    mode = getattr(v, "fake_mode", None)
    if mode is None:
        raise LoweringError("lower_moe_region: the expert input has no fake value to propagate metadata from")
    return mode


class _Builder:
    """Creates nodes after a cursor and gives each a fake ``example_value``."""

    def __init__(self, graph: fx.Graph, after: fx.Node, mode, meta_from: fx.Node):
        self.graph, self.cursor, self.mode, self.meta_from = graph, after, mode, meta_from

    def _val(self, x):
        if isinstance(x, fx.Node):
            return x.meta["example_value"]
        if isinstance(x, (list, tuple)):
            return type(x)(self._val(i) for i in x)
        return x

    def __call__(self, op: str, target, args=(), kwargs=None) -> fx.Node:
        kwargs = kwargs or {}
        with self.graph.inserting_after(self.cursor):
            node = self.graph.create_node(op, target, tuple(args), dict(kwargs))
        self.cursor = node
        a, k = self._val(node.args), self._val(node.kwargs)
        with self.mode:
            if op == "call_method":
                v = getattr(a[0], target)(*a[1:], **k)
            else:
                v = target(*a, **k)
        node.meta["example_value"] = v
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in self.meta_from.meta:
                node.meta[key] = self.meta_from.meta[key]
        return node

    def fn(self, target, *args, **kwargs):
        return self("call_function", target, args, kwargs)

    def method(self, name, *args, **kwargs):
        return self("call_method", name, args, kwargs)


def _stacked_source(nodes: tuple[fx.Node, ...]) -> fx.Node | None:
    """The stacked parameter P if expert e's operand is P[e] for every e, else None."""
    src = nodes[0].args[0] if canon(nodes[0]) == "getitem" else None
    if src is None or any(canon(n) != "getitem" or n.args[0] is not src or n.args[1] != e
                          for e, n in enumerate(nodes)):
        return None
    return src


def _stacked(b: _Builder, nodes: tuple[fx.Node, ...], layout: str):
    """A 3-D weight view [E, K, N] if all experts index one stacked parameter, else None."""
    src = _stacked_source(nodes)
    if src is None:
        return None
    sv = val(src)
    if not isinstance(sv, torch.Tensor) or sv.dim() not in (2, 3) or sv.shape[0] != len(nodes):
        return None
    if sv.dim() == 2:           # a stacked bias [E, N]
        return src
    return b.method("transpose", src, 1, 2) if layout == "nk" else src


def _emit_linear(b: _Builder, region: MoERegion, h: fx.Node, step, offs: fx.Node) -> fx.Node:
    w_slot, b_slot, layout = step.linear
    ws = region.template.slots[w_slot]
    bs = region.template.slots[b_slot] if b_slot is not None else None
    if len(ws) == 1 and val(ws[0]).dim() == 3:      # one weight for all experts (grouped_regions)
        w3 = ws[0] if layout == "kn" else b.method("transpose", ws[0], 1, 2)
        return b.fn(OPS.grouped_mm.default, h, w3, offs, bs[0] if bs is not None else None)
    w3 = _stacked(b, ws, layout)
    b3 = _stacked(b, bs, layout) if bs is not None else None
    if w3 is not None and (bs is None or b3 is not None):
        return b.fn(OPS.grouped_mm.default, h, w3, offs, b3)
    # nn.Linear weights [N, K] go in as they are (transposed=True): no per-expert view in the graph
    return b.fn(OPS.grouped_mm_list.default, h, list(ws), offs, list(bs) if bs is not None else [], layout == "nk")


def _is_list_linear(region: MoERegion, step) -> bool:
    """A linear whose experts hold separate 2-D weights (ModuleList) and no bias, layout nk."""
    if step.linear is None or step.linear[1] is not None or step.linear[2] != "nk":
        return False
    ws = region.template.slots[step.linear[0]]
    return len(ws) > 1 and val(ws[0]).dim() == 2 and _stacked_source(ws) is None


def _sibling_linears(region: MoERegion) -> dict[int, int]:
    """{i: j}: template steps i < j are list linears of the same input and weight dtype (SwiGLU's
    w1 and w3): lowered as one grouped_mm_list_cat, one GEMM once the weights share a buffer."""
    pairs, used = {}, set()
    steps = region.template.steps
    for i, si in enumerate(steps):
        if i in used or not _is_list_linear(region, si):
            continue
        for j in range(i + 1, len(steps)):
            sj = steps[j]
            if j not in used and _is_list_linear(region, sj) and sj.args[0] == si.args[0] \
                    and val(region.template.slots[sj.linear[0]][0]).dtype == \
                    val(region.template.slots[si.linear[0]][0]).dtype:
                pairs[i] = j
                used.update((i, j))
                break
    return pairs


def _emit_sibling_linears(b: _Builder, region: MoERegion, h: fx.Node, si, sj, offs: fx.Node):
    ws_a, ws_b = list(region.template.slots[si.linear[0]]), list(region.template.slots[sj.linear[0]])
    y = b.fn(OPS.grouped_mm_list_cat.default, h, ws_a, ws_b, offs, True)  # [N, K] weights as they are
    na = val(region.template.slots[si.linear[0]][0]).shape[0]
    return (b.fn(operator.getitem, y, (slice(None), slice(None, na))),
            b.fn(operator.getitem, y, (slice(None), slice(na, None))))


def _decode(x, env, region: MoERegion):
    if isinstance(x, tuple) and x[:1] == ("in",):
        return env["in"]
    if isinstance(x, tuple) and len(x) == 2 and x[0] == "step":
        return env[x[1]]
    if isinstance(x, tuple) and len(x) == 2 and x[0] == "slot":
        return region.template.slots[x[1]][0]   # check_region: non-linear operands are shared
    if isinstance(x, (list, tuple)):
        return type(x)(_decode(i, env, region) for i in x)
    return x


def lower_moe_region(gm: fx.GraphModule, region: MoERegion) -> None:
    """Rewrite ``region`` in ``gm`` (in place), then lint and recompile."""
    g = gm.graph
    anchor = region.output if region.output is not None else max(region.mutations, key=list(g.nodes).index)
    b = _Builder(g, anchor, _fake_mode(region), anchor)
    e, k = region.num_experts, region.top_k

    routed = b.fn(OPS.route_permute.default, region.ids, e)
    perm, inv, offs = (b.fn(operator.getitem, routed, i) for i in range(3))
    env = {"in": b.fn(OPS.permute_rows.default, region.x, perm, inv, offs, k)}
    siblings = _sibling_linears(region)
    for i, step in enumerate(region.template.steps):
        if i in env:
            continue  # the second of two sibling linears, emitted with the first
        if i in siblings:
            j = siblings[i]
            env[i], env[j] = _emit_sibling_linears(b, region, _decode(step.args[0], env, region), step,
                                                    region.template.steps[j], offs)
        elif step.linear is not None:
            env[i] = _emit_linear(b, region, _decode(step.args[0], env, region), step, offs)
        else:
            env[i] = b(step.op, step.target, _decode(step.args, env, region),
                       dict(_decode(step.kwargs, env, region)))
    h = env[len(region.template.steps) - 1]
    hv = val(h)
    if region.weights is not None:
        w = region.weights
    else:  # unweighted experts: weight 1 per routed pair (built from ids: no symbolic sizes needed)
        w = b.fn(torch.ones_like, region.ids, dtype=torch.float32)
    if val(w).dim() != 2:
        w = b.method("reshape", w, -1, k)
    out = b.fn(OPS.unpermute_combine.default, h, inv, w, offs)
    if hv.dtype != region.acc_dtype:
        out = b.method("to", out, region.acc_dtype)
    if region.base is not None:
        out = b.fn(operator.add, region.base, out)

    if region.output is not None:
        _rewire_output(g, region, out)
        _finish(gm, region)
        return
    aliases = set(region.aliases)
    for reader in region.readers:
        for a in list(reader.all_input_nodes):
            if a in aliases:
                reader.replace_input_with(a, out)
    for m in sorted(region.mutations, key=list(g.nodes).index, reverse=True):
        for u in list(m.users):  # aliases returned by in-place ops, read only by the pattern itself
            if u not in region.mutations and u not in region.readers:
                u.replace_input_with(m, out)
        g.erase_node(m)
    _finish(gm, region)


def _finish(gm: fx.GraphModule, region: MoERegion) -> None:
    g = gm.graph
    _erase_region_asserts(g)
    eliminate_dead_code(g)
    g.lint()
    gm.recompile()


def eliminate_dead_code(g: fx.Graph) -> None:
    """Erase nodes without users that ``_is_impure`` calls pure, in this graph only.

    Not ``fx.Graph.eliminate_dead_code``: that one also walks every subgraph the graph reaches
    through ``get_attr`` (the bodies of higher-order ops such as a custom autograd Function's
    forward and backward) with torch's default impurity rule, which calls Dynamo's in-place
    method calls pure. It erased ``scatter_add_`` from the backward of Hugging Face PhiMoE's
    ``PhimoeMultiplier`` and trained the router with a wrong gradient."""
    for node in reversed(g.nodes):
        if not node.users and not _is_impure(node):
            g.erase_node(node)


def _rewire_output(g: fx.Graph, region: MoERegion, out: fx.Node) -> None:
    """Output forms: readers of ``output`` (and of its in-place aliases, after it) read ``out``;
    the region's side-effecting nodes (checked by the matcher to touch only region-internal
    tensors) are erased, then every pure region node left without users."""
    order = {n: i for i, n in enumerate(g.nodes)}
    new = {n for n in g.nodes if order[region.output] < order[n] <= order[out]}
    for src in (region.output, *region.aliases):
        for u in list(src.users):
            if u not in new and order[u] > order[region.output]:
                u.replace_input_with(src, out)
    for n in sorted(set(region.erase) | set(region.expert_nodes), key=order.__getitem__, reverse=True):
        if not n.users and n.op != "placeholder" and (n in region.erase or not _is_impure(n)):
            g.erase_node(n)


def _is_impure(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function" and node.target in (operator.setitem,):
        return True
    if node.op == "call_function" and canon(node) in _ASSERT_TARGETS:
        return True
    return node.is_impure() if node.op == "call_function" else False


def _erase_region_asserts(g: fx.Graph) -> None:
    """Remove runtime asserts whose inputs are only kept alive by them (the region's sizes)."""
    asserts = [n for n in g.nodes if n.op == "call_function" and canon(n) in _ASSERT_TARGETS]
    live: set[fx.Node] = set()
    roots = [n for n in g.nodes if _is_impure(n) and n not in asserts]
    while roots:
        n = roots.pop()
        if n in live:
            continue
        live.add(n)
        roots.extend(n.all_input_nodes)
    for a in reversed(asserts):
        if not all(_alive_without_asserts(i, live) for i in a.all_input_nodes):
            g.erase_node(a)


def _alive_without_asserts(n: fx.Node, live: set) -> bool:
    """True if n's value is needed by something other than asserts (sym-size chains count as
    needed when their tensor source is)."""
    if n in live:
        return True
    stack, seen = [n], set()
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        if m in live:
            return True
        if isinstance(val(m), torch.Tensor):
            continue  # a tensor that nothing live needs: the assert guards a dead value
        stack.extend(m.all_input_nodes)
    return False
