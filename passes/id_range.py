"""ids_nonnegative: whether every expert id a grouped region reads is provably >= 0 (finds, never mutates).

The sorted and batched forms read ids as rows of E groups: the rewrite (``route_permute``) drops an
id outside [0, E) from every group. Eager does not drop a negative one: ``torch.sort`` puts -1 first,
so every group boundary of the counts (``histc`` leaves it out) shifts and rows run through other
experts, and ``W[-1]`` is expert E - 1. Ids >= E (a sentinel E) sort last and fall in no group in
both. So a region is rewritten only where its ids cannot be negative::

    topk(..)[1] / .indices, max(x, dim)[1], argmax            -> >= 0 (the roots)
    sort(..)[1], argsort(..)                                  -> >= 0 (positions)
    views, copies, getitem of such ids; stack / cat of them   -> as their input
    casts                                                     -> as their input, where the new dtype
                                                                 holds every id (the dim a root picked)
    where(c, a, b), masked_fill(a, m, v), a + b, maximum      -> >= 0 when every operand is
    clamp(a, min=m >= 0), clamp_min(m >= 0), a % (c > 0)      -> >= 0
  and no in-place write on the way puts another value in (clamp_(max=...) and writes of numbers >= 0 do not).

``id_bound``: B with every id below B (the width a top-k / argmax picked from), withdrawn when an
in-place write may put a value outside [0, B) into the ids (a sentinel E: histc(max=E) counts it in
expert E - 1's bin in eager). Here, not in ``normalize``, because it reads ``writes``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .normalize import _SAME_VALUES, _index_source, arg, canon, dtype_view, shape, val
from .writes import all_written, per_graph, storage_base

_KEEP = {"view", "reshape", "flatten", "unflatten", "contiguous", "clone", "detach", "unsqueeze", "squeeze",
         "expand", "view_as", "reshape_as", "expand_as", "t", "transpose", "permute", "getitem", "select", "narrow",
         "repeat", "repeat_interleave", "split", "chunk", "unbind", "tensor_split"}
_CASTS = {"to", "long", "int", "short", "char", "byte", "type", "float", "double"}
_TUPLES = {"topk", "max", "min", "sort", "kthvalue", "mode", "aminmax", "median"}
_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_DEPTH = 24
_EXACT_INTS_UP_TO = {torch.float64: 2 ** 53, torch.float32: 2 ** 24, torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8}


def _number_ok(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def holds_ids(dtype, bound: int | None) -> bool:
    """Every id below ``bound`` keeps its value in ``dtype`` (int32 / int64 always; a narrower one
    only for a known bound: uint8 wraps 300 to 44, int8 to 44 - 256, bf16 rounds 257 to 256, fp16 2049 to 2048)."""
    if dtype in (torch.int64, torch.int32):
        return True
    if bound is None or not (dtype in _INTS or dtype.is_floating_point):
        return False
    if dtype.is_floating_point:   # every integer up to 2^(mantissa bits + 1) is exact
        return dtype in _EXACT_INTS_UP_TO and bound - 1 <= _EXACT_INTS_UP_TO[dtype]
    return bound - 1 <= torch.iinfo(dtype).max


def _name(n: fx.Node) -> str:
    """The op as written (``canon`` maps fmod and remainder alike)."""
    return n.target if n.op == "call_method" else getattr(n.target, "__name__", "")


def _clamp_ok(n: fx.Node, op: str) -> bool:
    """clamp / clamp_min / clamp_max whose bounds keep values >= 0 (a max alone keeps them)."""
    lo = arg(n, 1, "min", None) if op != "clamp_max" else None
    hi = arg(n, 2, "max", None) if op == "clamp" else arg(n, 1, "max", None) if op == "clamp_max" else None
    return (lo is None or _number_ok(lo)) and (hi is None or _number_ok(hi))


class _Writes:
    """Every in-place write of the graph, by the storage it writes (through views of it)."""

    def __init__(self, graph: fx.Graph):
        # the outputs of topk / max / sort are separate tensors (storage_base takes them for views of their
        # producer): a write to the values is not one to the indices
        # (not with out=: then they are the buffers given, which other nodes may write)
        self.memo: dict = {n: n for n in graph.nodes if canon(n) == "getitem" and isinstance(n.args[0], fx.Node)
                           and canon(n.args[0]) in _TUPLES and "out" not in n.args[0].kwargs}
        self.by_base: dict = {}
        self.unnamed: list = []   # writes whose tensors all_written cannot name: they may be anywhere
        for u in graph.nodes:
            targets = all_written(u)
            if targets is None:
                self.unnamed.append(u)
            for t in targets or ():
                self.by_base.setdefault(storage_base(t, self.memo), []).append(u)

    def _on(self, node: fx.Node) -> list:
        return self.by_base.get(storage_base(node, self.memo), []) + self.unnamed

    def keep(self, node: fx.Node) -> bool:
        """Every in-place write into ``node``'s storage (through any view) keeps values >= 0."""
        for u in self._on(node):
            op = (canon(u) or "").rstrip("_")
            if op in ("clamp", "clamp_min", "clamp_max") and _clamp_ok(u, op):
                continue   # clamp_(max=E - 1): transformers' expert-parallel sentinel clamp
            if op == "masked_fill" and _number_ok(arg(u, 2, "value", None)):
                continue
            if op == "setitem" and _number_ok(u.args[2] if len(u.args) > 2 else None):
                continue
            return False
        return True

    def keep_below(self, node: fx.Node, bound: int) -> bool:
        """Every in-place write into ``node``'s storage keeps its values in [0, bound): a clamp to
        [0, bound - 1], or a fill / masked fill / index write of an int in that range."""
        for u in self._on(node):
            op = canon(u)
            if op in ("clamp_", "clamp_max_") and _int_in(arg(u, 2 if op == "clamp_" else 1, "max"), 0, bound - 1) \
                    and (op == "clamp_max_" or _int_in(arg(u, 1, "min", 0), 0, bound - 1)):
                continue
            value = {"masked_fill_": lambda: arg(u, 2, "value"), "fill_": lambda: arg(u, 1, "value"),
                     "setitem": lambda: u.args[2] if len(u.args) > 2 else None}.get(op, lambda: None)()
            if not _int_in(value, 0, bound - 1):
                return False
        return True


def _writes_of(graph: fx.Graph) -> _Writes:
    """The graph's writes: one scan per graph while the passes only read it (``writes.per_graph``)."""
    return per_graph(graph, "id_range.writes", lambda: _Writes(graph))


def ids_nonnegative(ids) -> bool:
    """True if every value of the integer tensor ``ids`` is provably >= 0 (the module docstring)."""
    if _number_ok(ids):
        return True
    return isinstance(ids, fx.Node) and _nonnegative(ids, _writes_of(ids.graph), _DEPTH)


def _nonnegative(n, writes: _Writes, depth: int) -> bool:
    if _number_ok(n):
        return True
    if not isinstance(n, fx.Node) or depth <= 0 or not writes.keep(n):
        return False
    if _index_source(n, ()) is not None:
        return True
    op, src = canon(n) or "", n.args[0] if n.args else None
    if op == "argsort" or op == "getitem" and isinstance(src, fx.Node) and canon(src) == "sort" and n.args[1] == 1:
        return True   # a sort's indices: positions, >= 0
    def sub(x):
        return _nonnegative(x, writes, depth - 1)
    if op in _KEEP and isinstance(src, fx.Node):
        return not dtype_view(n) and sub(src)
    if op in _CASTS and isinstance(src, fx.Node):
        v = val(n)
        return isinstance(v, torch.Tensor) and holds_ids(v.dtype, id_bound(src)) and sub(src)
    if op in ("stack", "cat", "concat", "concatenate", "hstack", "vstack") and isinstance(src, (list, tuple)):
        return bool(src) and all(sub(a) for a in src)
    if op in ("clamp", "clamp_min", "clamp_max"):
        lo = arg(n, 1, "min", None) if op != "clamp_max" else None
        return _clamp_ok(n, op) and (_number_ok(lo) or sub(src))
    name = _name(n)
    if name in ("remainder", "mod", "__mod__") or n.target is operator.mod:   # Python's sign: the divisor's
        d = n.args[1] if len(n.args) > 1 else None
        return isinstance(d, int) and d > 0
    if name == "fmod":   # C's sign: the dividend's
        d = n.args[1] if len(n.args) > 1 else None
        return isinstance(d, int) and d > 0 and sub(src)
    if op == "where":
        if n.op == "call_method":   # ids.where(cond, other)
            return sub(src) and sub(arg(n, 2, "other", None))
        return sub(arg(n, 1, "input", None)) and sub(arg(n, 2, "other", None))
    if op == "masked_fill":
        return sub(src) and _number_ok(arg(n, 2, "value", None))
    if op in ("add", "iadd", "maximum") or n.target in (operator.add, operator.iadd):
        if not _number_ok(n.kwargs.get("alpha", 1)):
            return False
        return sub(src) and sub(arg(n, 1, "other", None))
    return False


def id_bound(ids: fx.Node) -> int | None:
    """B with every id of the integer tensor ``ids`` in [0, B): the size of the dim a ``topk`` /
    ``max(dim)`` / ``argmax`` picked from (through casts, copies and views), else None; also None when
    an in-place write anywhere in the graph reaches the storage of a tensor on that way and may put in
    another value (``sel[drop] = E``: a sentinel E that histc(max=E) counts as expert E - 1's)."""
    through = _SAME_VALUES | {"view", "reshape", "flatten"}
    n = _index_source(ids, through)
    if n is None or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    dim = arg(n, 2, "dim", -1) if canon(n) == "topk" else arg(n, 1, "dim", None)
    s = shape(n.args[0])
    bound = s[dim] if isinstance(dim, int) and s and isinstance(s[dim], int) else None
    if bound is None:
        return None
    way = [ids]
    while canon(way[-1]) in through and way[-1].args and isinstance(way[-1].args[0], fx.Node):
        way.append(way[-1].args[0])
    writes = _writes_of(ids.graph)
    return bound if all(writes.keep_below(n, bound) for n in way) else None


def _int_in(x, lo: int, hi: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi
