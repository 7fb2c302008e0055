"""Lowering of the region variants that ``passes/region.py`` marks with a flag (called by ``region.py``).

    Router.per_expert     w [T, E] (zero off the selection)  ->  w_TK = gather(w, 1, ids)
    Router.scale_input    h0 = permute_rows(x, ...)[.to(input_dtype)] * w_TK.reshape(-1)[perm][:, None]
                          (before the expert's first op, as the model multiplies its input), combined
                          with weight 1
    AccumulateInPlace.overwrite  out = where(ids in [0, E) per token, combined, base)   (top-1 only:
                          a routed row is replaced, an unrouted one keeps the base, as `out[idx] = ...`)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from moe_compile.passes.normalize import val
from moe_compile.passes.region import Router

from .graph_edit import GraphBuilder


def pair_weights(b: GraphBuilder, router: Router) -> fx.Node:
    """The routing weight of each (token, slot) pair, [T, K] (or as the graph holds it)."""
    w = router.weights
    if router.per_expert:
        ids = router.ids if val(router.ids).dim() == 2 else b.method("reshape", router.ids, -1, router.top_k)
        w = b.fn(torch.gather, w, 1, ids)
    return w


def scale_rows(b: GraphBuilder, router: Router, rows: fx.Node, perm: fx.Node,
               weights: fx.Node | None = None) -> fx.Node:
    """The permuted input rows times their pair's weight (``scale_input``), else ``rows`` as they are.
    ``weights``: the pair weights to take instead of the router's (expert parallelism: every rank's)."""
    if not router.scale_input or router.weights is None:
        return rows
    if router.input_dtype is not None:   # (rows.to(float32) * w): the model's cast, before the product
        rows = b.method("to", rows, router.input_dtype)
    w = b.method("reshape", weights if weights is not None else pair_weights(b, router), -1)
    return b.fn(operator.mul, rows, b.method("unsqueeze", b.fn(operator.getitem, w, perm), -1))


def combine_weights(b: GraphBuilder, router: Router) -> fx.Node | None:
    """The weights unpermute_combine multiplies by: None for 1 (unweighted, or weights on the input)."""
    if router.weights is None or router.scale_input:
        return None
    return pair_weights(b, router)


def keep_unrouted(b: GraphBuilder, router: Router, base: fx.Node, out: fx.Node) -> fx.Node:
    """Top-1 overwrite over a base: rows of tokens routed to an expert in [0, E) are ``out``, the
    others keep ``base`` (their gradient goes to the base, as in the model)."""
    ids = b.method("reshape", router.ids, -1, 1)
    routed = b.fn(operator.and_, b.fn(operator.ge, ids, 0), b.fn(operator.lt, ids, router.num_experts))
    return b.fn(torch.where, routed, out, base)
