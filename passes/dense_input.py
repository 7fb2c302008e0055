"""Dense experts whose routing weights scale the expert INPUT (Llama 4): rules of the all-pairs finder.

Legend: T tokens, K top-k, E experts, H width. Before (transformers' Llama4TextMoe)::

    s, ids = topk(logits, K); r = sigmoid(full_like(logits, -inf).scatter_(1, ids, s))   # [T, E], 0 off the top-k
    h = x.repeat(E, 1) * r.transpose(0, 1).reshape(-1, 1)                               # [E * T, H]
    h = h.view(E, -1, H); h = bmm(h, W1[E, H, 2I]) ... chunk, up * silu(gate) ... bmm(h, W2[E, I, H])
    out = h.view(-1, H).reshape(E, -1, H).sum(0)

Every token runs through every expert; an unselected pair has weight exactly 0 (sigmoid(-inf)), so
its row is expert(0). The routed rewrite computes only the K selected pairs, weighting each pair's
input row before the expert (``Router.scale_input``; expert(x * w) is not w * expert(x)), and is
exact when expert(0) = 0 with zero intermediates (checked by ``legality.input_weights``) and the
unselected entries are gradient sinks (sigmoid's derivative at -inf is 0; ``zeros.scatter``'s zeros
are constants). Roles: ``prerouting`` (the -inf scatter), ``routing_m`` (the [T, E] matrix and its
views, orientation "te" -> "et" -> "n1" = [E * T, 1]).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from .grouped_state import CASTS, DONE, as_int, swaps_2d
from .normalize import arg, canon, distinct_per_row, shape, val


def prerouting(f, n, op, a0, r0, rk):
    """full_like(logits, -inf).scatter_(1, ids, vals): -inf off the selection."""
    if rk is not None or arg(n, 1, "dim") != 1 or not isinstance(a0, fx.Node) \
            or canon(a0) not in ("full_like", "full", "new_full"):
        return None
    fill = a0.args[-1] if canon(a0) != "full" else arg(a0, 1, "fill_value")
    ids, src = arg(n, 2, "index"), arg(n, 3, "src")
    if fill == -math.inf and isinstance(ids, fx.Node) and isinstance(src, fx.Node) \
            and not val(ids).is_floating_point():
        f.set(n, "prerouting", None, (ids, src))
        return DONE


def routing_of_sigmoid(f, n, op, a0, r0, rk):
    """sigmoid(prerouting): the [T, E] matrix, exactly 0 (and with zero derivative) off the selection."""
    if rk == "prerouting":
        f.set(n, "routing_m", None, (r0.info[0], n, "te"))
        return DONE


def cast_keeps(f, n, op, a0, r0, rk):
    """A cast keeps the routing matrix; the cast node becomes the matrix pair_weights gathers from, so
    only a cast of the [T, E] matrix itself (not of its transpose or a view) keeps the role."""
    if rk == "routing_m" and r0.info[2] != "te":
        return None
    if rk in ("prerouting", "routing_m") and op in CASTS:
        info = r0.info if rk == "prerouting" else (r0.info[0], n, r0.info[2])
        f.set(n, rk, None, info)
        return DONE


def routing_m_view(f, n, op, a0, r0, rk):
    """routing.transpose(0, 1) -> "et"; .reshape(-1, 1) of "et" -> "n1" (pair p = e * T + t)."""
    if rk != "routing_m":
        return None
    ids, m, orient = r0.info
    s, s0 = shape(n), shape(a0)
    if op in ("t", "transpose", "permute") and orient == "te" and s0 and len(s0) == 2 \
            and (op == "t" or swaps_2d(n, op)):   # not permute(0, 1) / transpose(0, 0): the same shape at T == E
        f.set(n, "routing_m", None, (ids, m, "et"))
    elif op in ("reshape", "view") and orient == "et" and s and len(s) == 2 and s[1] == 1 and s[0] == s0[0] * s0[1]:
        f.set(n, "routing_m", None, (ids, m, "n1"))
    return DONE


def enter_repeat(f, n, op, a0, r0, rk):
    """x.repeat(E, 1): every token once per expert, expert-major [E * T, H]."""
    reps = n.args[1:] if len(n.args) > 2 else (n.args[1] if len(n.args) > 1 else ())
    v = val(a0) if isinstance(a0, fx.Node) else None
    if rk is None and isinstance(v, torch.Tensor) and v.dim() == 2 and v.is_floating_point() \
            and len(reps) == 2 and as_int(reps[0]) and reps[1] == 1:
        g = f.group("dense", n)
        g.x, g.e = a0, reps[0]
        g.step_of[n] = -1
        f.set(n, "rows", g)
        return DONE


def input_weights(f, g, n, op, rows_in):
    """rows [E * T, H] * routing "n1": the weights scale the expert input (before any step)."""
    if g.family != "dense" or len(rows_in) != 1:
        return None
    other = n.args[1] if n.args[0] is rows_in[0] else n.args[0]
    ro = f.r(other)
    if not (ro and ro.kind == "routing_m" and ro.info[2] == "n1"):
        return None
    ids, matrix, _ = ro.info
    if g.step_of.get(rows_in[0]) != -1 or g.input_weights is not None or g.weighted_at is not None:
        return g.note("weights_twice") if g.input_weights is not None else g.note("weights_before_last_op", n)
    if not distinct_per_row(ids):
        return g.note("ids_may_repeat", ids, node=ids.name)
    g.input_weights, g.ids, g.k = matrix, ids, shape(ids)[1]
    g.step_of[n] = -1
    f.set(n, "rows", g)
    return DONE


def dense_view(f, g, n, op, rows_in):
    """[E * T, H] <-> [E, T, H] views of dense rows: the same rows (no step)."""
    a0, r0 = n.args[0], f.r(n.args[0])
    s, s0 = shape(n), shape(a0)
    if g.family != "dense" or not (r0 and r0.kind == "rows") or not s or not s0 or s[-1] != s0[-1] \
            or math.prod(s) != math.prod(s0) or g.e is None:
        return None
    if (len(s) == 3 and s[0] == g.e) or (len(s) == 2 and len(s0) == 3 and s0[0] == g.e):
        g.step_of[n] = g.step_of[a0]
        f.set(n, "rows", g)
        return DONE


ROUTING = (
    (("scatter", "scatter_"), None, prerouting),
    (("sigmoid",), "prerouting", routing_of_sigmoid),
    (tuple(CASTS), None, cast_keeps),
    (("t", "transpose", "permute", "reshape", "view"), "routing_m", routing_m_view),
    (("repeat",), None, enter_repeat),
)
ROW_RULES = {"mul": (input_weights,), "view": (dense_view,), "reshape": (dense_view,)}
