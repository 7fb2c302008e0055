"""Forward dataflow analysis: which Dynamo nodes play which MoE role (finds; never mutates).

One walk over the graph in order. Each node gets a role (``roles.py``) computed from its op
(normalised by ``normalize.canon``) and the roles of its inputs, so the same facts come out of
every spelling of a per-expert loop::

    ids = topk(logits, K)[1]                      -> Ids
    ids == e  |  one_hot(ids, E).permute(..)[e]   -> Sel(e)
    where(Sel) / nonzero(Sel, as_tuple=True)[i]   -> Index(e, tok | slot | pair)
    Sel.any(-1)                                   -> TokMask(e)
    x[Index] | x[TokMask] | x.index_select(0, ..) -> Rows(e)
    linear / matmul / silu / mul / chunk ... Rows -> RowFn(e)      (the expert template)
    w[tok, slot] | (w * Sel).sum(-1)[mask]        -> RowW(e)
    RowFn * RowW                                  -> Contrib(e)
    acc.index_add_(0, tok, Contrib) | acc[tok] += Contrib | acc.scatter_add_(..) | acc[mask] = ..
                                                  -> Storage.contribs[e]

A value that mixes roles in an unsupported way gets no role, and the storage it would have fed
records the reason (``Storage.problem``), so a refused region always says why.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .normalize import arg, canon, shape, val, where_in_user_code
from .roles import (AccRead, AccSum, Contrib, Ids, Index, OneHot, RowFn, Rows, RowW, ScatterIndex, Sel, Storage,
                    TokMask, Weighted, WhereOf)

# ops that map each row to a row (the expert template may contain only these and linears)
ROWWISE_UNARY = {"silu", "gelu", "relu", "sigmoid", "tanh", "exp", "neg", "erf", "softplus", "square", "sqrt",
                 "rsqrt", "abs", "clamp", "clamp_min", "clamp_max", "to", "float", "bfloat16", "half", "double",
                 "contiguous", "type", "dropout", "relu6", "leaky_relu", "elu", "selu", "mish", "hardswish",
                 "hardsigmoid", "gelu_tanh", "identity", "glu", "log_sigmoid", "logsigmoid"}
ROWWISE_BINARY = {"mul", "add", "sub", "div", "pow", "minimum", "maximum", "iadd"}
SPLITS = {"chunk", "split", "tensor_split"}
LINEAR_OPS = {"linear", "matmul", "mm"}
RESHAPES = {"view", "reshape", "unsqueeze", "to", "float", "contiguous", "long", "int", "type", "flatten"}
FRESH_ZEROS = {"zeros_like", "zeros", "new_zeros"}
BASE_OPS = {"clone", "linear", "add", "mul", "matmul", "sub", "empty_like_zero"}
COMBINE_INPLACE = {"index_add_", "scatter_add_", "index_put_"}
SIZE_QUERIES = {"sym_size", "size", "dim", "sym_numel", "numel", "sym_stride"}


def _const_int(x):
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _is_last_dim(dim, n) -> bool:
    d = val(n)
    nd = d.dim() if isinstance(d, torch.Tensor) else None
    return dim == -1 or (nd is not None and dim == nd - 1)


class Analysis:
    """Roles of nodes and the accumulators found in one graph."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.role: dict[fx.Node, object] = {}
        self.storage_of: dict[fx.Node, Storage] = {}
        self.storages: list[Storage] = []
        self.linears: dict[fx.Node, tuple] = {}   # template linear node -> (weight node, bias node, layout)
        self.pattern: set[fx.Node] = set()        # nodes consumed by a recognised combine pattern
        self.problems: dict[int, list[str]] = {}  # expert e -> unsupported ops that touched its rows
        self.bias_adds: dict[fx.Node, tuple] = {}  # linear(rows) + b_e -> (the linear, b_e)
        self.refused_writes: dict[Storage, fx.Node] = {}  # an expert's output written in a refused way

    # ------------------------------------------------------------------ helpers
    def r(self, x):
        return self.role.get(x) if isinstance(x, fx.Node) else None

    def _problem(self, e: int, node: fx.Node, what: str):
        self.problems.setdefault(e, []).append(f"{what} ({node.name} at {where_in_user_code(node) or '?'})")

    def _storage(self, node: fx.Node) -> Storage | None:
        """The accumulator behind ``node``, creating one for a fresh allocation."""
        if node in self.storage_of:
            return self.storage_of[node]
        op = canon(node)
        if op in FRESH_ZEROS:
            base = None
        elif op in BASE_OPS and self.r(node) is None:
            base = node
        else:
            return None
        s = Storage(alloc=node, base=base)
        s.aliases.add(node)
        self.storage_of[node] = s
        self.storages.append(s)
        return s

    # ------------------------------------------------------------------ walk
    def run(self) -> "Analysis":
        for node in self.gm.graph.nodes:
            if node.op in ("call_function", "call_method"):
                try:
                    role = self.visit(node, canon(node))
                except Exception as exc:  # analysis must never crash the compile
                    role = None
                    self._note_unhandled(node, f"analysis error {type(exc).__name__}: {exc}")
                if role is not None:
                    self.role[node] = role
                    continue
            self._note_reads(node)
        return self

    def _note_unhandled(self, node, why):
        for a in node.all_input_nodes:
            ra = self.r(a)
            e = getattr(ra, "e", None) if not isinstance(ra, (RowFn, Contrib)) else \
                (ra.rows.e if isinstance(ra, RowFn) else ra.rows.e)
            if e is not None:
                self._problem(e, node, why)

    def _note_reads(self, node: fx.Node):
        """Record reads of accumulators and ops that consumed row values unsupportedly."""
        if node in self.pattern:
            return
        if canon(node) in SIZE_QUERIES:
            return  # Dynamo's size checks (e.g. for `out[mask] = v`) read metadata, not values
        for a in node.all_input_nodes:
            s = self.storage_of.get(a)
            if s is not None and node not in s.mutations:
                s.readers.append((node, s.version))
            ra = self.r(a)
            if isinstance(ra, (RowFn, Rows, Contrib, RowW)) and node.op != "output":
                e = ra.rows.e if isinstance(ra, (RowFn, Contrib)) else ra.e
                self._problem(e, node, f"unsupported op `{canon(node) or node.op}` on the expert's rows")

    # ------------------------------------------------------------------ transfer functions
    def visit(self, n: fx.Node, op: str):  # noqa: C901  (one dispatch table, read top to bottom)
        a0 = n.args[0] if n.args else None
        r0 = self.r(a0)

        # -- router outputs -------------------------------------------------------------
        if op == "getitem" and isinstance(a0, fx.Node) and canon(a0) in ("topk", "max") and n.args[1] == 1:
            s = shape(n)
            if s is not None and len(s) >= 1:
                return Ids(n, s[-1] if len(s) == 2 else 1, flat=len(s) == 1)
        if op == "getattr" and isinstance(a0, fx.Node) and canon(a0) == "topk" and n.args[1] == "indices":
            s = shape(n)
            return Ids(n, s[-1]) if s and len(s) == 2 else None
        if op == "argmax":
            s = shape(n)
            if s is not None and len(s) in (1, 2) and (len(s) == 1 or s[-1] == 1):
                return Ids(n, 1, flat=len(s) == 1)

        if isinstance(r0, Ids):
            if op in ("view", "reshape", "flatten"):
                s = shape(n)
                return Ids(r0.root, r0.k, flat=len(s) == 1) if s else None
            if op in ("to", "long", "int"):
                return r0
            if op == "eq" and _const_int(n.args[1]) is not None:
                return Sel(r0, n.args[1], "n" if r0.flat or r0.k == 1 and len(shape(n)) == 1 else "tk")
            if op == "one_hot":
                return OneHot(r0, "ne" if r0.flat else "tke")
        if op == "eq" and isinstance(self.r(n.args[1]), Ids) and _const_int(a0) is not None:
            ids = self.r(n.args[1])
            return Sel(ids, a0, "n" if ids.flat else "tk")

        if isinstance(r0, OneHot):
            if op == "permute":
                dims = n.args[1:] if not isinstance(n.args[1], (tuple, list)) else n.args[1]
                return OneHot(r0.ids, "".join(r0.axes[d] for d in dims))
            if op == "getitem" and r0.axes[0] == "e" and _const_int(n.args[1]) is not None:
                return Sel(r0.ids, n.args[1], r0.axes[1:])
            if op == "getitem" and isinstance(n.args[1], tuple) and r0.axes[-1] == "e":
                idx = n.args[1]
                if _const_int(idx[-1]) is not None and all(i is Ellipsis or i == slice(None) for i in idx[:-1]):
                    return Sel(r0.ids, idx[-1], r0.axes[:-1])

        # -- selection -> indices / masks ---------------------------------------------------
        if isinstance(r0, Sel):
            if op in ("to", "float", "int", "long", "bool"):
                return r0
            if (op == "where" and len(n.args) == 1) or (op == "nonzero" and n.kwargs.get("as_tuple")):
                return WhereOf(r0, n)
            if op == "any":
                dim = arg(n, 1, "dim")
                tok_axis = r0.layout.index("t") if "t" in r0.layout else None
                if tok_axis is not None and len(r0.layout) == 2 and dim is not None:
                    if (dim % 2) != tok_axis:
                        return TokMask(r0.ids, r0.e)
            if op == "mul":
                other = n.args[1]
                if isinstance(other, fx.Node) and self.r(other) is None and r0.layout == "tk":
                    return Weighted(other, r0.ids, r0.e, False)
        if op == "mul" and isinstance(self.r(n.args[1]), Sel) and isinstance(a0, fx.Node) and r0 is None:
            sel = self.r(n.args[1])
            if sel.layout == "tk":
                return Weighted(a0, sel.ids, sel.e, False)
        if op == "where" and len(n.args) == 3 and isinstance(r0, Sel) and r0.layout == "tk" and n.args[2] == 0:
            return Weighted(n.args[1], r0.ids, r0.e, False)
        if isinstance(r0, Weighted):
            if op == "sum" and not r0.reduced and _is_last_dim(arg(n, 1, "dim"), a0) \
                    and not n.kwargs.get("keepdim"):
                return Weighted(r0.w, r0.ids, r0.e, True)
            if op in ("to", "float"):
                return r0
            if op == "getitem" and r0.reduced:
                idx = n.args[1]
                if isinstance(idx, tuple) and len(idx) == 2 and idx[1] is None:
                    idx = idx[0]  # we[mask, None]: the trailing None is an unsqueeze, RowW-neutral
                ri = self.r(idx)
                if isinstance(ri, TokMask) and ri.e == r0.e:
                    return RowW(r0.w, r0.ids, r0.e, ("tok", r0.e))
                if isinstance(ri, Index) and ri.kind == "tok" and ri.e == r0.e:
                    return RowW(r0.w, r0.ids, r0.e, ri.enum)

        if isinstance(r0, WhereOf) and op == "getitem" and _const_int(n.args[1]) is not None:
            sel, i = r0.sel, n.args[1]
            if sel.layout == "n":
                return Index(sel.ids, sel.e, ("tok", sel.e), "pair") if i == 0 else None
            axis = sel.layout[i]
            enum = ("tok", sel.e) if sel.layout == "tk" else ("where", r0.node)
            return Index(sel.ids, sel.e, enum, "tok" if axis == "t" else "slot")
        if isinstance(r0, Index):
            if op == "floordiv" and r0.kind == "pair" and n.args[1] == r0.ids.k:
                return Index(r0.ids, r0.e, r0.enum, "tok")
            if op == "mod" and r0.kind == "pair" and n.args[1] == r0.ids.k:
                return Index(r0.ids, r0.e, r0.enum, "slot")
            if op in ("to", "long", "int", "view", "reshape", "flatten") and len(shape(n) or ()) == 1:
                return r0
            if op == "unsqueeze" and r0.kind == "tok":
                return ("scatter_pending", r0)
            if op in ("expand", "expand_as", "repeat") and r0.kind == "tok" and len(shape(n) or ()) == 2:
                return ScatterIndex(r0.ids, r0.e, r0.enum)
        if isinstance(r0, tuple) and r0[0] == "scatter_pending" and op in ("expand", "expand_as", "repeat"):
            idx = r0[1]
            return ScatterIndex(idx.ids, idx.e, idx.enum)
        if isinstance(r0, TokMask) and op in ("to", "bool"):
            return r0

        # -- gathers: expert rows and their routing weights --------------------------------
        if op == "getitem" and isinstance(a0, fx.Node) and r0 is None and self._is_acc_read(n):
            s = self._storage(a0)
            if s is not None:
                self.pattern.add(n)
                return AccRead(s, n.args[1], s.version)
        if op == "getitem" and isinstance(a0, fx.Node) and r0 is None:
            return self._gather(n, a0, n.args[1])
        if op == "index_select" and r0 is None and arg(n, 1, "dim") == 0:
            ri = self.r(arg(n, 2, "index"))
            if isinstance(ri, Index) and ri.kind == "tok":
                return Rows(a0, ri.ids, ri.e, ri.enum)

        if isinstance(r0, RowW) and op in ("unsqueeze", "view", "reshape", "to", "float", "type_as", "getitem"):
            if op != "getitem" or n.args[1] in ((slice(None), None), (Ellipsis, None)):
                return r0
        if isinstance(r0, Rows) and op in ("reshape", "view") and len(shape(n) or ()) == 2:
            return Rows(r0.x, r0.ids, r0.e, r0.enum)

        # -- accumulators -----------------------------------------------------------------
        if op in COMBINE_INPLACE or op in ("index_add", "setitem"):
            return self._combine(n, op)
        if op in ("add", "iadd"):
            rs = [self.r(x) for x in n.args[:2]]
            reads = [x for x in rs if isinstance(x, AccRead)]
            if len(reads) == 1:
                other = rs[1] if rs[0] is reads[0] else rs[0]
                c = self._as_contrib(n.args[1] if rs[0] is reads[0] else n.args[0], other)
                if c is not None:
                    return AccSum(reads[0], c)

        # -- the expert template ------------------------------------------------------------
        return self._rowwise(n, op)

    def _is_acc_read(self, n: fx.Node) -> bool:
        """getitem(acc, idx) whose sum with a contribution is written back: acc[idx] += c."""
        if not isinstance(self.r(n.args[1]), (Index, TokMask)):
            return False
        for add in n.users:
            if canon(add) in ("add", "iadd"):
                for st in add.users:
                    if canon(st) == "setitem" and st.args[0] is n.args[0] and st.args[1] is n.args[1] \
                            and st.args[2] is add:
                        return True
        return False

    def _gather(self, n, src, index):
        ri = self.r(index)
        src_dims = len(shape(src) or ())
        if isinstance(ri, Index) and (ri.kind == "tok" or (ri.kind == "pair" and ri.ids.k == 1)):
            if src_dims == 1:
                return RowW(src, ri.ids, ri.e, ri.enum)  # top-1 weights w[tok]
            return Rows(src, ri.ids, ri.e, ri.enum)
        if isinstance(ri, Index) and ri.kind == "pair" and src_dims == 1:
            return RowW(src, ri.ids, ri.e, ri.enum)
        if isinstance(ri, TokMask):
            return Rows(src, ri.ids, ri.e, ("tok", ri.e))
        if isinstance(index, tuple):
            roles = [self.r(i) for i in index]
            if len(index) >= 2 and src_dims == 1 and isinstance(roles[0], Index) and all(i is None for i in index[1:]) \
                    and (roles[0].kind == "tok" or roles[0].ids.k == 1):
                return RowW(src, roles[0].ids, roles[0].e, roles[0].enum)  # top-1 weights w[tok, None]
            if len(index) >= 2 and isinstance(roles[0], Index) and isinstance(roles[1], Index) \
                    and roles[0].kind == "tok" and roles[1].kind == "slot" and roles[0].enum == roles[1].enum \
                    and all(i is None for i in index[2:]):
                return RowW(src, roles[0].ids, roles[0].e, roles[0].enum)
            if len(index) == 2 and index[0] is None and isinstance(roles[1], Index) and roles[1].kind == "tok":
                return Rows(src, roles[1].ids, roles[1].e, roles[1].enum)  # x[None, tok] (reshaped later)
        return None

    def _as_contrib(self, node, role) -> Contrib | None:
        if isinstance(role, Contrib):
            return role
        if isinstance(role, RowFn):
            return Contrib(role.rows, node, None)
        return None

    def _rowwise(self, n: fx.Node, op: str):
        in_roles = [(x, self.r(x)) for x in n.all_input_nodes]
        rows = [r for _, r in in_roles if isinstance(r, (Rows, RowFn))]
        roww = [r for _, r in in_roles if isinstance(r, RowW)]
        contrib = [r for _, r in in_roles if isinstance(r, Contrib)]
        if contrib:
            c = contrib[0]
            if op in ("to", "float", "bfloat16", "half", "type_as") and len(contrib) == 1:
                return c
            return None
        if not rows:
            return None
        base = rows[0].rows if isinstance(rows[0], RowFn) else rows[0]
        if any((r.rows if isinstance(r, RowFn) else r) != base for r in rows):
            return None  # two experts' rows mixed: not a per-expert template
        if roww:
            w = roww[0]
            if op == "mul" and len(roww) == 1 and len(rows) == 1 and w.e == base.e and w.enum == base.enum:
                fn_node = next(x for x, r in in_roles if isinstance(r, (Rows, RowFn)))
                return Contrib(base, fn_node, w.w)
            return None
        if op in LINEAR_OPS:
            if not isinstance(self.r(n.args[0]), (Rows, RowFn)):
                return None
            weight = n.args[1]
            bias = arg(n, 2, "bias") if op == "linear" else None
            if not isinstance(weight, fx.Node) or self.r(weight) is not None or len(shape(weight) or ()) != 2:
                return None
            self.linears[n] = (weight, bias, "nk" if op == "linear" else "kn")
            return RowFn(base)
        others = [x for x, r in in_roles if not isinstance(r, (Rows, RowFn))]
        if any(len(shape(x) or ()) > 1 for x in others):
            return None  # a non-row tensor with a row dimension would not broadcast row-wise
        lin = next((x for x in n.args[:2] if isinstance(x, fx.Node) and x in self.linears), None)
        if op in ("add", "iadd") and len(rows) == 1 and len(others) == 1 and lin is not None \
                and others[0] in n.args[:2] and self.linears[lin][1] is None and len(lin.users) == 1 \
                and shape(others[0]) == shape(n)[-1:]:
            self.bias_adds[n] = (lin, others[0])  # x @ W[e] + b[e]: folded into the linear by the region builder
        if op in ROWWISE_UNARY or op in ROWWISE_BINARY:
            if op == "glu" and not _is_last_dim(arg(n, 1, "dim", -1), n.args[0]):
                return None
            return RowFn(base)
        if op in SPLITS and _is_last_dim(arg(n, 2, "dim", 0), n.args[0]):
            return RowFn(base)
        if op == "getitem":
            idx = n.args[1]
            if canon(n.args[0]) in SPLITS and _const_int(idx) is not None:
                return RowFn(base)
            if isinstance(idx, tuple) and len(idx) == 2 and (idx[0] is Ellipsis or idx[0] == slice(None)) \
                    and isinstance(idx[1], slice):
                return RowFn(base)
        if op == "cat" and _is_last_dim(arg(n, 1, "dim", 0), n.args[0][0]):
            return RowFn(base)
        return None

    def _combine(self, n: fx.Node, op: str):
        acc = n.args[0]
        if not isinstance(acc, fx.Node):
            return None
        s = self._storage(acc)
        if s is None:
            return None
        if op in ("index_add_", "index_add"):
            dim, index, src = arg(n, 1, "dim"), arg(n, 2, "index"), arg(n, 3, "source")
            ri, rs = self.r(index), self.r(src)
            c = self._as_contrib(src, rs)
            if dim != 0 or n.kwargs.get("alpha", 1) != 1 or not isinstance(ri, Index) or ri.kind != "tok" \
                    or c is None or c.rows.e != ri.e or c.rows.enum != ri.enum:
                s.problem = s.problem or f"unsupported index_add_ at {where_in_user_code(n)}"
                if c is not None:
                    self.refused_writes.setdefault(s, n)
                return None
            return self._add(s, n, c, inplace=op == "index_add_")
        if op == "scatter_add_":
            dim, index, src = arg(n, 1, "dim"), arg(n, 2, "index"), arg(n, 3, "src")
            ri, c = self.r(index), self._as_contrib(src, self.r(src))
            if dim != 0 or not isinstance(ri, ScatterIndex) or c is None or c.rows.e != ri.e \
                    or c.rows.enum != ri.enum:
                s.problem = s.problem or f"unsupported scatter_add_ at {where_in_user_code(n)}"
                if c is not None:
                    self.refused_writes.setdefault(s, n)
                return None
            return self._add(s, n, c, inplace=True)
        if op == "index_put_":
            indices, values = arg(n, 1, "indices"), arg(n, 2, "values")
            accumulate = arg(n, 3, "accumulate", False)
            ri, c = self.r(indices[0]) if len(indices) == 1 else None, self._as_contrib(values, self.r(values))
            if not accumulate or not isinstance(ri, (Index, TokMask)) or c is None:
                s.problem = s.problem or f"unsupported index_put_ at {where_in_user_code(n)}"
                if c is not None:
                    self.refused_writes.setdefault(s, n)
                return None
            return self._add(s, n, c, inplace=True)
        # setitem(acc, index, value)
        index, value = n.args[1], n.args[2]
        ri, rv = self.r(index), self.r(value)
        if isinstance(rv, AccSum) and rv.read.storage is s and rv.read.index is index \
                and rv.read.version == s.version:
            self.pattern.add(value)
            return self._add(s, n, rv.contrib, inplace=True)
        c = self._as_contrib(value, rv)
        if c is not None and isinstance(ri, (Index, TokMask)) and ri.ids.k == 1 and s.base is None:
            return self._add(s, n, c, inplace=True)  # top-1: each token written by one expert only
        if c is not None:
            s.problem = s.problem or (f"`out[idx] = expert(...)` overwrites instead of adding (top-k > 1) "
                                      f"at {where_in_user_code(n)}")
            self.refused_writes.setdefault(s, n)
        return None

    def _add(self, s: Storage, n: fx.Node, c: Contrib, inplace: bool):
        e = c.rows.e
        if e in s.contribs:
            s.problem = s.problem or f"expert {e} is added twice into {s.alloc.name}"
            return None
        if not inplace:  # functional index_add: a new tensor carrying the old contributions
            new = Storage(alloc=s.alloc, base=s.base, contribs=dict(s.contribs), mutations=list(s.mutations),
                          version=s.version)
            s.forked = True
            self.storages.append(new)
            s = new
        s.contribs[e] = c
        s.mutations.append(n)
        s.version += 1
        s.aliases.add(n)
        self.storage_of[n] = s
        self.pattern.add(n)
        return ("acc", s)


def analyze(gm: fx.GraphModule) -> Analysis:
    return Analysis(gm).run()


__all__ = ["Analysis", "analyze"]
