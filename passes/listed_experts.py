"""The ``listed`` evidence of ``passes/unclaimed.py`` (finds, never mutates): matmuls of nn.ModuleList
elements below a router's block on rows or weights taken from its ids (``x[tok[:, e]]`` of expert-choice
routing) or multiplied by a tensor built from them (``r[:, e, None] * experts[e](x)``), and when those
elements are a stack of layers run one after the other rather than experts side by side::

    for blk in self.blocks: y = y + blk(y)     # on the kept tokens x[topk(score, T // 2)[1]]: token pruning,
                                               # top-k pooling; residual VQ's projections of codebook rows
    -> not experts: one element's input is computed from another's output (``unclaimed_base.chained``),
       or the ids reach one element only
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .normalize import _clean_module_path, canon, module_path
from .token_paths import MATMULS, param_of
from .unclaimed_base import _dims, chained, near_node


def past_common(a: str, b: str) -> tuple[list[str], list[str]]:
    """The segments of the dotted module paths ``a`` and ``b`` past their common prefix."""
    x, y = [p for p in a.split(".") if p], [p for p in b.split(".") if p]
    i = 0
    while i < min(len(x), len(y)) and x[i] == y[i]:
        i += 1
    return x[i:], y[i:]


def listed(rmod: str, n: fx.Node, params: set, own: set) -> bool:
    """``n`` is a matmul-class op on a 2-D Parameter (not the router's own) of an nn.ModuleList element
    below the router's block: a digit segment in its module path past the common prefix, not the
    number of an nn.Sequential's child (``mlp.0``: one MLP, not experts)."""
    if (canon(n) or "") not in MATMULS or not any(
            len(_dims(p)) == 2 and p not in own for a in n.all_input_nodes if (p := param_of(a, params)) is not None):
        return False
    path, seq = module_path(n), _sequentials(n)
    rest, segs = past_common(rmod, path)[1], path.split(".")
    return any(p.isdigit() and ".".join(segs[:len(segs) - len(rest) + i]) not in seq for i, p in enumerate(rest))


def _sequentials(n: fx.Node) -> set[str]:
    """The module paths of the nn.Sequential modules ``n`` was computed inside."""
    out = set()
    for path, kind in (n.meta.get("nn_module_stack") or {}).values():
        name = kind if isinstance(kind, str) else getattr(kind, "__qualname__", "")
        if isinstance(kind, type) and issubclass(kind, torch.nn.Sequential) or name.endswith("Sequential"):
            out.add(_clean_module_path(path))
    return out


def list_index(rmod: str, n: fx.Node) -> int | None:
    """The ModuleList index of ``n``'s module below the router's block (the first digit segment past the
    common prefix that is not an nn.Sequential's child), else None."""
    path, seq = module_path(n), _sequentials(n)
    rest, segs = past_common(rmod, path)[1], path.split(".")
    for i, p in enumerate(rest):
        if p.isdigit() and ".".join(segs[:len(segs) - len(rest) + i]) not in seq:
            return int(p)
    return None


def listed_source(rmod: str, n: fx.Node, params: set, own: set) -> fx.Node | None:
    """The ``listed`` matmul whose output ``n`` is, through at most 4 single-input ops, else None."""
    return near_node(n, lambda m: listed(rmod, m, params, own))


def stacked_layers_dropped(rmod: str, found: list, reach: set, params: set, own: set) -> list:
    """``found`` without its ``listed`` evidence when the ModuleList elements it names are not experts
    side by side: one element, or one computed from another's output (the module doc)."""
    members = {}
    for kind, n in found:
        if kind != "listed":
            continue
        if (canon(n) or "") in MATMULS:
            members[n] = list_index(rmod, n)
        for a in n.all_input_nodes if canon(n) == "mul" else ():
            m = listed_source(rmod, a, params, own) if a not in reach else None
            if m is not None:
                members[m] = list_index(rmod, m)
    if not members or len({i for i in members.values() if i is not None}) >= 2 and not chained(members):
        return found
    return [(kind, n) for kind, n in found if kind != "listed"]
