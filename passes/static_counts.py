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
