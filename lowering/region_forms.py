"""Lowering of the region variants that ``passes/region.py`` marks with a flag (called by ``region.py``).

    Router.per_expert     w [T, E] (zero off the selection)  ->  w_TK = gather(w, 1, ids)
    Router.scale_input    h0 = permute_scale(x, perm, inv, offs, w_TK, dtype): the gathered rows times
                          their pair's weight in one pass (before the expert's first op, as the model
                          multiplies its input), combined with weight 1. dtype: the product's
                          (promote(input_dtype or x, w)), or that of a cast of the product that is the
                          expert's first step (torchtitan's (rows.float() * w).to(bf16)), folded in;
                          x as a saved_copy where it shares storage with a graph input or output (the
                          backward reads it); a narrowing input_dtype keeps
                          permute_rows(x)[.to(input_dtype)] * w[perm]
    AccumulateInPlace.overwrite  out = where(ids in [0, E) per token, combined, base)   (top-1 only:
                          a routed row is replaced, an unrouted one keeps the base, as `out[idx] = ...`)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from moe_compile.kernels import ops as _ops  # noqa: F401  (registers torch.ops.moe_compile.*)
from moe_compile.passes.normalize import val
from moe_compile.passes.region import Region, Router, Step
from moe_compile.passes.writes import storage_base

from .graph_edit import GraphBuilder


def pair_weights(b: GraphBuilder, router: Router) -> fx.Node:
    """The routing weight of each (token, slot) pair, [T, K] (or as the graph holds it)."""
    w = router.weights
    if router.per_expert:
        ids = router.ids if val(router.ids).dim() == 2 else b.method("reshape", router.ids, -1, router.top_k)
        w = b.fn(torch.gather, w, 1, ids)
    return w


_CAST_METHODS = {"bfloat16": torch.bfloat16, "half": torch.float16, "float": torch.float32, "double": torch.float64}


def reads_rows(x) -> bool:
    """A step's arguments read the expert's input rows (``("in",)``, nested anywhere)."""
    return x == ("in",) or (isinstance(x, (list, tuple)) and any(reads_rows(i) for i in x))


def cast_step_dtype(step: Step) -> torch.dtype | None:
    """The dtype a plain cast step casts its operand to (``x.to(dtype)``, ``x.to(dtype=dtype)``,
    ``x.type(dtype)``, ``x.bfloat16()``: nothing else), else None."""
    if step.op != "call_method" or not step.args:
        return None
    if step.target in ("to", "type"):
        rest = step.args[1:] + tuple(v for key, v in step.kwargs if key == "dtype")
        plain = all(key == "dtype" for key, _ in step.kwargs) and len(rest) == 1
        return rest[0] if plain and isinstance(rest[0], torch.dtype) else None
    return _CAST_METHODS.get(step.target) if len(step.args) == 1 and not step.kwargs else None


def _cast_of_rows(step: Step) -> torch.dtype | None:
    """The dtype of a step that only casts the region's rows to a float dtype (``rows.to(dtype)``,
    ``rows.bfloat16()``; not ``type``)."""
    if step.linear is not None or step.args[:1] != (("in",),) or step.target == "type":
        return None
    dtype = cast_step_dtype(step)
    return dtype if dtype is not None and dtype.is_floating_point else None


def input_rows(b: GraphBuilder, region: Region, x: fx.Node, perm: fx.Node, inv: fx.Node, offs: fx.Node,
               weights: fx.Node | None = None) -> tuple[fx.Node, int]:
    """The expert input rows, and how many of the expert's steps they already hold (0, or 1: a cast of
    the scaled rows folded in). ``weights``: the [T, K] pair weights to take instead of the router's
    (expert parallelism: every rank's)."""
    router, k = region.router, region.router.top_k
    if not router.scale_input or router.weights is None:
        return b.fn(torch.ops.moe_compile.permute_rows.default, x, perm, inv, offs, k), 0
    cast, x_dtype = router.input_dtype, val(x).dtype
    if cast is not None and torch.promote_types(x_dtype, cast) != cast:   # the model rounds x before the product
        rows = b.fn(torch.ops.moe_compile.permute_rows.default, x, perm, inv, offs, k)
        return scale_rows(b, router, rows, perm, weights), 0
    w = weights if weights is not None else pair_weights(b, router)
    w = w if val(w).dim() == 2 else b.method("reshape", w, -1, k)
    product = torch.promote_types(cast or x_dtype, val(w).dtype)   # eager's rows * w: rounded to this dtype
    steps, out, done = region.experts.steps, product, 0
    # a cast of an fp32 / fp64 product: the kernel's product is that one, rounded once to the cast's dtype
    folded = _cast_of_rows(steps[0]) if steps and product in (torch.float32, torch.float64) else None
    if folded is not None and not any(reads_rows((st.args, st.kwargs)) for st in steps[1:]):
        out, done = folded, 1
    return b.fn(torch.ops.moe_compile.permute_scale.default, _kept_input(b, x), perm, inv, offs, w, out), done


def _kept_input(b: GraphBuilder, x: fx.Node) -> fx.Node:
    """x as permute_scale keeps it for its backward: a copy ([T, H], not the [T*K, H] rows eager keeps)
    where x shares storage with an input or an output of the graph. The caller may write those in place
    between the forward and the backward; eager's gradient reads its own copy of the gathered rows, and a
    compiled backward reading x would read the written values (found by review: the router's gradient
    2.0 off, no error)."""
    memo: dict = {}
    base = storage_base(x, memo)
    outputs: list = []
    fx.node.map_arg(next(n for n in reversed(x.graph.nodes) if n.op == "output").args, outputs.append)
    if base.op == "placeholder" or any(storage_base(o, memo) is base for o in outputs):
        return b.fn(torch.ops.moe_compile.saved_copy.default, x)   # a clone would be recomputed from x
    return x


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
