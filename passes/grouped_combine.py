"""Combine rules of the all-pairs finder: how expert rows are weighted and summed back per token.

Called by ``grouped_rows`` and ``grouped_regions`` (they read the finder's roles and set new ones;
never mutate the graph). Recognised, for rows in sorted (s), pair (p = t*K + j) or dense [E, T, *]
(d) order::

    rows * w.reshape(-1)[perm].unsqueeze(-1)   (s)     rows * w.reshape(-1).unsqueeze(-1)   (p)
    rows * zeros(T, E).scatter(1, ids, w).t().unsqueeze(-1)                               (d)
    rows[inv] | rows.index_select(0, inv)      (s -> p; inv[perm] = arange(N) or argsort(perm))
    buf = zeros(N, H); buf[perm] = rows        (s -> p: torchtitan's unsort; the buffer read as the pairs)
    p.view(T, K, H) [* w[T, K, 1]] .sum(1)     -> output
    bmm(w.view(T, 1, K), p.view(T, K, H)[.float()])[.to(dtype)].squeeze(1)   -> output (torchtitan's)
    zeros(T, H).index_add_(0, perm // K, rows) | .scatter_add_(0, (perm // K)[:, None].expand(..), rows)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .grouped_state import CASTS, DONE, FRESH
from .normalize import COLUMN_INDEXES, arg, canon, distinct_per_row, shape, val, where_in_user_code
from .writes import basic_index


def _pair_weights_unsqueezed(f, g, n) -> bool:
    """``wf[perm, None]``: one weight per pair (``wf``: [N], as ``side_tensor``'s sw) in the rows' order, as a column."""
    idx = n.args[1] if canon(n) == "getitem" else None
    if not (isinstance(idx, tuple) and len(idx) == 2 and idx[1] is None and isinstance(idx[0], fx.Node)):
        return False
    ri, vw, vn = f.r(idx[0]), val(n.args[0]), val(n)
    return bool(ri and ri.kind == "perm" and ri.g is g and isinstance(vw, torch.Tensor) and vw.dim() == 1
                and vw.is_floating_point() and isinstance(vn, torch.Tensor) and vn.shape[0] == vw.shape[0])


def _as_column(n: fx.Node) -> bool:
    """``n`` is its input's values as one column, in their order: unsqueeze(-1), view / reshape to [N, 1],
    ``[:, None]``."""
    op, src = canon(n), n.args[0]
    if op == "unsqueeze":
        return arg(n, 1, "dim") in (-1, len(shape(src) or ()))
    if op in ("view", "reshape"):
        return len(shape(src) or ()) == 1 and len(shape(n) or ()) == 2
    return op == "getitem" and n.args[1] in COLUMN_INDEXES


def row_weights(f, g, other, ro):
    """The routing-weight node (reshaped to [T, K] by the lowering) if ``other`` weights the rows."""
    if not isinstance(other, fx.Node) or canon(other) not in ("unsqueeze", "view", "reshape", "getitem"):
        return None
    src = other.args[0]
    rs = f.r(src)
    s = shape(other)
    if not s or s[-1] != 1:
        return None
    if g.family == "sorted" and _pair_weights_unsqueezed(f, g, other):   # w.reshape(-1)[perm, None]
        return src
    if g.family in ("sorted", "batched") and not _as_column(other):   # sw[perm, None] permutes the sorted
        return None                                                       # weights again (review helper-106)
    if g.family == "sorted" and rs and rs.kind == "sw" and rs.g is g:
        return rs.info
    if g.family == "batched" and rs is None and isinstance(val(src), torch.Tensor) \
            and val(src).is_floating_point() and tuple(val(src).shape) == (val(g.x).shape[0] * g.k,):
        return src
    if g.family == "dense" and ro and ro.kind == "routing" and ro.info[2] == "et1":
        ids, w, _ = ro.info
        if shape(ids) != shape(w) or len(shape(ids)) != 2:
            g.note("routing_matrix_shapes")
            return None
        if not distinct_per_row(ids):
            g.note("ids_may_repeat", ids, node=ids.name)
            return None
        g.ids, g.k = ids, shape(ids)[1]
        return w
    return None


def unsort(f, g, n, op) -> bool:
    """rows[inv] / index_select(0, inv): rows back in (token, slot) order."""
    idx = n.args[1] if op == "getitem" else (arg(n, 2, "index") if op == "index_select" else None)
    if op == "index_select" and arg(n, 1, "dim") != 0:
        return False
    ri = f.r(idx)
    if ri is None or ri.kind != "inv" or ri.g is not g:
        if g.family == "batched" and op in ("view", "reshape", "unflatten"):
            return pair3(f, g, n)
        return False
    g.end = g.step_of[n.args[0]]
    f.set(n, "pair", g, n.args[0])
    return True


def unsort_into(f, g, n, op, rows_in):
    """buf[perm] = rows, buf a fresh [N, H] tensor read by nothing before: buf holds the rows in (token, slot)
    order (row p goes to pair perm[p], as rows[inv]). The write is the region's own; every later reader of
    buf must be in the region (``escaping_intermediate``), where the rewrite computes the pairs itself."""
    buf, idx, src = (n.args + (None, None, None))[:3]
    ri, rs = f.r(idx), f.r(src)
    if op != "setitem" or not isinstance(buf, fx.Node) or getattr(f.r(buf), "kind", "fresh") != "fresh" \
            or canon(buf) not in FRESH \
            or not (ri and ri.kind == "perm" and ri.g is g) or not (rs and rs.kind == "rows" and rs.g is g):
        return None
    vb, vs = val(buf), val(src)
    if not (isinstance(vb, torch.Tensor) and isinstance(vs, torch.Tensor)) or vb.dtype != vs.dtype \
            or shape(buf) != shape(src) or [u for u in buf.users if f.order[u] < f.order[n]]:
        return None
    g.end = g.step_of[src]
    f.set(buf, "pair", g, src)
    f.set(n, "mut", g)
    g.erase.append(n)
    return DONE


def pair3(f, g, n) -> bool:
    s = shape(n)
    if s and len(s) == 3 and s[1] == g.k and s[0] * s[1] == shape(n.args[0])[0]:
        if f.r(n.args[0]).kind == "rows":
            g.end = g.step_of[n.args[0]]
        f.set(n, "pair3", g)
        return True
    return False


def pair_op(f, g, n, op, src, kind):
    """Ops on rows in (token, slot) order: the [T, K, H] view, casts, weights, the sum over K."""
    if kind == "pair" and op in ("view", "reshape", "unflatten") and pair3(f, g, n):
        return
    if op in CASTS:
        v, vin = val(n), val(src)
        if isinstance(v, torch.Tensor) and v.is_floating_point():   # an integer cast truncates each pair
            # exact (a widening), or to a dtype that holds the layer's input (bf16 rows' fp32 products back
            # to bf16); not a rounding below it (fp32 pairs through bf16: found by review, rewritten 2e-3 off)
            if v.dtype in (torch.promote_types(vin.dtype, v.dtype), torch.promote_types(val(g.x).dtype, v.dtype)):
                f.set(n, kind, g)
            else:
                g.note("pairs_rounded", n, dtype=str(v.dtype).removeprefix("torch."),
                       wide=str(vin.dtype).removeprefix("torch."), at=where_in_user_code(n) or "?")
        return
    if kind == "pair3" and op == "mul":
        other = n.args[1] if n.args[0] is src else n.args[0]
        s = shape(other)
        if f.r(other) is None and s == (shape(src)[0], g.k, 1):
            if g.weighted_at is not None:
                g.note("weights_twice")
            g.weights, g.weighted_at = other, g.end
            f.set(n, "pair3", g)
            return
    if kind == "pair3" and op == "sum" and arg(n, 1, "dim") in (1, (1,), -2) and not arg(n, 2, "keepdim", False):
        g.output = n
        f.set(n, "out", g)
        return
    if kind == "pair3" and op == "bmm" and len(n.args) == 2 and n.args[1] is src and f.r(n.args[0]) is None \
            and shape(n.args[0]) == (shape(src)[0], 1, g.k):   # [T, 1, K] @ [T, K, H]: the weighted sum over K
        if g.weighted_at is not None:
            g.note("weights_twice")
        g.weights, g.weighted_at = n.args[0], g.end
        f.set(n, "pair1", g)
        return
    if kind == "pair1" and op == "squeeze" and arg(n, 1, "dim") in (1, -2):
        g.output = n
        f.set(n, "out", g)


def combine_add(f, g, n, op, acc, src, onto: bool = False) -> bool:
    """zeros(T, H).index_add_(0, perm // K, rows) / .scatter_add_(0, (perm // K)[:, None].expand(..), rows).
    ``onto``: ``acc`` is not zeros but a tensor the out-of-place op adds the rows to (read, never written)."""
    idx = arg(n, 2, "index")
    ok = f.r(idx) and f.r(idx).kind == "tok" and f.r(idx).g is g
    if not ok and op.startswith("scatter_add") and canon(idx) == "expand":
        # (perm // K)[:, None].expand(N, H): each row's token down dim 0, the index the rows' own shape
        # ([N, 1] or [N, H / 2] would add some columns only; unsqueeze(0).expand(H, N) other tokens)
        col = idx.args[0]
        n_rows = shape(src)[0] if shape(src) else None
        if (canon(col) in ("unsqueeze", "view", "reshape") or canon(col) == "getitem" and basic_index(col)) \
                and shape(col) == (n_rows, 1) and shape(idx) == shape(src):   # [:, None]: a getitem
            base = col.args[0]
            ok = f.r(base) and f.r(base).kind == "tok" and f.r(base).g is g
    if not ok or arg(n, 1, "dim") != 0 or (not onto and [u for u in acc.users if f.order[u] < f.order[n]]):
        return False
    if n.kwargs.get("alpha", 1) != 1 or shape(acc) != (shape(g.x)[0], shape(src)[-1]):
        return False   # index_add_(..., alpha=a) scales the rows; an accumulator of another shape is not [T, H]
    if onto and not (isinstance(val(acc), torch.Tensor) and val(acc).dtype == val(n).dtype):
        return False
    if op.endswith("_"):
        g.aliases = (acc,)
    g.base = acc if onto else None
    g.output, g.end = n, g.step_of[src]
    f.set(n, "out", g)
    return True
