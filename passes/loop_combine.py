"""Combine rules of the per-expert-loop dataflow: how an expert's output is written into an accumulator.

Rule of ``loop_dataflow.RULES`` for ``index_add_`` / ``index_add``, ``scatter_add_``,
``index_put_(accumulate=True)`` and ``setitem`` (``acc[idx] += c``, and ``acc[idx] = c`` for top-1).
Each accepted write records the expert's contribution on the accumulator's ``Storage``; a write the
rewrite cannot reproduce records a ``region.Finding`` there instead::

    acc.index_add_(0, tok, c)                    tok and c of the same where(ids == e), dim 0, alpha 1
    acc.scatter_add_(0, tok[:, None].expand(..), c)
    acc.index_put_((tok,), c, accumulate=True)
    acc[tok] = acc[tok] + c                      (Dynamo's spelling of acc[tok] += c)
    acc[tok] = c | acc[mask] = c                 top-1 only, acc starting as zeros (a sum of one term),
                                                 or as a base (out = x.clone(): routed rows replaced)

and the reads of an accumulator as an expert's rows (``expert_rows``): half-accumulated at top-k > 1
(``partial_read``), or the next layer's rows gathered from it directly (noted in ``Storage.row_reads``:
``loop_regions`` refuses them as ``rows_of_next_layer``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .loop_roles import (STOP, AccRead, AccSum, Contrib, Index, Rows, ScatterIndex, Storage, TokMask, as_contrib,
                         expert_key)
from .normalize import arg, canon, same_shape, val, where_in_user_code
from .region import Finding
from .writes import storage_base


def acc_read(a, n, op, r0):
    """acc[idx] read as the left side of ``acc[idx] += contrib``."""
    a0 = n.args[0]
    if isinstance(a0, fx.Node) and r0 is None and _is_acc_read(a, n):
        s = a.storage(a0)
        if s is not None:
            a.pattern.add(n)
            return AccRead(s, n.args[1], s.version)


def _is_acc_read(a, n: fx.Node) -> bool:
    """getitem(acc, idx) whose sum with a contribution is written back: acc[idx] += c."""
    if not isinstance(a.r(n.args[1]), (Index, TokMask)):
        return False
    for add in n.users:
        if canon(add) in ("add", "iadd"):
            for st in add.users:
                if canon(st) == "setitem" and st.args[0] is n.args[0] and st.args[1] is n.args[1] \
                        and st.args[2] is add:
                    return True
    return False


def acc_sum(a, n, op, r0):
    """acc[idx] + contrib (about to be written back with setitem)."""
    rs = [a.r(x) for x in n.args[:2]]
    reads = [x for x in rs if isinstance(x, AccRead)]
    if len(reads) == 1:
        other = rs[1] if rs[0] is reads[0] else rs[0]
        c = as_contrib(n.args[1] if rs[0] is reads[0] else n.args[0], other)
        if c is not None:
            return AccSum(reads[0], c)


def combine(a, n: fx.Node, op: str, r0):
    """``a``: the running ``loop_dataflow.Analysis``."""
    acc = n.args[0]
    if not isinstance(acc, fx.Node):
        return STOP
    s = a.storage(acc)
    if s is None:
        return STOP
    if s.overwrite and op != "setitem":
        return a.refuse_write(s, n, "overwrite_then_add", None, acc=s.alloc.name)
    if op in ("index_add_", "index_add", "scatter_add_", "index_put_"):
        src = arg(n, 2, "values") if op == "index_put_" else arg(n, 3, "src" if op == "scatter_add_" else "source")
        mismatch = _dtypes(acc, src)
        if mismatch:   # eager raises ("self (Float) and source (Double) must have the same scalar type")
            return a.refuse_write(s, n, "accumulator_dtype", as_contrib(src, a.r(src)), op=op, **mismatch)
    if op in ("index_add_", "index_add"):
        dim, index, src = arg(n, 1, "dim"), arg(n, 2, "index"), arg(n, 3, "source")
        ri, c = a.r(index), as_contrib(src, a.r(src))
        if dim != 0 or n.kwargs.get("alpha", 1) != 1 or not isinstance(ri, Index) or ri.kind != "tok" \
                or c is None or c.rows.e != ri.e or c.rows.enum != ri.enum:
            return _unsupported(a, s, n, c, ri, "index_add_")
        return _add(a, s, n, c, inplace=op == "index_add_")
    if op == "scatter_add_":
        dim, index, src = arg(n, 1, "dim"), arg(n, 2, "index"), arg(n, 3, "src")
        ri, c = a.r(index), as_contrib(src, a.r(src))
        if dim != 0 or not isinstance(ri, ScatterIndex) or c is None or c.rows.e != ri.e or c.rows.enum != ri.enum \
                or not _full_rows(acc, index, src):
            return _unsupported(a, s, n, c, ri, "scatter_add_")
        return _add(a, s, n, c, inplace=True)
    if op == "index_put_":
        indices, values = arg(n, 1, "indices"), arg(n, 2, "values")
        accumulate = arg(n, 3, "accumulate", False)
        ri, c = a.r(indices[0]) if len(indices) == 1 else None, as_contrib(values, a.r(values))
        if not accumulate or not isinstance(ri, (Index, TokMask)) or c is None:
            return _unsupported(a, s, n, c, ri, "index_put_")
        return _add(a, s, n, c, inplace=True)
    # setitem(acc, index, value)
    index, value = n.args[1], n.args[2]
    ri, rv = a.r(index), a.r(value)
    mismatch = _dtypes(acc, value)   # acc[tok] = acc[tok] + y (not +=), acc[tok] = y: index_put_ raises
    if mismatch:
        return a.refuse_write(s, n, "accumulator_dtype", rv.contrib if isinstance(rv, AccSum) else
                              as_contrib(value, rv), op="setitem", **mismatch)
    if isinstance(rv, AccSum) and rv.read.storage is s and rv.read.index is index and rv.read.version == s.version:
        if s.overwrite:
            return a.refuse_write(s, n, "overwrite_then_add", rv.contrib, acc=s.alloc.name)
        a.pattern.add(value)
        return _add(a, s, n, rv.contrib, inplace=True)
    c = as_contrib(value, rv)
    top1 = c is not None and isinstance(ri, (Index, TokMask)) and ri.ids.k == 1 \
        and getattr(ri, "kind", "tok") in ("tok", "pair")
    if top1 and s.base is None:
        return _add(a, s, n, c, inplace=True)  # top-1: each token written by one expert only
    if top1 and (s.overwrite or not s.contribs):
        s.overwrite = True  # out = x.clone(); out[idx] = c: a routed row replaced, an unrouted one kept
        return _add(a, s, n, c, inplace=True)
    if top1:
        return a.refuse_write(s, n, "overwrite_then_add", c, acc=s.alloc.name)
    if c is not None and not _edits_expert_input(a, s, c):
        return a.refuse_write(s, n, "overwrite_topk", c)
    return STOP


def _full_rows(acc, index, src) -> bool:
    """scatter_add_(0, index, src) adds whole rows: index and src [n, H] with H the accumulator's width.
    A narrower index (``tok[:, None].expand(-1, H // 2)``) adds only its columns in eager (review helper-105:
    the rewrite added whole rows, or returned rows of the experts' narrower width)."""
    va, vi, vs = val(acc), val(index), val(src)
    if not all(isinstance(v, torch.Tensor) and v.dim() == 2 for v in (va, vi, vs)):
        return False
    return same_shape(vi.shape, vs.shape) and same_shape(vi.shape[1:], va.shape[1:])


def _row_width(acc, out) -> bool:
    """The expert's rows have the accumulator's row shape: rows of another width broadcast in eager
    (``out[tok] += y`` with y [n, 1] adds y to every column; review of helper-105's finding), while the
    rewrite's combine returns rows of the experts' width."""
    va, vo = val(acc), val(out)
    return isinstance(va, torch.Tensor) and isinstance(vo, torch.Tensor) and va.dim() >= 1 and vo.dim() >= 1 \
        and same_shape(va.shape[1:], vo.shape[1:])


def _dtypes(acc, src) -> dict:
    """{"src": .., "dtype": ..} when the added values' dtype is not the accumulator's, else {}."""
    va, vs = val(acc), val(src)
    if getattr(va, "dtype", None) is None or getattr(vs, "dtype", None) in (None, va.dtype):
        return {}
    return {"src": str(vs.dtype).removeprefix("torch."), "dtype": str(va.dtype).removeprefix("torch.")}


def _edits_expert_input(a, s: Storage, c: Contrib) -> bool:
    """``xin[tok] = f(xin[tok])`` while the experts add their outputs into another tensor: an edit of
    the experts' input (its row-op finding is the reason), not an expert output that overwrites."""
    return c.rows.x in (s.alloc, *s.aliases) and any(
        t is not s and any(d.rows.x is c.rows.x for d in t.contribs.values()) for t in a.storages)


def _unsupported(a, s: Storage, n: fx.Node, c, ri, op: str):
    """A write the rewrite cannot reproduce; when its value is no expert output because of an op on
    that expert's rows (``x[tok].detach()``), that op is the reason, not the write."""
    found = a.row_findings.get(expert_key(ri)) if c is None else None
    if found:
        s.findings.append(found[0])
        return STOP
    return a.refuse_write(s, n, "unsupported_write", c, op=op)


def _add(a, s: Storage, n: fx.Node, c: Contrib, inplace: bool):
    if not _row_width(n.args[0], c.out):
        return a.refuse_write(s, n, "unsupported_write", c, op=canon(n) or "?")
    e = c.rows.e
    if e in s.contribs:
        return a.refuse_write(s, n, "expert_added_twice", None, expert=e, acc=s.alloc.name)
    if not inplace:  # functional index_add: a new tensor carrying the old contributions
        new = Storage(alloc=s.alloc, base=s.base, contribs=dict(s.contribs), mutations=list(s.mutations),
                      version=s.version)
        s.forked = True
        a.storages.append(new)
        s = new
    s.contribs[e] = c
    s.mutations.append(n)
    s.version += 1
    s.aliases.add(n)
    a.storage_of[n] = s
    a.pattern.add(n)
    return ("acc", s)


def expert_rows(a, n: fx.Node, src: fx.Node, ids, e: int, enum) -> Rows:
    """Expert e's rows of ``src``. Read from an accumulator other experts already added to, at top-k > 1,
    they hold those experts' outputs (``out = x.clone(); out[tok] += w * expert(out[tok])``), which the
    rewrite, reading the input once, would not see: the accumulator is refused. ``src`` may be a view of
    it (``xin = out.view(T, H)``, ``out[:]``, ``out.detach()``): the same storage.

    Rows that the next MoE layer's experts gather from the accumulator itself (another router's, or
    expert e's of the same router after expert e already added its output here) are noted
    (``row_reads``): read once every expert has added (the layers one after the other), they are the
    finished sum's readers, which the rewrite rewires (and ``region_chain`` gives the next layer's
    own rewrite the new sum); read before (the layers interleaved), they would see a partial sum
    that the rewrite never makes: ``rows_of_next_layer`` (``loop_regions``). Through a view taken
    after the sum (``x = out.reshape(-1, H)`` in the next layer), the view is one of the
    accumulator's readers already."""
    s, view = a.storage_of.get(src), None
    if s is None:
        s = a.storage_of.get(storage_base(src, {}))
        view = _first_view(a, s, src) if s is not None else None
    if s is not None and s.version > 0:
        at = where_in_user_code(n) or "?"
        if e in s.contribs or any(c.rows.ids.root is not ids.root for c in s.contribs.values()):
            if view is None or (view, s.version) not in s.readers:
                s.row_reads.append((n, s.version))
        elif ids.k != 1:
            s.findings.append(Finding.of("partial_read", n, reader=n.name, at=at))
    return Rows(src, ids, e, enum)


def _first_view(a, s: Storage, src: fx.Node) -> fx.Node | None:
    """The node of ``src``'s view chain that reads accumulator ``s`` itself."""
    n = src
    while isinstance(n, fx.Node) and n.args and isinstance(n.args[0], fx.Node):
        if a.storage_of.get(n.args[0]) is s:
            return n
        n = n.args[0]
    return None
