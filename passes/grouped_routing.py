"""Routing rules of the all-pairs finder: expert ids, the sort, counts/offsets, the inverse permutation,
where the rows enter, and the per-row side tensors (weights, biases, gathered weights, routing matrix).

Each rule is ``(finder, node, canonical op, first arg, its role, its role kind) -> DONE | None`` and
sets roles with ``finder.set``; ``grouped_regions.ROUTING_RULES`` maps ops to these rules::

    flat = ids.reshape(-1); s, perm = sort(flat) | perm = argsort(flat)      -> flat, sort, sorted_ids, perm
    perm // K                                                                -> tok
    histc(s.float(), E, 0, E - 1 | E) | bincount(s, minlength=E) | one_hot(.).sum(0) -> counts;  cumsum -> offs
    inv = empty_like(perm); inv[perm] = arange(N) | argsort(perm)           -> inv
    x[perm // K] | x.index_select(0, ..) | x.repeat_interleave(K, 0) | x.unsqueeze(0).expand(E, ..) -> rows
    w.reshape(-1)[perm] -> sw;  b[s] / b[flat] -> bias;  W[flat] -> wsel;  zeros(T, E).scatter(1, ids, w) -> routing
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .grouped_state import CASTS, DONE, FLATTEN, as_int, swaps_2d
from .expert_ids import ID_VIEWS, router_kind, router_root
from .id_range import holds_ids, id_bound
from .normalize import arg, canon, shape, val, where_in_user_code


def flat_ids(f, n, op, a0, r0, rk):
    """ids.reshape(-1): integer [T, K] -> [N]."""
    if rk is None and isinstance(val(a0), torch.Tensor) and not val(a0).is_floating_point() \
            and val(a0).dim() == 2 and tuple(val(n).shape) == (val(a0).numel(),):
        f.set(n, "flat", info=a0)
        return DONE


def sort_ids(f, n, op, a0, r0, rk):
    """sort(flat) / argsort(flat) (top-1 ids [T] are sorted directly): a new group."""
    if rk is None and shape(a0) and len(shape(a0)) == 1 and not val(a0).is_floating_point():
        f.set(a0, "flat", info=a0)
        rk, r0 = "flat", f.r(a0)
    # narrow_flat: the ids cast to a dtype that does not hold them, then sorted (a group refused for it)
    if rk == "narrow_flat" or rk == "flat" and not arg(n, 2, "descending", False):
        ids, narrow = r0.info if rk == "narrow_flat" else (r0.info, None)
        g = sorted_group(f, n, a0, ids)
        f.set(n, "sort" if op == "sort" else "perm", g)
        if narrow is not None:
            g.note("ids_cast_narrow", a0, **narrow)
        return DONE


def sorted_group(f, sort: fx.Node, flat: fx.Node, ids: fx.Node):
    """The group of ``sort`` (a sort of the flat ids ``flat``, flattened from the router's ``ids``):
    made once, where the walk reaches the sort or, earlier, a count of the same ids (``sort_ahead``)."""
    g = next((g for g in f.groups if g.family == "sorted" and g.key is sort), None)
    if g is None:
        g = f.group("sorted", sort)
        g.flat, g.ids, g.k = flat, ids, _top_k(ids)
    return g


def sort_ahead(f, flat: fx.Node):
    """The group of the sort that orders the flat ids ``flat`` (the ``flat`` role: a row-major flatten
    of router ids [T, K]) for counts taken from them before the walk reaches that sort (torchtitan's
    router takes ``histc(ids.view(-1))`` before its reorderer's ``argsort(ids.view(-1))``), or for
    counts of another flatten of the same ids node (the same values in the same order). None unless
    exactly one such sort exists: two layers that sort the same router's ids would otherwise take each
    other's counts (then neither is rewritten, and both are reported)."""
    ids = f.r(flat).info
    flats = [flat] + [u for u in ids.users if u is not flat and _flattens(u, ids)] if isinstance(ids, fx.Node) else [flat]
    sorts = [(u, c) for c in flats for u in c.users
             if canon(u) in ("sort", "argsort") and u.args and u.args[0] is c
             and not arg(u, 2, "descending", False) and arg(u, 1, "dim", -1) in (0, -1)]
    return sorted_group(f, *sorts[0], ids) if len(sorts) == 1 else None


def _flattens(n: fx.Node, ids: fx.Node) -> bool:
    """``n`` is a row-major flatten of ``ids`` (as ``flat_ids`` takes it; the walk may not have reached it)."""
    v, vi = val(n), val(ids)
    return canon(n) in FLATTEN and n.args[0] is ids and isinstance(v, torch.Tensor) and isinstance(vi, torch.Tensor) \
        and vi.dim() == 2 and tuple(v.shape) == (vi.numel(),)


def _top_k(ids: fx.Node) -> int:
    """K of router ids [T, K]; 1 for top-1 ids [T]."""
    return val(ids).shape[-1] if val(ids).dim() == 2 else 1


def _not_the_ids(ids: fx.Node) -> str:
    """Why the sorted values, whose rows are gathered with a divisor other than their top_k, are not a
    router's ids flattened token-major ('' when no router is in sight): computed from them (``ids * 2``,
    which the group takes for top-1 ids), or a transposed view (K-major: the group reads T as top_k)."""
    if router_root(ids) is not None:
        return ""
    n, hops = ids, 0
    while isinstance(n, fx.Node) and hops < 8 and n.all_input_nodes:
        op = canon(n) or ""
        if op in ("t", "transpose", "permute", "mT") and router_root(n.args[0]) is not None:
            return "the ids transposed (K-major: row r is slot r // T)"
        n, hops = n.all_input_nodes[0], hops + 1
        if router_root(n) is not None:
            return f"a value computed from the ids (`{op}`)"
    return ""


def sort_parts(f, n, op, a0, r0, rk):
    f.set(n, "sorted_ids" if n.args[1] == 0 else "perm", r0.g)
    return DONE


# casts that keep row counts / offsets exact (fp32: < 2^24 rows); a bool, 8-bit or 16-bit cast changes them.
# Expert ids: a dtype that holds every id below the router's E (id_range.holds_ids: int16 wraps 32768 to
# -32768, which sorts first and shifts every group); where E is not known, below this many experts
_EXACT_COUNTS = {torch.int32, torch.int64, torch.float32, torch.float64}
_EXPERTS_IF_UNKNOWN = 2 ** 15


def _ids_bound(g, a0) -> int | None:
    """E of the router whose ids the group reads (its topk / argmax dim), else None."""
    for ids in (getattr(g, "ids", None), a0):   # (flat ids read before their sort have no group yet)
        bound = id_bound(ids) if isinstance(ids, fx.Node) else None
        if bound is not None:
            return bound
    return None


def _narrow_cast(n: fx.Node, ids, bound: int | None, dtype) -> dict:
    """The detail of an ``ids_cast_narrow`` finding: the sorted ids cast to a dtype that does not hold them."""
    router = router_root(ids) if isinstance(ids, fx.Node) else None
    return {"router": router_kind(router, _top_k(ids)) if router is not None else "a router",
            "e": bound if bound is not None else "?",
            "last": bound - 1 if bound is not None else "the last (E unknown)",
            "router_at": where_in_user_code(router) if router is not None else "?",
            "evidence": "grouped expert GEMMs through a sort of its ids", "dtype": str(dtype).removeprefix("torch."),
            "node": n.name}


def cast_keeps_kind(f, n, op, a0, r0, rk):
    if rk in ("sorted_ids", "flat", "counts", "offs") and op in CASTS:
        v = val(n)
        if not isinstance(v, torch.Tensor):
            return None
        of_ids = rk in ("sorted_ids", "flat")
        bound = _ids_bound(r0.g, a0) if of_ids else None
        if of_ids and not holds_ids(v.dtype, _EXPERTS_IF_UNKNOWN if bound is None else bound):
            # the region still forms, so that it is refused with this reason (rather than as a new group
            # of 1-D ids or as an unmatched layer): sorted ids keep their role in a group that can no
            # longer be rewritten; flat ids (no group yet) get a role of their own, which only a sort reads
            detail = _narrow_cast(n, r0.g.ids if r0.g is not None else r0.info, bound, v.dtype)
            if r0.g is None:
                f.set(n, "narrow_flat", info=(r0.info, detail))
                return DONE
            r0.g.note("ids_cast_narrow", n, **detail)
        if rk in ("counts", "offs") and v.dtype not in _EXACT_COUNTS:
            return None
        f.set(n, rk, r0.g, r0.info)
        return DONE


def sorted_by_perm(f, n, op, a0, r0, rk):
    """flat[perm]: the sorted ids. The group's expert ids are the values it sorted, so ``flat`` must be
    those (``(ids * 2).reshape(-1)`` sorted, then ``ids.reshape(-1)[perm]`` read as the sorted ids would
    give the rewrite ids * 2 as expert ids while the offsets count ids)."""
    rp = f.r(n.args[1])
    if rp and rp.kind == "perm":
        g = rp.g
        if _same_values(a0) is not _same_values(g.flat) and _same_values(r0.info) is not _same_values(g.ids):
            g.note("sort_key", n, node=g.flat.name,
                   how=f"while `{a0.name}`, another tensor, is reordered by its permutation as the sorted ids")
        f.set(n, "sorted_ids", g)
        return DONE


def _same_values(n):
    """``n`` behind reshapes, copies and integer casts of the ids (``ids.long().reshape(-1)`` is ``ids``)."""
    while isinstance(n, fx.Node) and (canon(n) or "") in ID_VIEWS and n.args and isinstance(n.args[0], fx.Node) \
            and isinstance(val(n), torch.Tensor) and not val(n).is_floating_point():
        n = n.args[0]
    return n


def token_of_row(f, n, op, a0, r0, rk):
    """perm // K."""
    if op == "floordiv" or n.kwargs.get("rounding_mode") == "floor":
        if n.args[1] != r0.g.k:
            r0.g.findings[:] = []
            how = _not_the_ids(r0.g.ids)
            if how:
                r0.g.note("sort_key", n, node=r0.g.flat.name, how=how)
            else:
                r0.g.note("topk_mismatch", n, what=f"rows are gathered with perm // {n.args[1]}", k=r0.g.k)
        f.set(n, "tok", r0.g)
        return DONE


def sentinel(f, n, op, a0, r0, rk):
    """sorted_ids >= E: expert-parallel sentinels (transformers <= 5.17 always emits the mask); our ops
    already give "dropped" ids (outside [0, E)) zero rows everywhere."""
    if op == "ge" and rk == "sorted_ids" and as_int(n.args[1]) is not None:
        f.set(n, "sentinel", r0.g, n.args[1])
        return DONE
    if op == "unsqueeze" and rk == "sentinel":
        f.set(n, "sentinel", r0.g, r0.info)
        return DONE


def clamp_ids(f, n, op, a0, r0, rk):
    """sorted_ids.clamp(max=E - 1) (transformers' EP sentinels; the bound is checked against E when
    the group is finished: any other bound changes which expert a row belongs to)."""
    if arg(n, 1, "min") is None and as_int(arg(n, 2, "max")) is not None:
        r0.g.clamps.append((n, arg(n, 2, "max")))
        f.set(n, "sorted_ids", r0.g)
        if op == "clamp_":
            r0.g.erase.append(n)
        return DONE


def counts_histc(f, n, op, a0, r0, rk):
    """histc(ids, bins=E, min=0, max=E - 1) (bins of width (E-1)/E: id e in bin e), or max=E (torchtitan's
    spelling: width 1, id E would land in the last bin) when the ids are known to be below E."""
    if rk in ("sorted_ids", "flat"):
        g = f.sorted_group_of(r0, a0)
        bins, hi = arg(n, 1, "bins", 100), arg(n, 3, "max", 0)
        bound = id_bound(g.ids) if g is not None and g.ids is not None else None
        if g is not None and arg(n, 2, "min", 0) == 0 and (hi == bins - 1 or hi == bins and bound is not None
                                                          and bound <= bins):
            f.set(n, "counts", g, bins)
            _note_clamped_counts(f, g, a0, n)
        return DONE


def counts_bincount(f, n, op, a0, r0, rk):
    """bincount(ids, minlength=E): E counts when every id is below E. Its length is max(E, largest id +
    1): a static E in the graph, or (data-dependent capture) an unbacked size, which is E when the ids
    are known to be below E (a top-k over E scores)."""
    if rk in ("sorted_ids", "flat"):
        g = f.sorted_group_of(r0, a0)
        s, minlength = shape(n), arg(n, 2, "minlength", 0)
        bound = id_bound(g.ids) if g is not None and g.ids is not None else None
        if g is not None and s and isinstance(minlength, int) and minlength > 0 and arg(n, 1, "weights") is None \
                and (s[0] == minlength if isinstance(s[0], int) else bound is not None and bound <= minlength):
            f.set(n, "counts", g, minlength)
            _note_clamped_counts(f, g, a0, n)
        return DONE


def onehot_ids(f, n, op, a0, r0, rk):
    if rk in ("sorted_ids", "flat"):
        g = f.sorted_group_of(r0, a0)
        f.set(n, "onehot", g, arg(n, 1, "num_classes"))
        if g is not None:
            _note_clamped_counts(f, g, a0, n)
        return DONE


def _note_clamped_counts(f, g, ids: fx.Node, counts: fx.Node) -> None:
    """Counts taken from ids clamped to E - 1 (the clamp node itself, or an in-place clamp_ of them
    before the count) count a router's ids >= E as expert E - 1's rows; the rewrite drops those ids.
    Recorded for ``findings``, which refuses it unless the router's ids are known to be below E."""
    while canon(ids) in CASTS and isinstance(ids.args[0], fx.Node):   # histc(s.float(), ...)
        ids = ids.args[0]
    for c, _bound in g.clamps:
        if c is ids or (c.args and c.args[0] is ids and canon(c) == "clamp_" and f.order[c] < f.order[counts]):
            g.clamped_counts = c


def counts_of_onehot(f, n, op, a0, r0, rk):
    if arg(n, 1, "dim") in (0, (0,), [0]):
        f.set(n, "counts", r0.g, r0.info)
        return DONE


def offsets(f, n, op, a0, r0, rk):
    if arg(n, 1, "dim") in (0, -1) and r0.g is not None:
        g = r0.g
        g.offs, g.e = n, r0.info if g.e is None else g.e
        f.set(n, "offs", g)
        return DONE


def inverse_alloc(f, n, op, a0, r0, rk):
    f.set(n, "inv_alloc", r0.g)
    return DONE


def inverse_fill(f, n, op, a0, r0, rk):
    """inv[perm] = arange(N)."""
    ri = f.r(n.args[1])   # the perm of this inverse's own sort (empty_like(perm)), not another sort's
    if ri and ri.kind == "perm" and ri.g is r0.g and isinstance(n.args[2], fx.Node) \
            and _counts_up(n.args[2], val(n.args[1]).numel()):
        f.set(a0, "inv", r0.g)
        f.set(n, "mut", r0.g)
        r0.g.erase.append(n)
        return DONE


def _counts_up(node: fx.Node, n) -> bool:
    """``node`` is arange(n): 0, 1, ..., n - 1 (``arange(n)`` or ``arange(0, n[, 1])``; ``n`` and the
    bounds may be symbolic sizes under dynamic shapes)."""
    if canon(node) != "arange":
        return False
    pos = list(node.args) + [node.kwargs[k] for k in ("start", "end", "step") if k in node.kwargs]
    if "end" in node.kwargs and "start" not in node.kwargs and len(node.args) == 0:
        pos = [0, node.kwargs["end"], node.kwargs.get("step", 1)]
    if len(pos) == 1:
        return _same_size(pos[0], n)
    return len(pos) in (2, 3) and _same_size(pos[0], 0) and _same_size(pos[1], n) \
        and (len(pos) == 2 or _same_size(pos[2], 1))


def _same_size(a, b) -> bool:
    """Two sizes (ints, SymInts, or nodes holding them) that are provably equal."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    a, b = val(a), val(b)
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001  (sizes that cannot be compared are not provably equal)
        return False


def inverse_argsort(f, n, op, a0, r0, rk):
    """argsort(perm), ascending: the inverse permutation."""
    if not arg(n, 2, "descending", False) and arg(n, 1, "dim", -1) in (0, -1):
        f.set(n, "inv", r0.g)
    return DONE


def _token_input(r0, ri) -> bool:
    """The tensor rows are gathered from is a token tensor: no role, or another region's finished output
    (``b(a(x))``: lowering/region_chain.py gives the later region the earlier one's new output)."""
    return r0 is None or (r0.kind == "out" and ri is not None and r0.g is not ri.g)


def enter_getitem(f, n, op, a0, r0, rk):
    """x[perm // K] (or x[perm] for top-1)."""
    ri = f.r(n.args[1])
    if _token_input(r0, ri) and ri and ri.kind in ("tok", "perm") and shape(a0) and len(shape(a0)) == 2:
        f.enter(n, a0, ri)
        return DONE


def enter_index_select(f, n, op, a0, r0, rk):
    ri = f.r(arg(n, 2, "index"))
    if _token_input(r0, ri) and arg(n, 1, "dim") == 0 and ri and ri.kind in ("tok", "perm"):
        f.enter(n, a0, ri)
        return DONE


def enter_gather(f, n, op, a0, r0, rk):
    """x.gather(0, (perm // K).reshape(-1, 1).expand(-1, H)): x[perm // K] (torchtitan's token
    reorderer). Only an index that spans every column of x in each row: a narrower one gathers some
    columns only."""
    idx = arg(n, 2, "index")
    if arg(n, 1, "dim") not in (0, -2) or canon(idx) != "expand" or not shape(a0) or len(shape(a0)) != 2:
        return None
    col = idx.args[0]
    ri = f.r(col.args[0]) if isinstance(col, fx.Node) and col.args else None
    if not _token_input(r0, ri):
        return None
    n_rows = shape(col)[0] if shape(col) else None
    if canon(col) in ("unsqueeze", "view", "reshape") and ri and ri.kind in ("tok", "perm") \
            and shape(col) == (n_rows, 1) and shape(idx) == (n_rows, shape(a0)[1]):
        f.enter(n, a0, ri)
        return DONE


def enter_batched(f, n, op, a0, r0, rk):
    """x.repeat_interleave(K, dim=0): one row per (token, slot) pair (HF batched_mm)."""
    if rk is None and as_int(arg(n, 1, "repeats")) and arg(n, 2, "dim") == 0:
        v = val(a0)
        if isinstance(v, torch.Tensor) and v.dim() == 2 and v.is_floating_point():
            g = f.group("batched", n)
            g.x, g.k = a0, arg(n, 1, "repeats")
            g.step_of[n] = -1
            f.set(n, "rows", g)
        return DONE


def enter_dense(f, n, op, a0, r0, rk):
    """x.unsqueeze(0).expand(E, T, H), or x.expand(E, T, H) on a 2-D x (the same new leading dim):
    every token through every expert."""
    if rk is not None or not isinstance(a0, fx.Node):
        return None
    unsqueezed = canon(a0) == "unsqueeze" and arg(a0, 1, "dim") == 0
    src, v = (a0.args[0] if unsqueezed else a0), val(n)
    xv = val(src)
    if isinstance(v, torch.Tensor) and v.dim() == 3 and isinstance(xv, torch.Tensor) and xv.dim() == 2 \
            and xv.is_floating_point() and tuple(v.shape[1:]) == tuple(xv.shape):   # ([T, 1] broadcast: no)
        g = f.group("dense", n)
        g.x, g.e = src, v.shape[0]
        g.step_of[n] = -1
        f.set(n, "rows", g)
        return DONE
    return DONE if unsqueezed else None


def side_tensor(f, n, op, a0, r0, rk):
    """w.reshape(-1)[perm] (sw), b[sorted_ids] / b[flat] (bias), W[flat] (wsel)."""
    if rk is None and isinstance(n.args[1], fx.Node) and f.r(n.args[1]):
        ri = f.r(n.args[1])
        v = val(n)
        if ri.kind == "perm" and v.is_floating_point() and v.dim() == 1:
            if isinstance(va := val(a0), torch.Tensor) and va.dim() == 1 and va.shape[0] == v.shape[0]:
                f.set(n, "sw", ri.g, a0)   # one weight per pair: w.reshape(-1), not a longer vector
        elif ri.kind == "sorted_ids" and v.dim() == 2:
            f.set(n, "bias", ri.g, a0)
        elif ri.kind == "flat" and v.dim() == 2:
            f.set(n, "bias", None, (a0, "pair", n.args[1]))
        elif ri.kind == "flat" and v.dim() == 3:
            f.set(n, "wsel", None, (a0, n.args[1], False))  # W[flat]: gathered per-pair weights
        return DONE


def wsel_transpose(f, n, op, a0, r0, rk):
    if {n.args[1], n.args[2]} in ({1, 2}, {-1, -2}):
        w3, flat, t = r0.info
        f.set(n, "wsel", None, (w3, flat, not t))
        return DONE


def routing_matrix(f, n, op, a0, r0, rk):
    """zeros(T, E).scatter(1, ids, w): the [T, E] routing matrix, K nonzeros per row."""
    if rk is None and arg(n, 1, "dim") == 1 and canon(a0) in ("zeros", "zeros_like", "new_zeros") \
            and arg(n, 4, "reduce") is None:
        ids, w = arg(n, 2, "index"), arg(n, 3, "src")
        if isinstance(w, fx.Node) and isinstance(ids, fx.Node) and not val(ids).is_floating_point():
            f.set(n, "routing", None, (ids, w, "te"))
            if op == "scatter_":
                f.set(a0, "routing", None, (ids, w, "te"))
        return DONE


def routing_view(f, n, op, a0, r0, rk):
    """routing.t() / .unsqueeze(-1): orientation "te" -> "et" -> "et1". Only ops that move no entry are
    views here: a transpose that swaps the two dims (not ``permute(0, 1)`` or ``transpose(0, 0)``, the
    same shape when T == E), and a trailing unit dim added by unsqueeze, view / reshape or a None index
    among full slices (an index by a tensor or list keeps the shape and moves the entries)."""
    s, s0 = shape(n), shape(a0)
    ids, w, orient = r0.info
    if len(s0) == 2 and (op == "t" or op in ("transpose", "permute") and swaps_2d(n, op)):
        f.set(n, "routing", None, (ids, w, orient[::-1]))
    elif s and len(s) == 3 and s[-1] == 1 and s[:2] == s0[:2] and len(s0) == 2 and _appends_unit_dim(n, op):
        f.set(n, "routing", None, (ids, w, orient + "1"))
    return DONE


def _appends_unit_dim(n: fx.Node, op: str) -> bool:
    """[a, b] -> [a, b, 1] without moving an entry: unsqueeze(-1 / 2), view / reshape (row-major order
    is unchanged by a trailing 1), or ``[..., None]`` / ``[:, :, None]``."""
    if op == "unsqueeze":
        return arg(n, 1, "dim") in (-1, 2)
    if op in ("view", "reshape"):
        return True
    if op == "getitem":
        idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        return len(idx) >= 2 and idx[-1] is None and idx.count(Ellipsis) <= 1 \
            and all(i is Ellipsis or i == slice(None) for i in idx[:-1])
    return False
