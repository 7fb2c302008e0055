"""The expert ids of a per-expert loop: the ``Ids`` rules of ``loop_dataflow.RULES`` (finds; never mutates).

    topk(..)[1] / .indices, max(x, dim)[1], argmax(x, dim)          -> Ids (the router's ids, K per token)
    sort(scores)[1][..., :k] / argsort(scores)[..., :k] / narrow   -> Ids (k < E: the first k of a sort of the
                                                                      scores, k distinct experts per token)
    Ids[..., :k'] / Ids.narrow(-1, 0, k'), k' < K                  -> Ids (Shazeer's topk(k + 1) then
                                                                      ``[:, :k]``: the first k' of each token's)
    views that keep (token, slot), casts that keep every id        -> Ids

The rewrite routes the ids and weights the graph computed (``route_permute`` of these ids): a slice keeps
each token's ids distinct, and the weights are whatever tensor the loop indexes with ``[tok, slot]``.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .expert_ids import leading_slice, sort_top_k
from .id_range import holds_ids, id_bound
from .loop_roles import STOP, Ids
from .normalize import canon, shape, val


def ids_of_topk(a, n, op, r0):
    """topk(...)[1], max(dim)[1] -> Ids."""
    a0 = n.args[0]
    if isinstance(a0, fx.Node) and canon(a0) in ("topk", "max") and n.args[1] == 1:
        s = shape(n)
        if s is not None and len(s) >= 1:   # [.., K] ids (routing on [B, S, H]): K is the last dim
            return Ids(n, s[-1] if len(s) >= 2 else 1, flat=len(s) == 1)


def ids_of_topk_attr(a, n, op, r0):
    """topk(...).indices -> Ids."""
    if isinstance(n.args[0], fx.Node) and canon(n.args[0]) == "topk" and n.args[1] == "indices":
        s = shape(n)
        return Ids(n, s[-1]) if s and len(s) == 2 else None


def ids_of_argmax(a, n, op, r0):
    s = shape(n)
    if s is not None and len(s) in (1, 2) and (len(s) == 1 or s[-1] == 1):
        return Ids(n, 1, flat=len(s) == 1)


def ids_reshape(a, n, op, r0):
    """A view of the ids that keeps (token, slot) = (p // K, p % K) of its flat pair p: flat [N], or
    [.., K]. Another last dim (ids [T, 2] viewed as [T/2, 4]) pairs other rows with tokens: no role."""
    s = shape(n)
    if not s:
        return STOP
    return Ids(r0.root, r0.k, flat=len(s) == 1) if len(s) == 1 or statically_known_true(s[-1] == r0.k) else None


def ids_cast(a, n, op, r0):
    """A cast of the ids that keeps every id's value (int64 / int32, or a narrower dtype that holds
    every id below E); else no role: ``ids.to(torch.uint8) == e`` with 300 experts compares wrapped
    ids, which the rewrite, routing the router's own ids, would not reproduce."""
    v = val(n)
    return r0 if isinstance(v, torch.Tensor) and holds_ids(v.dtype, id_bound(r0.root)) else None


def ids_of_sort(a, n, op, r0):
    """sort(scores)[1][..., :k], argsort(scores)[..., :k], their ``.narrow(-1, 0, k)``, k < E -> Ids."""
    hit, s = sort_top_k(n), shape(n)
    if hit is None or not s or len(s) < 2 or hit[1] != len(s) - 1:   # sorted along the ids' last dim (the experts)
        return None
    return Ids(n, hit[3])


def ids_slice(a, n, op, r0):
    """ids[..., :k'] of [.., K] ids, k' < K: each token's first k' experts -> Ids."""
    s = shape(n)
    if r0.flat or not s or len(s) < 2:
        return None
    k = leading_slice(n, len(s) - 1, len(s))
    return Ids(n, k) if k is not None and statically_known_true(k < r0.k) else None
