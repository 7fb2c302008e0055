"""find_grouped_regions: MoE forms that process all routed (token, slot) pairs at once (never mutates).

Legend: T tokens, K top-k, N = T*K routed pairs, E experts, H width, I expert width.

Three families, each a chain of "rows" (one row per routed pair, or per (expert, token) for dense)
flowing through an expert template whose linears use one 3-D weight for all experts::

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

After lowering (``lowering/moe_region.py``; the region's ``output`` is replaced)::

    perm, inv, offs = route_permute(ids, E); h = permute_rows(x, perm, inv, offs, K)
    h = <template, each linear -> grouped_mm(h, W[E, in, out], offs, bias[E, out])>
    out = unpermute_combine(h, inv, w[T, K] | ones, offs)

Refused (with a reason): a dense combine whose [T, E] matrix is not a top-k scatter (soft MoE);
routing weights applied before the expert's last op; expert intermediates used outside the
region; ops on the rows that are not row-wise; weights whose leading dim is not E; inconsistent
K. Anything not matched is left exactly as Dynamo gave it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .dataflow import ROWWISE_BINARY, ROWWISE_UNARY
from .grouped_combine import CASTS, CombineRules
from .moe_regions import MoERegion, Refused, Step, Template
from .normalize import arg, canon, common_module, module_path, shape, val, where_in_user_code

GMM_OPS = {"_grouped_mm", "grouped_mm", "transformers::grouped_mm_fallback"}
FLATTEN = {"reshape", "view", "flatten"}
FRESH = {"zeros_like", "zeros", "new_zeros", "empty_like", "empty", "new_empty"}


@dataclass(frozen=True)
class _Role:
    kind: str     # flat sorted_ids perm tok counts offs inv_alloc inv sw bias wsel rows chunks unsq bmm
    #               pair pair3 tokx routing dw out
    g: "_Group | None" = None
    info: object = None


@dataclass(eq=False)
class _Group:
    """State of one candidate region (mutable analysis state)."""
    family: str                # sorted | batched | dense
    key: fx.Node
    flat: fx.Node | None = None      # flat expert ids [N] (sorted, batched)
    ids: fx.Node | None = None       # [T, K] (or [T]) ids
    k: int | None = None
    e: int | None = None
    x: fx.Node | None = None
    offs: fx.Node | None = None
    steps: list = field(default_factory=list)
    slots: list = field(default_factory=list)
    step_of: dict = field(default_factory=dict)   # row node -> step index (-1: the input rows)
    nodes: set = field(default_factory=set)
    erase: list = field(default_factory=list)
    weights: fx.Node | None = None
    weighted_at: int | None = None                # step index the routing weights multiplied
    last: int | None = None                       # step index of the newest template step
    end: int | None = None                        # step index of the rows that are combined
    output: fx.Node | None = None
    aliases: tuple = ()
    problem: str = ""
    linears: int = 0


def _int(x):
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _is_last(dim, node) -> bool:
    v = val(node)
    return dim == -1 or (isinstance(v, torch.Tensor) and dim == v.dim() - 1)


def _shared_ok(x) -> bool:
    """A non-row operand of a row-wise op: a constant, or a tensor that broadcasts along the last dim."""
    if not isinstance(x, fx.Node):
        return True
    v = val(x)
    return isinstance(v, torch.Tensor) and (v.numel() == 1 or v.dim() <= 1)


class _Finder(CombineRules):
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.role: dict[fx.Node, _Role] = {}
        self.groups: list[_Group] = []
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def r(self, x) -> _Role | None:
        return self.role.get(x) if isinstance(x, fx.Node) else None

    # ------------------------------------------------------------------ template building
    def _enc(self, g: _Group, x):
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

    def _step(self, g: _Group, n: fx.Node, kind="rows", linear=None, args=None) -> None:
        if g.weighted_at is not None:
            g.problem = g.problem or (f"routing weights are applied before the expert's last op "
                                      f"`{n.name}` at {where_in_user_code(n) or '?'}")
        enc_args = self._enc(g, n.args if args is None else args)
        enc_kw = tuple(sorted((k, self._enc(g, v)) for k, v in n.kwargs.items())) if args is None else ()
        g.steps.append(Step(n.op, n.target, enc_args, enc_kw, linear))
        g.step_of[n] = len(g.steps) - 1
        g.last = len(g.steps) - 1
        self._set(n, kind, g)

    def _set(self, n, kind, g=None, info=None):
        self.role[n] = _Role(kind, g, info)
        if g is not None:
            g.nodes.add(n)

    def _linear(self, g: _Group, n: fx.Node, rows: fx.Node, w3: fx.Node, layout: str) -> None:
        wv = val(w3)
        if not isinstance(wv, torch.Tensor) or wv.dim() != 3:
            g.problem = g.problem or f"expert weight `{w3.name}` is not 3-D"
            return
        if g.e is None:
            g.e = wv.shape[0]
        elif wv.shape[0] != g.e:
            g.problem = g.problem or f"expert weight `{w3.name}` has {wv.shape[0]} experts, the router {g.e}"
        g.slots.append((w3,))
        slot = len(g.slots) - 1
        g.linears += 1
        self._step(g, n, linear=(slot, None, layout), args=(rows, ("slot", slot)))

    def _add_bias(self, g: _Group, lin: fx.Node, bias2d: fx.Node, n: fx.Node) -> bool:
        i = g.step_of.get(lin)
        st = g.steps[i] if i is not None and i >= 0 else None
        if st is None or st.linear is None or st.linear[1] is not None:
            return False
        bv = val(bias2d)
        if not isinstance(bv, torch.Tensor) or bv.dim() != 2 or bv.shape[0] != g.e:
            g.problem = g.problem or f"per-expert bias `{bias2d.name}` is not [E, out]"
            return False
        g.slots.append((bias2d,))
        g.steps[i] = Step(st.op, st.target, st.args, st.kwargs, (st.linear[0], len(g.slots) - 1, st.linear[2]))
        g.step_of[n] = i
        self._set(n, "rows", g)
        return True

    # ------------------------------------------------------------------ the walk
    def run(self) -> list[MoERegion | Refused]:
        for n in self.gm.graph.nodes:
            if n.op in ("call_function", "call_method"):
                why = ""
                try:
                    self.visit(n, canon(n))
                except (TypeError, IndexError, AttributeError) as exc:  # an unexpected spelling: no role
                    why = f"matcher error {type(exc).__name__}: {exc}"
                if n not in self.role:
                    self._note_unhandled(n, why)
        return [x for g in self.groups for x in self._finish(g)]

    def _note_unhandled(self, n: fx.Node, why: str = ""):
        for a in n.all_input_nodes:
            ro = self.r(a)
            if ro and ro.g is not None and ro.kind in ("rows", "chunks", "unsq", "bmm", "pair", "pair3") \
                    and not ro.g.problem:
                ro.g.problem = (f"unsupported op `{canon(n)}` ({n.name}) on the expert rows at "
                                f"{where_in_user_code(n) or '?'}" + (f" ({why})" if why else ""))

    def _group(self, family, key) -> _Group:
        g = _Group(family, key)
        self.groups.append(g)
        return g

    def visit(self, n: fx.Node, op: str):  # noqa: C901  (one dispatch table, read top to bottom)
        a0 = n.args[0] if n.args else None
        r0 = self.r(a0)
        rk = r0.kind if r0 else None
        # ---- routing ids ----------------------------------------------------------------------
        if op in FLATTEN and rk is None and isinstance(val(a0), torch.Tensor) and not val(a0).is_floating_point() \
                and val(a0).dim() == 2 and tuple(val(n).shape) == (val(a0).numel(),):
            self._set(n, "flat", info=a0)
            return
        if op in ("sort", "argsort") and rk is None and shape(a0) and len(shape(a0)) == 1 \
                and not val(a0).is_floating_point():
            self._set(a0, "flat", info=a0)        # top-1 ids [T] sorted directly
            rk, r0 = "flat", self.r(a0)
        if op == "sort" and rk == "flat" and not arg(n, 2, "descending", False):
            g = self._group("sorted", n)
            g.flat, g.ids, g.k = a0, r0.info, (val(r0.info).shape[-1] if val(r0.info).dim() == 2 else 1)
            self._set(n, "sort", g)
            return
        if op == "argsort" and rk == "flat" and not arg(n, 2, "descending", False):
            g = self._group("sorted", n)
            g.flat, g.ids, g.k = a0, r0.info, (val(r0.info).shape[-1] if val(r0.info).dim() == 2 else 1)
            self._set(n, "perm", g)
            return
        if op == "getitem" and rk == "sort":
            self._set(n, "sorted_ids" if n.args[1] == 0 else "perm", r0.g)
            return
        if rk in ("sorted_ids", "flat", "counts", "offs") and op in CASTS:
            self._set(n, rk, r0.g, r0.info)
            return
        if op == "getitem" and rk == "flat" and self.r(n.args[1]) and self.r(n.args[1]).kind == "perm":
            self._set(n, "sorted_ids", self.r(n.args[1]).g)
            return
        if rk == "perm" and op in ("floordiv", "div") and (op == "floordiv" or n.kwargs.get("rounding_mode") == "floor"):
            if n.args[1] != r0.g.k:
                r0.g.problem = f"rows are gathered with perm // {n.args[1]} but the router has top_k {r0.g.k}"
            self._set(n, "tok", r0.g)
            return
        # expert-parallel sentinels (transformers <= 5.17 always emits this): ids >= E are masked to
        # zero rows; our ops already give "dropped" ids (outside [0, E)) zero rows everywhere
        if op == "ge" and rk == "sorted_ids" and _int(n.args[1]) is not None:
            self._set(n, "sentinel", r0.g, n.args[1])
            return
        if op == "unsqueeze" and rk == "sentinel":
            self._set(n, "sentinel", r0.g, r0.info)
            return
        if op in ("clamp_", "clamp") and rk == "sorted_ids" and arg(n, 1, "min") is None \
                and _int(arg(n, 2, "max")) is not None:
            self._set(n, "sorted_ids", r0.g)
            if op == "clamp_":
                r0.g.erase.append(n)
            return
        if op == "histc" and rk in ("sorted_ids", "flat"):
            g = self._sorted_group_of(r0, a0)
            bins = arg(n, 1, "bins", 100)
            if g is not None and arg(n, 2, "min", 0) == 0 and arg(n, 3, "max", 0) == bins - 1:
                self._set(n, "counts", g, bins)
            return
        if op == "bincount" and rk in ("sorted_ids", "flat"):
            g = self._sorted_group_of(r0, a0)
            s = shape(n)
            if g is not None and s and isinstance(s[0], int) and s[0] == arg(n, 2, "minlength", 0):
                self._set(n, "counts", g, s[0])
            return
        if op == "one_hot" and rk in ("sorted_ids", "flat"):
            self._set(n, "onehot", self._sorted_group_of(r0, a0), arg(n, 1, "num_classes"))
            return
        if op == "sum" and rk == "onehot" and arg(n, 1, "dim") in (0, (0,), [0]):
            self._set(n, "counts", r0.g, r0.info)
            return
        if op == "cumsum" and rk == "counts" and arg(n, 1, "dim") in (0, -1) and r0.g is not None:
            g = r0.g
            g.offs, g.e = n, r0.info if g.e is None else g.e
            self._set(n, "offs", g)
            return
        if op == "empty_like" and rk == "perm":
            self._set(n, "inv_alloc", r0.g)
            return
        if op == "setitem" and rk == "inv_alloc" and self.r(n.args[1]) and self.r(n.args[1]).kind == "perm" \
                and isinstance(n.args[2], fx.Node) and canon(n.args[2]) == "arange":
            self._set(a0, "inv", r0.g)
            self._set(n, "mut", r0.g)
            r0.g.erase.append(n)
            return
        if op == "argsort" and rk == "perm":
            self._set(n, "inv", r0.g)
            return
        # ---- entering rows --------------------------------------------------------------------
        if op == "getitem" and rk is None and self.r(n.args[1]) and self.r(n.args[1]).kind in ("tok", "perm") \
                and shape(a0) and len(shape(a0)) == 2:
            self._enter(n, a0, self.r(n.args[1]))
            return
        if op == "index_select" and rk is None and arg(n, 1, "dim") == 0 and self.r(arg(n, 2, "index")) \
                and self.r(arg(n, 2, "index")).kind in ("tok", "perm"):
            self._enter(n, a0, self.r(arg(n, 2, "index")))
            return
        if op == "repeat_interleave" and rk is None and _int(arg(n, 1, "repeats")) and arg(n, 2, "dim") == 0:
            v = val(a0)
            if isinstance(v, torch.Tensor) and v.dim() == 2 and v.is_floating_point():
                g = self._group("batched", n)
                g.x, g.k = a0, arg(n, 1, "repeats")
                g.step_of[n] = -1
                self._set(n, "rows", g)
            return
        if op == "expand" and rk is None and isinstance(a0, fx.Node) and canon(a0) == "unsqueeze" \
                and arg(a0, 1, "dim") == 0:
            v, src = val(n), a0.args[0]
            if isinstance(v, torch.Tensor) and v.dim() == 3 and isinstance(val(src), torch.Tensor) \
                    and val(src).dim() == 2 and val(src).is_floating_point():
                g = self._group("dense", n)
                g.x, g.e = src, v.shape[0]
                g.step_of[n] = -1
                self._set(n, "rows", g)
            return
        # ---- per-row side tensors ---------------------------------------------------------------
        if op == "getitem" and rk is None and isinstance(n.args[1], fx.Node) and self.r(n.args[1]):
            ri = self.r(n.args[1])
            v = val(n)
            if ri.kind == "perm" and v.is_floating_point() and v.dim() == 1:
                self._set(n, "sw", ri.g, a0)                # w.reshape(-1)[perm]
            elif ri.kind == "sorted_ids" and v.dim() == 2:
                self._set(n, "bias", ri.g, a0)              # b[ids_sorted]
            elif ri.kind == "flat" and v.dim() == 2:
                self._set(n, "bias", None, (a0, "pair", n.args[1]))
            elif ri.kind == "flat" and v.dim() == 3:
                self._set(n, "wsel", None, (a0, n.args[1], False))  # W[flat]: gathered per-pair weights
            return
        if rk == "wsel" and op == "transpose" and {n.args[1], n.args[2]} in ({1, 2}, {-1, -2}):
            w3, flat, t = r0.info
            self._set(n, "wsel", None, (w3, flat, not t))
            return
        if op in ("scatter", "scatter_") and rk is None and arg(n, 1, "dim") == 1 \
                and canon(a0) in ("zeros", "zeros_like", "new_zeros"):
            ids, w = arg(n, 2, "index"), arg(n, 3, "src")
            if isinstance(w, fx.Node) and isinstance(ids, fx.Node) and not val(ids).is_floating_point():
                self._set(n, "routing", None, (ids, w, "te"))    # [T, E], K nonzeros per row
                if op == "scatter_":
                    self._set(a0, "routing", None, (ids, w, "te"))
            return
        if rk == "routing" and op in ("t", "transpose", "permute", "unsqueeze", "getitem", "view", "reshape"):
            s, s0 = shape(n), shape(a0)
            ids, w, orient = r0.info
            if op in ("t", "transpose", "permute") and len(s0) == 2:
                self._set(n, "routing", None, (ids, w, orient[::-1]))
            elif s and len(s) == 3 and s[-1] == 1 and s[:2] == s0[:2]:
                self._set(n, "routing", None, (ids, w, orient + "1"))
            return
        # ---- row-wise ops -----------------------------------------------------------------------
        rows_in = [a for a in n.all_input_nodes if self.r(a) and self.r(a).kind in ("rows", "chunks", "unsq", "bmm")]
        if rows_in:
            g = self.r(rows_in[0]).g
            if any(self.r(a).g is not g for a in rows_in):
                g.problem = g.problem or f"`{n.name}` mixes the rows of two MoE regions"
                return
            self._rows_op(g, n, op, rows_in)
            return
        for kind in ("pair", "pair3"):
            ins = [a for a in n.all_input_nodes if self.r(a) and self.r(a).kind == kind]
            if ins:
                self._pair_op(self.r(ins[0]).g, n, op, ins[0], kind)
                return

    def _sorted_group_of(self, ro: _Role, node: fx.Node):
        """The sort group of sorted ids, or of flat ids (counts taken before sorting)."""
        if ro.g is not None:
            return ro.g
        while self.r(node) and self.r(node).kind == "flat" and canon(node) in CASTS:
            node = node.args[0]
        return next((g for g in self.groups if g.family == "sorted" and g.flat is node), None)

    def _enter(self, n, x, ri: _Role):
        g = ri.g
        v = val(x)
        if g is None or not isinstance(v, torch.Tensor) or v.dim() != 2 or not v.is_floating_point():
            return
        if ri.kind == "perm" and g.k != 1:
            g.problem = g.problem or f"rows are gathered by perm (not perm // {g.k}) with top_k {g.k}"
        if g.x is not None:
            return
        g.x = x
        g.step_of[n] = -1
        self._set(n, "rows", g)

    def _rows_op(self, g: _Group, n: fx.Node, op: str, rows_in):  # noqa: C901
        a0 = n.args[0]
        r0 = self.r(a0)
        if op in ("masked_fill", "masked_fill_") and r0 and r0.kind == "rows" and arg(n, 2, "value") == 0:
            rm = self.r(arg(n, 1, "mask"))
            if rm and rm.kind == "sentinel" and rm.g is g:
                if g.e is not None and rm.info != g.e:
                    g.problem = g.problem or f"sentinel mask ids >= {rm.info} but the experts number {g.e}"
                g.step_of[n] = g.step_of[a0]   # zeroing dropped rows: what the rewritten ops already do
                self._set(n, "rows", g)
                if op == "masked_fill_":
                    g.erase.append(n)
                return
        if op in ("index_add_", "index_add", "scatter_add_", "scatter_add") and r0 is None and canon(a0) in FRESH:
            src = arg(n, 3, "source" if "index" in op else "src")
            if self.r(src) and self.r(src).kind == "rows" and self._combine_add(g, n, op, a0, src):
                return
        if op in GMM_OPS and r0 and r0.kind == "rows":
            w, offs = n.args[1], arg(n, 2, "offs")
            if not (self.r(offs) and self.r(offs).kind == "offs" and self.r(offs).g is g):
                g.problem = g.problem or f"`{n.name}` uses group offsets not computed from this router's ids"
                return
            if arg(n, 3, "bias") is not None or arg(n, 4, "out_dtype") is not None:
                g.problem = g.problem or f"`{n.name}`: grouped_mm with bias/out_dtype is not supported"
                return
            self._linear(g, n, a0, w, "kn")
            return
        if op in ("bmm", "matmul") and g.family == "dense" and r0 and r0.kind == "rows" \
                and not self.r(n.args[1]):
            self._linear(g, n, a0, n.args[1], "kn")
            return
        if op == "unsqueeze" and g.family == "batched" and r0 and r0.kind == "rows" and arg(n, 1, "dim") in (-1, 1):
            self._set(n, "unsq", g, (a0, arg(n, 1, "dim")))
            return
        if op == "bmm" and g.family == "batched":
            (first, second) = n.args[:2]
            rf, rs = self.r(first), self.r(second)
            # bmm(M, h[:, :, None]) = h @ M^T;  bmm(h[:, None], M) = h @ M;  M = W[ids] (or its transpose)
            if rf and rf.kind == "wsel" and rs and rs.kind == "unsq" and rs.info[1] == -1:
                self._set(n, "bmm", g, (rs.info[0], rf.info[:2], "kn" if rf.info[2] else "nk", -1))
            elif rs and rs.kind == "wsel" and rf and rf.kind == "unsq" and rf.info[1] == 1:
                self._set(n, "bmm", g, (rf.info[0], rs.info[:2], "nk" if rs.info[2] else "kn", 1))
            else:
                g.problem = g.problem or f"`{n.name}`: bmm not on gathered per-pair weights W[ids]"
            return
        if op == "squeeze" and r0 and r0.kind == "bmm" and arg(n, 1, "dim") in (r0.info[3], 2 if r0.info[3] == -1 else 1):
            rows, (w3, flat), layout, _ = r0.info
            if g.flat is None:
                g.flat, g.ids = flat, self.r(flat).info
            elif g.flat is not flat:
                g.problem = g.problem or "the batched experts gather weights by different ids"
                return
            ids_v = val(g.ids)
            if ids_v.shape[-1] != g.k:
                g.problem = g.problem or f"repeat_interleave({g.k}) but the router has top_k {ids_v.shape[-1]}"
            self._linear(g, n, rows, w3, layout)
            return
        if op in ("add_", "add", "iadd", "add_inplace") and r0 and r0.kind == "rows" and len(rows_in) == 1:
            rb = self.r(n.args[1])
            if rb and rb.kind == "bias":
                ok_group = rb.g is g if rb.g is not None else (rb.info[1] == "pair" and rb.info[2] is g.flat)
                first_user = min(a0.users, key=self.order.__getitem__) is n
                if ok_group and (first_user if op != "add" else len(a0.users) == 1) \
                        and self._add_bias(g, a0, rb.info if rb.g is not None else rb.info[0], n):
                    if op != "add":
                        g.erase.append(n)
                    return
                g.problem = g.problem or f"per-expert bias add `{n.name}` that is not right after a linear"
                return
        if op == "mul" and len(rows_in) == 1:
            other = n.args[1] if n.args[0] is rows_in[0] else n.args[0]
            ro = self.r(other)
            w = self._row_weights(g, other, ro)
            if w is not None:
                if ro is None or ro.kind != "routing":
                    self._set(other, "wview", g)
                if g.weighted_at is not None:
                    g.problem = g.problem or "the rows are multiplied by routing weights twice"
                g.weights, g.weighted_at = w, g.step_of[rows_in[0]]
                g.step_of[n] = g.step_of[rows_in[0]]
                self._set(n, "rows", g)
                return
            if ro is not None and ro.kind == "routing":
                g.problem = g.problem or "the routing matrix is not multiplied as [E, T, 1]"
                return
            if g.family == "dense" and isinstance(other, fx.Node) and not _shared_ok(other):
                g.problem = g.problem or (f"the dense expert outputs are combined by `{other.name}`, which is not a "
                                          "sparse top-k routing matrix (zeros(T, E).scatter(1, ids, w)); every expert "
                                          "contributes to every token (soft MoE), so routed compute would change it")
                return
        if op in CASTS and g.weighted_at is not None and r0 and r0.kind == "rows":
            g.step_of[n] = g.step_of[a0]
            self._set(n, "rows", g)
            return
        if r0 and r0.kind == "rows" and g.family != "dense" and self._unsort(g, n, op):
            return
        if g.family == "dense" and op == "sum" and r0 and r0.kind == "rows" and arg(n, 1, "dim") in (0, (0,)):
            if g.weighted_at is None:
                g.problem = g.problem or ("the dense experts are summed without a routing matrix: every token uses "
                                          "every expert (not a sparse MoE)")
                return
            g.output, g.end = n, g.step_of[a0]
            self._set(n, "out", g)
            return
        # generic row-wise ops (the expert template)
        if op in ROWWISE_UNARY and r0 and r0.kind == "rows" and all(_shared_ok(a) for a in n.all_input_nodes[1:]):
            self._step(g, n)
            return
        if op in ROWWISE_BINARY and all(_shared_ok(a) for a in n.all_input_nodes if a not in rows_in):
            self._step(g, n)
            return
        if op in ("chunk", "split") and r0 and r0.kind == "rows" and _is_last(arg(n, 2, "dim", 0), a0):
            self._step(g, n, kind="chunks")
            return
        if op == "getitem" and r0 and r0.kind == "chunks" and _int(n.args[1]) is not None:
            self._step(g, n)
            return
        if op == "getitem" and r0 and r0.kind == "rows" and isinstance(n.args[1], tuple) and len(n.args[1]) == 2 \
                and n.args[1][0] is Ellipsis and isinstance(n.args[1][1], slice):
            self._step(g, n)
            return

    # ------------------------------------------------------------------ results
    def _finish(self, g: _Group):
        if not g.linears:
            return []  # a sort or expand that never fed an expert linear: not an MoE region
        anchor = g.output or g.key
        module = common_module([m for m in g.nodes if m.op != "placeholder"]) or module_path(anchor)
        where = where_in_user_code(g.output or next(m for m in g.nodes if g.step_of.get(m, -2) >= 0))
        form = f"{g.family}/{'index_add' if g.aliases else 'gather-sum'}"
        why = self._refusal(g)
        if why:
            return [Refused(module, form, where, why)]
        # every row-valued node must be consumed inside the region
        for m in g.nodes:
            if m is g.output or m in g.aliases:
                continue
            ro = self.r(m)
            if ro.kind in ("rows", "chunks", "pair", "pair3", "unsq", "bmm", "inv", "inv_alloc", "sw"):
                outside = [u for u in m.users if u not in g.nodes]
                if outside:
                    return [Refused(module, form, where, f"the region's intermediate `{m.name}` is also used "
                                    f"outside it (by `{outside[0].name}`)")]
        steps = list(g.steps[:g.end + 1])
        erase = tuple(sorted(set(g.erase) | {g.output}, key=self.order.__getitem__))
        return [MoERegion(
            module=module, form=form, where=where, x=g.x, ids=g.ids, top_k=g.k, num_experts=g.e,
            weights=g.weights, template=Template(tuple(steps), tuple(g.slots)), acc=g.output,
            acc_dtype=val(g.output).dtype, base=None, aliases=tuple(g.aliases), mutations=(), readers=(),
            expert_nodes=tuple(sorted(g.nodes, key=self.order.__getitem__)), output=g.output, erase=erase)]

    def _refusal(self, g: _Group) -> str:
        if g.problem:
            return g.problem
        if g.output is None:
            return "the expert rows are never combined back per token (no sum over top-k, index_add_ or scatter_add_)"
        if g.ids is None or g.k is None or g.e is None or g.x is None:
            return "could not find the router's ids, top_k or expert count"
        if g.end is None or (g.weighted_at is not None and g.weighted_at != g.end):
            return "routing weights are applied before the expert's last op"
        if shape(g.x)[0] * g.k != (val(g.ids).numel()):
            return f"{shape(g.x)[0]} tokens x top_k {g.k} != {val(g.ids).numel()} routed ids"
        return ""


def find_grouped_regions(gm: fx.GraphModule) -> list[MoERegion | Refused]:
    """Sorted/grouped, batched and dense MoE regions of a Dynamo graph (see the module docstring)."""
    return _Finder(gm).run()

