"""Row rules of the all-pairs finder: ops on a group's rows (the expert function, biases, weights).

Each rule is ``(finder, group, node, canonical op, the row-valued inputs) -> DONE | None``;
``grouped_regions.ROW_RULES`` maps ops to these rules (tried in order), and ops the table does not
name fall through to the element-wise rules at the end::

    grouped_mm(rows, W[E, K, N], offs)           a linear (3-D weight, offsets from this group's ids)
    bmm(W[flat], rows[:, :, None]).squeeze(-1)   a linear of the batched form (W gathered per pair)
    bmm(rows [E, T, H], W^T)                     a linear of the dense form
    rows + b[sorted_ids] | rows.add_(b[flat])    a per-expert bias, right after its linear
    rows * w.reshape(-1)[perm].unsqueeze(-1)     routing weights (after the last op, or on the input rows)
    rows.masked_fill(sorted_ids >= E, 0)         transformers' EP sentinel mask (what our ops do anyway)
    rows.type_as(t)                              a cast to t's dtype (a step ``rows.to(dtype)``)
    silu / gelu / mul / chunk / [..., ::2] ...   element-wise steps of the expert function
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .expert_ids import router_root
from .grouped_combine import combine_add, row_weights, unsort
from .grouped_state import CASTS, DONE, FRESH, as_int, is_last_dim, shared_ok
from .loop_dataflow import ROWWISE_BINARY, ROWWISE_UNARY
from .normalize import ancestors, arg, canon, val
from .token_paths import MATMULS


def sentinel_mask(f, g, n, op, rows_in):
    """rows.masked_fill(sentinel, 0): zeroing dropped rows, which the rewritten ops already do."""
    a0 = n.args[0]
    r0 = f.r(a0)
    rm = f.r(arg(n, 1, "mask"))
    if r0 and r0.kind == "rows" and arg(n, 2, "value") == 0 and rm and rm.kind == "sentinel" and rm.g is g:
        if g.e is not None and rm.info != g.e:
            g.note("sentinel_mismatch", n, sentinel=rm.info, experts=g.e)
        elif g.e is None:   # a mask before the offsets: checked against E when the region finishes
            g.clamps.append((n, rm.info - 1))
        g.step_of[n] = g.step_of[a0]
        f.set(n, "rows", g)
        if op == "masked_fill_":
            g.erase.append(n)
        return DONE


def scatter_back(f, g, n, op, rows_in):
    """zeros(T, H).index_add_(0, perm // K, rows) / .scatter_add_(0, ..expand, rows); out of place also
    into another tensor computed before (``shared(x).scatter_add(...)``: the output is base + rows)."""
    a0 = n.args[0]
    fresh = canon(a0) in FRESH
    if f.r(a0) is None and isinstance(a0, fx.Node) and (fresh or not op.endswith("_")):
        src = arg(n, 3, "source" if "index" in op else "src")
        if f.r(src) and f.r(src).kind == "rows" and combine_add(f, g, n, op, a0, src, onto=not fresh):
            return DONE


def grouped_gemm(f, g, n, op, rows_in):
    a0, r0 = n.args[0], f.r(n.args[0])
    if not (r0 and r0.kind == "rows"):
        return None
    offs = arg(n, 2, "offs")
    if not (f.r(offs) and f.r(offs).kind == "offs" and f.r(offs).g is g):
        return g.note("foreign_offsets", n, node=n.name)
    if arg(n, 3, "bias") is not None or arg(n, 4, "out_dtype") is not None:
        return g.note("gmm_bias_out_dtype", n, node=n.name)
    f.linear(g, n, a0, n.args[1], "kn")
    return DONE


def dense_linear(f, g, n, op, rows_in):
    r0 = f.r(n.args[0])
    if g.family == "dense" and r0 and r0.kind == "rows" and not f.r(n.args[1]):
        f.linear(g, n, n.args[0], n.args[1], "kn")
        return DONE


def batched_unsqueeze(f, g, n, op, rows_in):
    """rows.unsqueeze(1) / (-1), or the same spelled as an index: rows[:, None] / rows[..., None]."""
    r0 = f.r(n.args[0])
    dim = arg(n, 1, "dim") if op == "unsqueeze" else _none_index_dim(n)
    if g.family == "batched" and r0 and r0.kind == "rows" and dim in (-1, 1):
        f.set(n, "unsq", g, (n.args[0], dim))
        return DONE


def _none_index_dim(n) -> int | None:
    """The dim a 2-D ``x[idx]`` inserts when ``idx`` is one None among full slices (``x[:, None]``: 1,
    ``x[..., None]`` / ``x[:, :, None]``: -1), else None."""
    idx = n.args[1] if len(n.args) > 1 else None
    idx = idx if isinstance(idx, tuple) else (idx,)
    if idx.count(None) != 1 or not all(i is None or i is Ellipsis or i == slice(None) for i in idx) \
            or idx.count(Ellipsis) > 1:
        return None
    at = idx.index(None)
    if Ellipsis in idx:
        return -1 if idx[-1] is None and len(idx) == 2 and idx[0] is Ellipsis else None
    return {1: 1, 2: -1}.get(at)


def batched_bmm(f, g, n, op, rows_in):
    """bmm(M, h[:, :, None]) = h @ M^T;  bmm(h[:, None], M) = h @ M;  M = W[ids] (or its transpose)."""
    if g.family != "batched":
        return None
    first, second = n.args[:2]
    rf, rs = f.r(first), f.r(second)
    if rf and rf.kind == "wsel" and rs and rs.kind == "unsq" and rs.info[1] == -1:
        f.set(n, "bmm", g, (rs.info[0], rf.info[:2], "kn" if rf.info[2] else "nk", -1))
    elif rs and rs.kind == "wsel" and rf and rf.kind == "unsq" and rf.info[1] == 1:
        f.set(n, "bmm", g, (rf.info[0], rs.info[:2], "nk" if rs.info[2] else "kn", 1))
    else:
        g.note("bmm_not_gathered", n, node=n.name)
    return DONE


def batched_squeeze(f, g, n, op, rows_in):
    r0 = f.r(n.args[0])
    if not (r0 and r0.kind == "bmm" and arg(n, 1, "dim") in (r0.info[3], 2 if r0.info[3] == -1 else 1)):
        return None
    rows, (w3, flat), layout, _ = r0.info
    if g.flat is None:
        g.flat, g.ids = flat, f.r(flat).info
    elif g.flat is not flat:
        return g.note("batched_two_ids")
    k = val(g.ids).shape[-1]
    if k != g.k:
        g.note("topk_mismatch", n, what=f"repeat_interleave({g.k})", k=k)
    f.linear(g, n, rows, w3, layout)
    return DONE


def bias_add(f, g, n, op, rows_in):
    """rows + b[ids]: folded into the linear right before it."""
    a0, r0 = n.args[0], f.r(n.args[0])
    if not (r0 and r0.kind == "rows" and len(rows_in) == 1):
        return None
    rb = f.r(n.args[1])
    if not (rb and rb.kind == "bias"):
        return None
    if len(n.args) != 2 or n.kwargs:   # add(rows, b, alpha=a) scales the bias: not a bias add
        return None
    if g.weighted_at is not None:      # y * w + b[ids]: folded into the linear it would be (y + b) * w
        return g.note("bias_after_weights", n, node=n.name)
    # b[sorted_ids] on sorted rows; b[flat] (one bias row per (token, slot) pair) on pair-ordered rows only
    ok_group = rb.g is g if rb.g is not None else \
        (rb.info[1] == "pair" and rb.info[2] is g.flat and g.family == "batched")
    first_user = min(a0.users, key=f.order.__getitem__) is n
    if ok_group and (first_user if op != "add" else len(a0.users) == 1) \
            and f.add_bias(g, a0, rb.info if rb.g is not None else rb.info[0], n):
        if op != "add":
            g.erase.append(n)
        return DONE
    return g.note("bias_not_after_linear", n, node=n.name)


def weights_mul(f, g, n, op, rows_in):
    """rows * (routing weights of each row)."""
    if len(rows_in) != 1:
        return None
    other = n.args[1] if n.args[0] is rows_in[0] else n.args[0]
    ro = f.r(other)
    w = row_weights(f, g, other, ro)
    if w is not None and g.input_weights is not None:   # the input is weighted already (Llama 4 form)
        return g.note("weights_twice")
    if w is not None:
        if ro is None or ro.kind != "routing":
            f.set(other, "wview", g)
        if g.weighted_at is not None:
            g.note("weights_twice")
        if g.family == "sorted" and not g.linears and weights_on_input(f, g, n, rows_in[0], w):
            return DONE   # before the expert's first linear, on its input rows
        g.weights, g.weighted_at = w, g.step_of[rows_in[0]]
        g.step_of[n] = g.step_of[rows_in[0]]
        f.set(n, "rows", g)
        return DONE
    if ro is not None and ro.kind == "routing":
        return g.note("routing_matrix_layout")
    if g.family == "dense" and isinstance(other, fx.Node) and not shared_ok(other):
        if _top_k_matrix(_this_layer(other)):
            return g.note("routing_matrix_form", other, node=other.name)   # top-k ids, another spelling
        return g.note("soft_moe", other, node=other.name)


# casts that change only the dtype of the rows before the routing weights scale them
_INPUT_CASTS = {"to", "float", "double", "half", "bfloat16", "type", "contiguous"}


def weights_on_input(f, g, n, rows, w) -> bool:
    """rows * w before the expert's first linear, on the sorted input rows or on one cast of them
    (torchtitan's ``score_before_experts``: ``(rows.to(float32) * w[:, None]).to(x.dtype)``): the weights
    scale the expert input (``Router.scale_input``, each pair's weight; ``Router.input_dtype`` the cast
    the lowering replays before the product, which moves rows but not values). The product becomes the
    region's input rows, so the unscaled rows and the cast must have no other reader. False where that
    does not hold (a step other than a cast before it: expert(x) * w is not expert(x * w)); the caller
    then takes the weights as applied after that step (``weights_before_last_op`` once a step follows)."""
    if len(g.steps) > 1 or g.step_of.get(rows) != len(g.steps) - 1:
        return False
    if g.steps:
        st, v = g.steps[0], val(rows)
        if st.target not in _INPUT_CASTS or st.args[:1] != (("in",),) or _reads_slot(st.args[1:]) \
                or _reads_slot(st.kwargs) or not (isinstance(v, torch.Tensor) and v.is_floating_point()) \
                or v.device != val(g.x).device:
            return False
    held = set(g.step_of)
    if any(set(m.users) - held - {n} for m in held):   # the unscaled rows read elsewhere too
        return False
    g.input_weights, g.input_dtype = w, (val(rows).dtype if g.steps else None)
    g.steps.clear()
    for m in held:
        g.step_of[m] = -1
    g.step_of[n] = -1
    f.set(n, "rows", g)
    return True


def _reads_slot(x) -> bool:
    """An encoded step operand that reads an operand slot (a tensor besides the rows)."""
    return isinstance(x, tuple) and bool(x) and (x[0] == "slot" or any(_reads_slot(i) for i in x))


_PLACES = {"scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "one_hot",
           "index_put", "index_put_", "setitem"}
_COMPARES = {"ge", "gt", "le", "lt", "eq", "ne"}
_SELECTS = {"topk", "kthvalue", "sort", "argsort", "argmax", "amax"}


def _this_layer(matrix: fx.Node) -> set[fx.Node]:
    """``matrix`` and what it is computed from, back to the products with a weight (a router's Linear,
    which reads the layer's input): not into the layers before (an earlier sparse layer's top-k is not
    this one's). Products of values computed in the layer (``einsum(one_hot(ids), w)``) are walked."""
    return ancestors([matrix], stop=lambda n: (canon(n) or "") in MATMULS
                     and any(a.op in ("placeholder", "get_attr") for a in n.all_input_nodes))


def _top_k_matrix(nodes: set[fx.Node]) -> bool:
    """A routing matrix computed from ``nodes`` keeps some experts of each token: values put at a
    router's ids (``scatter(1, ids, w)``, ``one_hot(ids)``, ``m[.., ids] = w``), or a mask that compares
    with a selection (``scores >= scores.topk(k).values[:, -1:]``). A ``max`` used to shift the logits of a
    softmax (``z - z.max(-1, keepdim=True).values``) selects nothing: that matrix is soft."""
    if any(_places_ids(n) for n in nodes):
        return True
    picks = {n for n in nodes if canon(n) in _SELECTS or canon(n) == "max" and (len(n.args) > 1 or "dim" in n.kwargs)}
    return bool(picks) and any(canon(n) in _COMPARES and ancestors([n]) & picks for n in nodes)


def _places_ids(n: fx.Node) -> bool:
    """``n`` puts values at a router's expert ids: ``scatter(1, ids, w)``, ``one_hot(ids)``, ``m[.., ids] = w``."""
    return canon(n) in _PLACES and any(router_root(a) is not None for a in n.all_input_nodes)


def cast_after_weights(f, g, n, op, rows_in):
    """A floating cast of the weighted rows (the rewrite sums in fp32 and casts once; an integer cast
    truncates each pair in eager)."""
    r0 = f.r(n.args[0])
    v = val(n)
    if op in CASTS and g.weighted_at is not None and r0 and r0.kind == "rows" \
            and isinstance(v, torch.Tensor) and v.is_floating_point():
        g.step_of[n] = g.step_of[n.args[0]]
        f.set(n, "rows", g)
        return DONE


def type_as_cast(f, g, n, op, rows_in):
    """rows.type_as(t): a cast to t's dtype (torchtitan's grouped experts end in ``.type_as(x)``). t is
    read for its dtype alone, so the step is ``rows.to(dtype)`` and t is no operand of the expert
    function; after the routing weights, a floating cast as ``cast_after_weights``."""
    a0, other = n.args[0], arg(n, 1, "other")
    r0, v, v0, vo = f.r(a0), val(n), val(a0), val(other)
    if not (r0 and r0.kind == "rows" and all(isinstance(t, torch.Tensor) for t in (v, v0, vo))) \
            or vo.device != v0.device:   # a cast to another device is no step of the expert function
        return None
    if g.weighted_at is not None:
        return cast_after_weights(f, g, n, "to", rows_in)
    f.step(g, n, args=(a0, vo.dtype), target="to")
    return DONE


def unsort_rows(f, g, n, op, rows_in):
    r0 = f.r(n.args[0])
    if r0 and r0.kind == "rows" and g.family != "dense" and unsort(f, g, n, op):
        return DONE


# ops whose second argument is a dim they reduce over, select along or scan: over dim 0 of dense rows
# [E, T, H] they combine the experts (clamp(h, 0), mul(h, 0) and the like are element-wise steps)
_OVER_DIM = {"sum", "nansum", "mean", "nanmean", "amax", "amin", "max", "min", "prod", "logsumexp", "std", "var",
             "norm", "median", "nanmedian", "select", "unbind", "cumsum", "cumprod", "cummax", "cummin", "softmax",
             "log_softmax", "argmax", "argmin", "any", "all", "count_nonzero", "mode", "kthvalue"}


def dense_sum(f, g, n, op, rows_in):
    """rows [E, T, H] -> .sum(0): the region's output, the sum over the experts. Any other reduction over
    the experts (mean, amax, prod, select, cumsum, ...), a keepdim or a dtype is not what the rewrite
    computes: refused."""
    a0, r0 = n.args[0], f.r(n.args[0])
    if g.family == "dense" and r0 and r0.kind == "rows" and op in _OVER_DIM \
            and arg(n, 1, "dim") in (0, (0,), -3, (-3,)):
        if op != "sum" or arg(n, 2, "keepdim") or arg(n, 3, "dtype") is not None \
                or not isinstance(va := val(a0), torch.Tensor) or va.dim() != 3:   # [E * T, H].sum(0): over tokens too
            return g.note("dense_not_sum", n, node=n.name, op=op)
        if g.weighted_at is None and g.input_weights is None:
            return g.note("dense_unrouted")
        g.output, g.end = n, g.step_of[a0]
        f.set(n, "out", g)
        return DONE


def fresh_like(f, g, n, op, rows_in):
    """zeros_like(rows) / new_zeros / empty_like: a new tensor that reads the rows' shape, not their values (the
    buffer of ``buf[perm] = rows``, helper-102): a role of no region."""
    if n.args and n.args[0] in rows_in:
        f.set(n, "fresh")
        return DONE
    return None


def elementwise(f, g, n, op, rows_in):
    """Element-wise steps, chunks and last-dim slices of the expert function (the table's default)."""
    a0, r0 = n.args[0], f.r(n.args[0])
    if op in ROWWISE_UNARY and r0 and r0.kind == "rows" and all(shared_ok(a) for a in n.all_input_nodes[1:]):
        if op == "glu" and not is_last_dim(arg(n, 1, "dim", -1), a0):   # glu(dim=0) pairs other rows / experts
            return None
        f.step(g, n)
        return DONE
    if op in ROWWISE_BINARY and all(shared_ok(a) for a in n.all_input_nodes if a not in rows_in):
        f.step(g, n)
        return DONE
    if op in ("chunk", "split") and r0 and r0.kind == "rows" and is_last_dim(arg(n, 2, "dim", 0), a0):
        f.step(g, n, kind="chunks")
        return DONE
    if op == "getitem" and r0 and r0.kind == "chunks" and as_int(n.args[1]) is not None:
        f.step(g, n)
        return DONE
    if op == "getitem" and r0 and r0.kind == "rows" and isinstance(n.args[1], tuple) and len(n.args[1]) == 2 \
            and (n.args[1][0] is Ellipsis or n.args[1][0] == slice(None)) and isinstance(n.args[1][1], slice):
        f.step(g, n)
        return DONE
