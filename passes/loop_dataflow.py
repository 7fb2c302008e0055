"""Forward dataflow over a Dynamo graph: which nodes play which per-expert-loop role (finds; never mutates).

One walk over the graph in order. Each node gets a role (``loop_roles.py``) from its op (normalised
by ``normalize.canon``) and the roles of its inputs, through the rule table ``RULES`` (op -> rules
tried in order; each rule names the role its first argument must have, or None for any), so the
same facts come out of every spelling of a per-expert loop::

    ids = topk(logits, K)[1]                      -> Ids
    ids == e  |  one_hot(ids, E).permute(..)[e]   -> Sel(e)
    where(Sel) / nonzero(Sel, as_tuple=True)[i]   -> Index(e, tok | slot | pair)
    Sel.any(-1)                                   -> TokMask(e)
    x[Index] | x[TokMask] | x.index_select(0, ..) -> Rows(e)
    linear / matmul / silu / mul / chunk ... Rows -> RowFn(e)      (the expert function; ``rowwise``)
    w[tok, slot] | (w * Sel).sum(-1)[mask]        -> RowW(e)
    RowFn * RowW                                  -> Contrib(e)
    acc.index_add_(0, tok, Contrib) | acc[tok] += Contrib | acc.scatter_add_(..) | acc[mask] = ..
                                                  -> Storage.contribs[e]

A value that mixes roles in an unsupported way gets no role, and what it would have fed records a
``region.Finding`` (on the Storage, or per expert in ``row_findings``), so a refusal always says
why. A new op is one entry in ``RULES`` (or in the ``ROWWISE_*`` tables for element-wise ops).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from .loop_combine import acc_read, acc_sum, combine, expert_rows
from .loop_ids import ids_cast, ids_of_argmax, ids_of_sort, ids_of_topk, ids_of_topk_attr, ids_reshape, ids_slice
from .loop_roles import (STOP, Contrib, Ids, Index, OneHot, PendingScatter, RowFn, Rows, RowW, ScatterIndex, Sel,
                         Storage, TokMask, Weighted, WhereOf, expert_key)
from .checkpoint_bodies import HOPS as CHECKPOINT_HOPS
from .grouped_state import as_int
from .normalize import (COLUMN_INDEXES, SIZE_QUERIES, arg, canon, module_path, same_shape, shape, val,
                        where_in_user_code)
from .region import Finding

# element-wise ops the expert function may contain (with linears, splits and last-dim slices)
ROWWISE_UNARY = {"silu", "gelu", "relu", "sigmoid", "tanh", "exp", "neg", "erf", "softplus", "square", "sqrt",
                 "rsqrt", "abs", "clamp", "clamp_min", "clamp_max", "to", "float", "bfloat16", "half", "double",
                 "contiguous", "type", "dropout", "relu6", "leaky_relu", "elu", "selu", "mish", "hardswish",
                 "hardsigmoid", "gelu_tanh", "identity", "glu", "log_sigmoid", "logsigmoid"}
# Dynamo's spelling of a custom torch.autograd.Function's apply in the graph
AUTOGRAD_FUNCTION_OPS = {"trampoline_autograd_apply", "autograd_function_apply"}
_DTENSOR_OPS = {"from_local", "to_local", "redistribute", "full_tensor"}   # tensor parallel's hooks on an expert
ROWWISE_BINARY = {"mul", "add", "sub", "div", "pow", "minimum", "maximum", "iadd"}
SPLITS = {"chunk", "split", "tensor_split"}
LINEAR_OPS = {"linear", "matmul", "mm"}
FRESH_ZEROS = {"zeros_like", "zeros", "new_zeros"}
BASE_OPS = {"clone", "linear", "add", "mul", "matmul", "sub", "empty_like_zero"}


def _column(w_node: fx.Node, rows: fx.Node) -> bool:
    """The weights multiply whole rows: [n, 1] against the rows [n, H]. Weights [n] against [n, H] rows
    broadcast over the columns in eager (it runs where n == H: column j times w[tok[j]]; review helper-106)."""
    ws, rs = shape(w_node), shape(rows)
    return ws is not None and rs is not None and len(ws) == len(rs) >= 1 and same_shape(ws[1:], (1,) * (len(ws) - 1))


def _is_last_dim(dim, n) -> bool:
    d = val(n)
    nd = d.dim() if isinstance(d, torch.Tensor) else None
    return dim == -1 or (nd is not None and dim == nd - 1)


# an op on an expert's output after its routing weight was applied, other than the write-back
_AFTER_WEIGHT = (", on the expert output after the routing weight multiply: only the write-back into the output may "
                 "follow it (apply the op to the expert output before multiplying by the weight)")


class Analysis:
    """Roles of nodes and the accumulators found in one graph."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.role: dict[fx.Node, object] = {}
        self.storage_of: dict[fx.Node, Storage] = {}
        self.storages: list[Storage] = []
        self.linears: dict[fx.Node, tuple] = {}   # expert-function linear -> (weight node, bias node, layout)
        self.pattern: set[fx.Node] = set()        # nodes consumed by a recognised combine pattern
        self.row_findings: dict[tuple, list[Finding]] = {}  # expert_key -> unsupported ops on its rows
        self.bias_adds: dict[fx.Node, tuple] = {}  # linear(rows) + b_e -> (the linear, b_e)
        self.refused_writes: dict[Storage, tuple] = {}  # (write, Contrib): an expert's output written in a refused way

    def r(self, x):
        return self.role.get(x) if isinstance(x, fx.Node) else None

    def storage(self, node: fx.Node) -> Storage | None:
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
                except Exception as exc:  # an unexpected spelling: no role, noted (never a crash of the compile)
                    if isinstance(exc, (NameError, ImportError)):   # a bug of these rules, never a spelling:
                        raise                                       # the finder fails, loudly (matcher_error)
                    role = None
                    self._note_unhandled(node, f" (analysis error {type(exc).__name__}: {exc})")
                if role is not None:
                    self.role[node] = role
                    continue
            self._note_reads(node)
        return self

    def visit(self, n: fx.Node, op: str):
        r0 = self.r(n.args[0]) if n.args else None
        for kind, rule in RULES.get(op, ()):
            if kind is None or isinstance(r0, kind):
                role = rule(self, n, op, r0)
                if role is STOP:
                    return None
                if role is not None:
                    return role
        return rowwise(self, n, op, r0)

    def _row_finding(self, key: tuple, node: fx.Node, why: str = ""):
        op = canon(node) or node.op
        code = "expert_checkpointed" if op in CHECKPOINT_HOPS else "unsupported_row_op"
        if op in AUTOGRAD_FUNCTION_OPS and not why:
            why = (" (a custom torch.autograd.Function, e.g. torchao's float8 training Linear: its backward is its "
                   "own, which the fused ops would replace)")
        if op.removeprefix("prim ") in _DTENSOR_OPS and not why:   # the line is torch's (tensor parallel's hooks;
            # torch 2.11 names them `prim from_local`): review helper-118
            why = (f" (a DTensor op: the expert's module `{module_path(node) or '?'}` is tensor-parallel, "
                   "parallelize_module's plan covers it; tensor-parallel experts are not rewritten: leave the experts "
                   "out of the plan; to spread experts over ranks, moe_compile.stack_experts then "
                   "moe_compile.parallelize_experts)")
        self.row_findings.setdefault(key, []).append(
            Finding.of(code, node, op=op, at=where_in_user_code(node) or "?", why=why))

    def _note_unhandled(self, node, why):
        for a in node.all_input_nodes:
            key = expert_key(self.r(a))
            if key is not None:
                self._row_finding(key, node, why)

    def _note_reads(self, node: fx.Node):
        """Record reads of accumulators and ops that consumed row values unsupportedly."""
        if node in self.pattern or canon(node) in SIZE_QUERIES:
            return  # Dynamo's size checks (e.g. for `out[mask] = v`) read metadata, not values
        for a in node.all_input_nodes:
            s = self.storage_of.get(a)
            if s is not None and node not in s.mutations:
                s.readers.append((node, s.version))
            ra = self.r(a)
            if isinstance(ra, (RowFn, Rows, Contrib, RowW)) and node.op != "output":
                self._row_finding(expert_key(ra), node, _AFTER_WEIGHT if isinstance(ra, Contrib) else "")

    def refuse_write(self, s: Storage, n: fx.Node, code: str, contrib, **detail):
        s.findings.append(Finding.of(code, n, at=where_in_user_code(n), **detail))
        if contrib is not None:
            self.refused_writes.setdefault(s, (n, contrib))
        return STOP


# ===================================================================================== the rules
# Each rule: (analysis, node, canonical op, role of the first argument) -> role | None (try the
# next rule) | STOP (no role).

def sel_of_eq(a, n, op, r0):
    """ids == e."""
    if as_int(n.args[1]) is not None and len(shape(n) or ()) <= 2:   # [B, S, K] ids: flattened first
        return Sel(r0, n.args[1], "n" if r0.flat or r0.k == 1 and len(shape(n)) == 1 else "tk")


def sel_of_eq_reversed(a, n, op, r0):
    """e == ids."""
    ids = a.r(n.args[1])
    if isinstance(ids, Ids) and as_int(n.args[0]) is not None and len(shape(n) or ()) <= 2:
        return Sel(ids, n.args[0], "n" if ids.flat else "tk")


def onehot_of_ids(a, n, op, r0):
    if len(shape(n) or ()) <= 3:   # one_hot of [T, K] (or [N]) ids
        return OneHot(r0, "ne" if r0.flat else "tke")


def onehot_permute(a, n, op, r0):
    dims = n.args[1:] if not isinstance(n.args[1], (tuple, list)) else n.args[1]
    return OneHot(r0.ids, "".join(r0.axes[d] for d in dims))


def sel_of_onehot(a, n, op, r0):
    """one_hot(...)[e] (experts first) or one_hot(...)[..., e] (experts last)."""
    idx = n.args[1]
    if r0.axes[0] == "e" and as_int(idx) is not None:
        return Sel(r0.ids, idx, r0.axes[1:])
    if isinstance(idx, tuple) and r0.axes[-1] == "e" and as_int(idx[-1]) is not None \
            and all(i is Ellipsis or i == slice(None) for i in idx[:-1]):
        return Sel(r0.ids, idx[-1], r0.axes[:-1])


def sel_keep(a, n, op, r0):
    return r0 if op in ("to", "float", "int", "long", "bool") else None


def where_of_sel(a, n, op, r0):
    """where(Sel) / nonzero(Sel, as_tuple=True)."""
    if (op == "where" and len(n.args) == 1) or (op == "nonzero" and n.kwargs.get("as_tuple")):
        return WhereOf(r0, n)


def tokmask_of_sel(a, n, op, r0):
    """Sel.any(dim=slot axis) -> the tokens that chose expert e."""
    dim = arg(n, 1, "dim")
    tok_axis = r0.layout.index("t") if "t" in r0.layout else None
    if tok_axis is not None and len(r0.layout) == 2 and dim is not None and (dim % 2) != tok_axis:
        return TokMask(r0.ids, r0.e)


def weighted_sel_times_w(a, n, op, r0):
    """Sel * w."""
    other = n.args[1]
    if isinstance(other, fx.Node) and a.r(other) is None and r0.layout == "tk":
        return Weighted(other, r0.ids, r0.e, False)


def weighted_w_times_sel(a, n, op, r0):
    """w * Sel."""
    sel, a0 = a.r(n.args[1]), n.args[0]
    if isinstance(sel, Sel) and isinstance(a0, fx.Node) and r0 is None and sel.layout == "tk":
        return Weighted(a0, sel.ids, sel.e, False)


def weighted_where(a, n, op, r0):
    """where(Sel, w, 0)."""
    if len(n.args) == 3 and r0.layout == "tk" and n.args[2] == 0:
        return Weighted(n.args[1], r0.ids, r0.e, False)


def weighted_sum(a, n, op, r0):
    """(w * Sel).sum(-1): the weight each token gives expert e, [T]."""
    if not r0.reduced and _is_last_dim(arg(n, 1, "dim"), n.args[0]) and not n.kwargs.get("keepdim"):
        return Weighted(r0.w, r0.ids, r0.e, True)


def weighted_cast(a, n, op, r0):
    return r0 if op in ("to", "float") else None


def roww_of_weighted(a, n, op, r0):
    """we[mask] / we[tok] (optionally [..., None]) -> the weight of each of expert e's rows."""
    if not r0.reduced:
        return None
    idx = n.args[1]
    if isinstance(idx, tuple) and len(idx) == 2 and idx[1] is None:
        idx = idx[0]  # we[mask, None]: the trailing None is an unsqueeze, RowW-neutral
    ri = a.r(idx)
    # the rows of the same router's choice: expert e's mask of other ids (a second router) would pair
    # w with rows it did not pick
    if isinstance(ri, TokMask) and ri.e == r0.e and ri.ids.root is r0.ids.root:
        return RowW(r0.w, r0.ids, r0.e, ("tok", r0.e))
    if isinstance(ri, Index) and ri.kind == "tok" and ri.e == r0.e and ri.ids.root is r0.ids.root:
        return RowW(r0.w, r0.ids, r0.e, ri.enum)


def index_of_where(a, n, op, r0):
    """where(Sel)[i]: token (or slot) indices of expert e's rows."""
    if as_int(n.args[1]) is None:
        return None
    sel, i = r0.sel, n.args[1]
    if sel.layout == "n":   # flat ids: pair indices t*K+j, which at top-1 are the tokens
        return Index(sel.ids, sel.e, ("tok", sel.e), "tok" if sel.ids.k == 1 else "pair") if i == 0 else STOP
    axis = sel.layout[i]
    enum = ("tok", sel.e) if sel.layout == "tk" else ("where", r0.node)
    return Index(sel.ids, sel.e, enum, "tok" if axis == "t" else "slot")


def index_divmod(a, n, op, r0):
    """pair // K -> token, pair % K -> slot."""
    if r0.kind == "pair" and n.args[1] == r0.ids.k:
        return Index(r0.ids, r0.e, r0.enum, "tok" if op == "floordiv" else "slot")


def index_keep(a, n, op, r0):
    return r0 if len(shape(n) or ()) == 1 else None


def index_unsqueeze(a, n, op, r0):
    return PendingScatter(r0) if r0.kind == "tok" else None


def index_unsqueeze_getitem(a, n, op, r0):
    """tok[:, None]: the unsqueeze spelled as an index."""
    if n.args[1] == (slice(None), None):
        return index_unsqueeze(a, n, op, r0)


def scatter_index(a, n, op, r0):
    """tok[:, None].expand(n, H) -> the scatter_add_ index of expert e's rows."""
    if isinstance(r0, PendingScatter):
        return ScatterIndex(r0.index.ids, r0.index.e, r0.index.enum)
    if r0.kind == "tok" and len(shape(n) or ()) == 2:
        return ScatterIndex(r0.ids, r0.e, r0.enum)


def tokmask_keep(a, n, op, r0):
    return r0 if op in ("to", "bool") else None


def gather(a, n, op, r0):
    """x[Index] / x[TokMask] -> Rows; w[tok, slot] / w[tok] / w[pair] -> RowW."""
    src, index = n.args[0], n.args[1]
    if not isinstance(src, fx.Node) or r0 is not None:
        return None
    ri = a.r(index)
    src_dims = len(shape(src) or ())
    if isinstance(ri, Index) and (ri.kind == "tok" or (ri.kind == "pair" and ri.ids.k == 1)):
        if src_dims == 1:
            return RowW(src, ri.ids, ri.e, ri.enum)  # top-1 weights w[tok]
        return expert_rows(a, n, src, ri.ids, ri.e, ri.enum)
    if isinstance(ri, Index) and ri.kind == "pair" and src_dims == 1:
        return RowW(src, ri.ids, ri.e, ri.enum)
    if isinstance(ri, TokMask):
        return expert_rows(a, n, src, ri.ids, ri.e, ("tok", ri.e))
    if isinstance(index, tuple):
        roles = [a.r(i) for i in index]
        if len(index) >= 2 and src_dims == 1 and isinstance(roles[0], Index) and all(i is None for i in index[1:]) \
                and (roles[0].kind == "tok" or roles[0].ids.k == 1):
            return RowW(src, roles[0].ids, roles[0].e, roles[0].enum)  # top-1 weights w[tok, None]
        if len(index) >= 2 and isinstance(roles[0], Index) and isinstance(roles[1], Index) \
                and roles[0].kind == "tok" and roles[1].kind == "slot" and roles[0].enum == roles[1].enum \
                and roles[0].ids.root is roles[1].ids.root and all(i is None for i in index[2:]):
            return RowW(src, roles[0].ids, roles[0].e, roles[0].enum)
        if len(index) == 2 and index[0] is None and isinstance(roles[1], Index) and roles[1].kind == "tok":
            return expert_rows(a, n, src, roles[1].ids, roles[1].e, roles[1].enum)  # x[None, tok] (reshaped later)
    return STOP


def rows_of_index_select(a, n, op, r0):
    if r0 is None and arg(n, 1, "dim") == 0:
        ri = a.r(arg(n, 2, "index"))
        if isinstance(ri, Index) and ri.kind == "tok":
            return expert_rows(a, n, n.args[0], ri.ids, ri.e, ri.enum)


def roww_keep(a, n, op, r0):
    if op != "getitem" or n.args[1] in COLUMN_INDEXES:
        return r0


def rows_reshape(a, n, op, r0):
    if len(shape(n) or ()) == 2:
        return Rows(r0.x, r0.ids, r0.e, r0.enum)


def rowwise(a: Analysis, n: fx.Node, op: str, r0):
    """The expert function: linears with per-expert weights and element-wise ops on one expert's rows."""
    in_roles = [(x, a.r(x)) for x in n.all_input_nodes]
    rows = [r for _, r in in_roles if isinstance(r, (Rows, RowFn))]
    roww = [r for _, r in in_roles if isinstance(r, RowW)]
    contrib = [r for _, r in in_roles if isinstance(r, Contrib)]
    if contrib:
        if op in ("to", "float", "bfloat16", "half", "type_as") and len(contrib) == 1:
            return contrib[0]
        return None
    if not rows:
        return None
    base = rows[0].rows if isinstance(rows[0], RowFn) else rows[0]
    if any((r.rows if isinstance(r, RowFn) else r) != base for r in rows):
        return None  # two experts' rows mixed: not a per-expert function
    if roww:
        w = roww[0]
        if op == "mul" and len(roww) == 1 and len(rows) == 1 and w.e == base.e and w.enum == base.enum \
                and w.ids.root is base.ids.root:   # the weight of the router that picked these rows
            fn_node = next(x for x, r in in_roles if isinstance(r, (Rows, RowFn)))
            w_node = next(x for x, r in in_roles if isinstance(r, RowW))
            return Contrib(base, fn_node, w.w) if _column(w_node, fn_node) else None
        return None
    if op in LINEAR_OPS:
        if not isinstance(a.r(n.args[0]), (Rows, RowFn)):
            return None
        weight = n.args[1]
        bias = arg(n, 2, "bias") if op == "linear" else None
        if not isinstance(weight, fx.Node) or a.r(weight) is not None or len(shape(weight) or ()) != 2:
            return None
        a.linears[n] = (weight, bias, "nk" if op == "linear" else "kn")
        return RowFn(base)
    others = [x for x, r in in_roles if not isinstance(r, (Rows, RowFn))]
    if any(len(shape(x) or ()) > 1 for x in others):
        return None  # a non-row tensor with a row dimension would not broadcast row-wise
    lin = next((x for x in n.args[:2] if isinstance(x, fx.Node) and x in a.linears), None)
    if op in ("add", "iadd") and len(rows) == 1 and len(others) == 1 and lin is not None \
            and others[0] in n.args[:2] and a.linears[lin][1] is None and len(lin.users) == 1 \
            and shape(others[0]) == shape(n)[-1:]:
        a.bias_adds[n] = (lin, others[0])  # x @ W[e] + b[e]: folded into the linear by the region builder
    if op in ROWWISE_UNARY or op in ROWWISE_BINARY:
        if op == "glu" and not _is_last_dim(arg(n, 1, "dim", -1), n.args[0]):
            return None
        return RowFn(base)
    if op in SPLITS and _is_last_dim(arg(n, 2, "dim", 0), n.args[0]):
        return RowFn(base)
    if op == "getitem":
        idx = n.args[1]
        if canon(n.args[0]) in SPLITS and as_int(idx) is not None:
            return RowFn(base)
        if isinstance(idx, tuple) and len(idx) == 2 and (idx[0] is Ellipsis or idx[0] == slice(None)) \
                and isinstance(idx[1], slice):
            return RowFn(base)
    if op == "cat" and _is_last_dim(arg(n, 1, "dim", 0), n.args[0][0]):
        return RowFn(base)
    return None


Rule = tuple[type | None, Callable]
# op -> rules tried in order (the role class the first argument must have, or None for any)
RULES: dict[str, tuple[Rule, ...]] = {
    "getitem": ((None, ids_of_topk), (None, ids_of_sort), (Ids, ids_slice), (OneHot, sel_of_onehot), (Weighted, roww_of_weighted),
                (WhereOf, index_of_where), (Index, index_unsqueeze_getitem), (None, acc_read), (None, gather),
                (RowW, roww_keep)),
    "getattr": ((None, ids_of_topk_attr),),
    "argmax": ((None, ids_of_argmax),),
    "narrow": ((None, ids_of_sort), (Ids, ids_slice)),
    "view": ((Ids, ids_reshape), (Index, index_keep), (RowW, roww_keep), (Rows, rows_reshape)),
    "reshape": ((Ids, ids_reshape), (Index, index_keep), (RowW, roww_keep), (Rows, rows_reshape)),
    "flatten": ((Ids, ids_reshape), (Index, index_keep)),
    "to": ((Ids, ids_cast), (Sel, sel_keep), (Weighted, weighted_cast), (Index, index_keep),
           (TokMask, tokmask_keep), (RowW, roww_keep)),
    "long": ((Ids, ids_cast), (Sel, sel_keep), (Index, index_keep)),
    "int": ((Ids, ids_cast), (Sel, sel_keep), (Index, index_keep)),
    "float": ((Ids, ids_cast), (Sel, sel_keep), (Weighted, weighted_cast), (RowW, roww_keep)),
    **{c: ((Ids, ids_cast),) for c in ("double", "half", "bfloat16", "short", "char", "byte")},
    "bool": ((Sel, sel_keep), (TokMask, tokmask_keep)),
    "type_as": ((RowW, roww_keep),),
    "eq": ((Ids, sel_of_eq), (None, sel_of_eq_reversed)),
    "one_hot": ((Ids, onehot_of_ids),),
    "permute": ((OneHot, onehot_permute),),
    "where": ((Sel, where_of_sel), (Sel, weighted_where)),
    "nonzero": ((Sel, where_of_sel),),
    "any": ((Sel, tokmask_of_sel),),
    "mul": ((Sel, weighted_sel_times_w), (None, weighted_w_times_sel)),
    "sum": ((Weighted, weighted_sum),),
    "floordiv": ((Index, index_divmod),),
    "mod": ((Index, index_divmod),),
    "unsqueeze": ((Index, index_unsqueeze), (RowW, roww_keep)),
    "expand": ((Index, scatter_index), (PendingScatter, scatter_index)),
    "expand_as": ((Index, scatter_index), (PendingScatter, scatter_index)),
    "repeat": ((Index, scatter_index), (PendingScatter, scatter_index)),
    "index_select": ((None, rows_of_index_select),),
    "index_add_": ((None, combine),),
    "index_add": ((None, combine),),
    "scatter_add_": ((None, combine),),
    "index_put_": ((None, combine),),
    "setitem": ((None, combine),),
    "add": ((None, acc_sum),),
    "iadd": ((None, acc_sum),),
}


def analyze(gm: fx.GraphModule) -> Analysis:
    return Analysis(gm).run()


__all__ = ["Analysis", "RULES", "analyze"]
