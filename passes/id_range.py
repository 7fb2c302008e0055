"""ids_nonnegative: whether every expert id a grouped region reads is provably >= 0 (finds, never mutates).

The sorted and batched forms read ids as rows of E groups: the rewrite (``route_permute``) drops an
id outside [0, E) from every group. Eager does not drop a negative one: ``torch.sort`` puts -1 first,
so every group boundary of the counts (``histc`` leaves it out) shifts and rows run through other
experts, and ``W[-1]`` is expert E - 1. Ids >= E (a sentinel E) sort last and fall in no group in
both. So a region is rewritten only where its ids cannot be negative::

    topk(..)[1] / .indices, max(x, dim)[1], argmax            -> >= 0 (the roots)
    views, copies, getitem of such ids; stack / cat of them   -> as their input
    casts                                                     -> as their input, where the new dtype
                                                                 holds every id (the dim a root picked)
    where(c, a, b), masked_fill(a, m, v), a + b, maximum      -> >= 0 when every operand is
    clamp(a, min=m >= 0), clamp_min(m >= 0), a % (c > 0)      -> >= 0
  and no in-place write on the way puts another value in (clamp_(max=...) and writes of numbers >= 0 do not).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .normalize import _index_source, arg, canon, id_bound, val
from .writes import written

_KEEP = {"view", "reshape", "flatten", "contiguous", "clone", "detach", "unsqueeze", "squeeze", "expand",
         "t", "transpose", "permute", "getitem", "select", "narrow", "repeat", "repeat_interleave"}
_CASTS = {"to", "long", "int", "short", "char", "byte", "type", "float", "double"}
_ALL_OPERANDS = {"where", "add", "iadd", "maximum", "masked_fill"}
_DEPTH = 24


def _number_ok(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def _holds(dtype, bound: int | None) -> bool:
    """Every id below ``bound`` keeps its value in ``dtype``."""
    if dtype in (torch.int64, torch.int32):
        return True
    if bound is None:
        return False
    if dtype.is_floating_point:
        return bound <= 2 ** 24 if dtype in (torch.float32, torch.float64) else bound <= 256
    return bound - 1 <= torch.iinfo(dtype).max


def _writes_keep(node: fx.Node) -> bool:
    """Every in-place write into ``node`` keeps its values >= 0."""
    for u in node.users:
        if written(u) is not node:
            continue
        op = (canon(u) or "").rstrip("_")
        if op in ("clamp", "clamp_min", "clamp_max"):   # clamp_(max=E - 1): transformers' EP sentinel clamp
            lo = arg(u, 1, "min", None) if op != "clamp_max" else None
            hi = arg(u, 2, "max", None) if op == "clamp" else arg(u, 1, "max", None) if op == "clamp_max" else None
            if (lo is None or _number_ok(lo)) and (hi is None or _number_ok(hi)):
                continue
        if op == "masked_fill" and _number_ok(arg(u, 2, "value", None)):
            continue
        if op == "setitem" and _number_ok(u.args[2] if len(u.args) > 2 else None):
            continue
        return False
    return True


def ids_nonnegative(ids, depth: int = _DEPTH) -> bool:
    """True if every value of the integer tensor ``ids`` is provably >= 0 (the module docstring)."""
    if _number_ok(ids):
        return True
    if not isinstance(ids, fx.Node) or depth <= 0 or not _writes_keep(ids):
        return False
    if _index_source(ids, ()) is not None:
        return True
    op = canon(ids) or ""
    src = ids.args[0] if ids.args else None
    if op in _KEEP and isinstance(src, fx.Node):
        return ids_nonnegative(src, depth - 1)
    if op in _CASTS and isinstance(src, fx.Node):
        v = val(ids)
        return isinstance(v, torch.Tensor) and _holds(v.dtype, id_bound(src)) and ids_nonnegative(src, depth - 1)
    if op in ("clamp", "clamp_min") and _number_ok(arg(ids, 1, "min", None)):
        return True
    if op in ("remainder", "fmod", "mod") or ids.op == "call_function" and ids.target is operator.mod:
        d = ids.args[1] if len(ids.args) > 1 else None
        return isinstance(d, int) and d > 0 and (op != "fmod" or ids_nonnegative(src, depth - 1))
    if op in ("stack", "cat", "concat", "concatenate", "hstack", "vstack") and isinstance(src, (list, tuple)):
        return bool(src) and all(ids_nonnegative(a, depth - 1) for a in src)
    if op in ("add", "iadd") and not _number_ok(ids.kwargs.get("alpha", 1)):
        return False
    if op in _ALL_OPERANDS or ids.op == "call_function" and ids.target in (operator.add, operator.iadd):
        operands = [a for a in ids.args[(1 if op == "where" else 0):] if not (op == "masked_fill" and a is ids.args[1])]
        return bool(operands) and all(ids_nonnegative(a, depth - 1) for a in operands)
    return False
