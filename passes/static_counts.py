"""find_static_bincounts: ``bincount`` calls over router ids whose length is known (finds, never mutates).

``torch.bincount(ids, minlength=E)`` has length max(E, largest id + 1): under data-dependent capture its
length is an unbacked size, and on CUDA the host reads the largest id to allocate the output, a host sync.
A rewritten region no longer reads such counts (its ops count rows on the device), but the user's code may
still, most often a load-balancing loss (``counts.float() / N * probs.mean(0)``). A call is listed when

    no weights, ``minlength`` a Python int E > 0,
    its ids provably in [0, B) with B <= E (``id_range``: a top-k / argmax over B scores, through views
    and casts, no in-place write putting another value in):

then its length is E and its counts those of a static-length histogram; ``lowering/static_counts.py``
computes it so (the same int64 values, no host read).

Graph before: ``c = torch.bincount(ids.flatten(), minlength=E)`` read by code outside any region.
Graph after:  unchanged (a finder); ``StaticBincount(node=c, ids=<flatten>, length=E)`` returned.

The loop's own counts too (review helper-111): ``counts.append(len(tok))`` per expert, then
``torch.tensor(counts, device=...)`` for the loss: each ``len`` is the size of a ``torch.where(mask)`` /
``nonzero(mask)`` output, which keeps that nonzero (a host sync) in the graph after its region is
rewritten. A ``torch.tensor`` of such sizes only, on the masks' device, is listed as
``StaticRowCounts(node, masks, dtype)``: the same values are ``count_nonzero(mask)`` of each mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .id_range import id_bound, ids_nonnegative
from .normalize import ASSERT_OPS, SIZE_QUERIES, arg, canon, val


@dataclass(frozen=True)
class StaticBincount:
    """A ``bincount`` call whose result is ``length`` counts of ``ids`` (every id in [0, length))."""
    node: fx.Node
    ids: fx.Node
    length: int


def find_static_bincounts(graph: fx.Graph) -> tuple[StaticBincount, ...]:
    """The graph's ``bincount`` calls with a provably static length that something other than a size
    query or a runtime assert reads (those go with the dead code)."""
    found = []
    for n in graph.nodes:
        if n.op not in ("call_function", "call_method") or canon(n) != "bincount":
            continue
        ids, weights, length = arg(n, 0, "input"), arg(n, 1, "weights"), arg(n, 2, "minlength", 0)
        v = val(ids) if isinstance(ids, fx.Node) else None
        if weights is not None or isinstance(length, bool) or not isinstance(length, int) or length <= 0 \
                or not isinstance(v, torch.Tensor) or v.dim() != 1 or v.dtype.is_floating_point:
            continue
        if not any(canon(u) not in SIZE_QUERIES | ASSERT_OPS for u in n.users):
            continue
        bound = id_bound(ids)
        if bound is not None and bound <= length and ids_nonnegative(ids):
            found.append(StaticBincount(n, ids, length))
    return tuple(found)


@dataclass(frozen=True)
class StaticRowCounts:
    """``torch.tensor([len(where(m)[j]), ...])`` (``node``): the same values are ``count_nonzero`` of each of
    ``masks`` (a 0-dim tensor when ``scalar``), as ``dtype``."""
    node: fx.Node
    masks: tuple[fx.Node, ...]
    dtype: torch.dtype
    scalar: bool


def _selection_mask(size: fx.Node) -> fx.Node | None:
    """M when ``size`` is dim 0 of ``where(M)[j]``, ``nonzero(M)`` or ``nonzero(M, as_tuple=True)[j]``."""
    if canon(size) != "sym_size" or arg(size, 1, "dim", None) != 0 or not isinstance(size.args[0], fx.Node):
        return None
    x = size.args[0]
    if canon(x) == "getitem" and isinstance(x.args[0], fx.Node):
        sel = x.args[0]
        one_arg_where = canon(sel) == "where" and len(sel.args) == 1 and not sel.kwargs
        if not (one_arg_where or canon(sel) == "nonzero" and arg(sel, 1, "as_tuple", False) is True):
            return None
    elif canon(x) == "nonzero" and not arg(x, 1, "as_tuple", False):
        sel = x
    else:
        return None
    mask = sel.args[0]
    return mask if isinstance(mask, fx.Node) and isinstance(val(mask), torch.Tensor) else None


def find_static_row_counts(graph: fx.Graph) -> tuple[StaticRowCounts, ...]:
    """The graph's ``torch.tensor`` calls made of selection sizes alone, on their masks' device."""
    found = []
    for n in graph.nodes:
        if n.op != "call_function" or canon(n) != "tensor" or len(n.args) != 1:
            continue
        items, scalar = (n.args[0], False) if isinstance(n.args[0], (list, tuple)) else ([n.args[0]], True)
        masks = [_selection_mask(i) if isinstance(i, fx.Node) else None for i in items]
        out = val(n)
        if not masks or None in masks or not isinstance(out, torch.Tensor) or out.requires_grad \
                or set(n.kwargs) - {"dtype", "device", "requires_grad", "pin_memory"} or n.kwargs.get("pin_memory"):
            continue
        if any(val(m).device != out.device for m in masks):
            continue   # counts moved to another device (the CPU): a copy to the host either way
        found.append(StaticRowCounts(n, tuple(masks), out.dtype, scalar))
    return tuple(found)


def find_static_counts(graph: fx.Graph) -> tuple:
    """Both kinds, in graph order per kind: bincounts, then tensors of selection sizes."""
    return find_static_bincounts(graph) + find_static_row_counts(graph)
