"""Where expert ids come from: the routers of a Dynamo graph (finds; never mutates).

``routers(graph)`` yields every node that picks experts for tokens, with its index outputs, the
expert count E and the ids per token: ``topk`` / ``max(dim)`` / ``argmax`` over a [.., E] score, the
first k < E indices of a ``sort`` / ``argsort`` of one (``p.sort(-1, descending=True)[1][:, :k]``), and
ids drawn another way (``OTHER_ROUTERS``: sampled, random, hashed), which a token may repeat.
``router_root(ids)`` walks from an ids tensor back to its router; ``router_kind`` names a router for
messages. ``passes/unclaimed.py`` uses them to find MoE code that no region covers.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .normalize import arg, canon, val

ID_VIEWS = {"view", "reshape", "flatten", "to", "long", "int", "contiguous", "clone", "detach", "squeeze",
             "unsqueeze"}


def routers(graph: fx.Graph):
    """(router node, its index outputs, expert count E, top_k) for every topk / max(dim) / argmax, and
    every other way of drawing expert ids (``_other_router``)."""
    for n in graph.nodes:
        op = canon(n)
        if op in SORT_ROUTERS:
            yield from _sort_router(n)
            continue
        if op in OTHER_ROUTERS:
            found = _other_router(n, op)
            if found is not None:
                yield (n, [n], *found)
            continue
        if op not in ("topk", "max", "argmax"):
            continue
        x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        xv = val(x)
        if not isinstance(xv, torch.Tensor) or xv.dim() == 0:
            continue
        if op == "argmax":
            dim, k, ids = arg(n, 1, "dim", None), 1, [n]
            if dim is None:
                continue
        else:
            dim = arg(n, 2, "dim", -1) if op == "topk" else arg(n, 1, "dim", None)
            if op == "max" and not isinstance(dim, int):
                continue  # max over everything: not a selection
            k = arg(n, 1, "k", 1) if op == "topk" else 1
            ids = [u for u in n.users if (canon(u) == "getitem" and len(u.args) > 1 and u.args[1] == 1)
                   or (canon(u) == "getattr" and len(u.args) > 1 and u.args[1] == "indices")]
        if not ids or not isinstance(dim, int):
            continue
        e = xv.shape[dim]
        if not isinstance(e, int) or not isinstance(k, int) or e < 2:
            continue
        yield n, ids, e, k


SORT_ROUTERS = {"sort", "argsort"}


def scores_sort(n: fx.Node) -> tuple[int, int] | None:
    """(sorted dim, entries E along it) when ``n`` is a ``sort`` / ``argsort`` of float scores (grouping
    tokens by integer ids sorts ids, not scores: not a router), else None."""
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    xv, dim = val(x), arg(n, 1, "dim", -1)
    if not isinstance(xv, torch.Tensor) or not xv.is_floating_point() or xv.dim() == 0 \
            or not isinstance(dim, int) or isinstance(dim, bool) or not -xv.dim() <= dim < xv.dim():
        return None
    dim %= xv.dim()
    e = xv.shape[dim]
    return (dim, e) if isinstance(e, int) and e >= 2 else None


def sorted_indices(n: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(sort node, sorted dim, entries E along it) when ``n`` is the indices of a ``scores_sort``, else None."""
    op = canon(n)
    if op == "getitem" and len(n.args) > 1 and n.args[1] == 1 and isinstance(n.args[0], fx.Node) \
            and canon(n.args[0]) == "sort":
        n = n.args[0]
    elif op != "argsort":
        return None
    found = scores_sort(n)
    return (n, *found) if found is not None else None


def sort_top_k(n: fx.Node) -> tuple[fx.Node, int, int, int] | None:
    """(sort node, sorted dim, E, k) when ``n`` takes the first k < E of a ``scores_sort``'s indices along the
    sorted dim (``leading_slice``: ``si[:, :k]``, ``si[..., :k]``, ``si.narrow(-1, 0, k)``), else None."""
    if canon(n) not in ("getitem", "narrow") or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    found = sorted_indices(n.args[0])
    if found is None:
        return None
    sort, dim, e = found
    k = leading_slice(n, dim, val(sort.args[0]).dim())
    return (sort, dim, e, k) if k is not None and k < e else None


def leading_slice(n: fx.Node, dim: int, ndim: int) -> int | None:
    """k when ``n`` takes the first k entries of its input along ``dim`` and all of every other dim
    (``t[:, :k]``, ``t[..., :k]``, ``t.narrow(dim, 0, k)``), else None."""
    op = canon(n)
    if op == "narrow" and len(n.args) == 4:
        d, start, k = n.args[1:]
        ok = isinstance(d, int) and d % ndim == dim and start == 0 and isinstance(k, int)
        return k if ok else None
    if op != "getitem" or len(n.args) < 2:
        return None
    items = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    if any(i is not Ellipsis and not isinstance(i, slice) for i in items) or sum(i is Ellipsis for i in items) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (ndim - len(items) + 1) + items[at + 1:]
    items = items + (slice(None),) * (ndim - len(items))
    full = slice(None)
    if len(items) != ndim or any(i != full for j, i in enumerate(items) if j != dim):
        return None
    s = items[dim]
    ok = s.start in (None, 0) and s.step in (None, 1) and isinstance(s.stop, int) and s.stop > 0
    return s.stop if ok else None


def _sort_router(n: fx.Node):
    """(sort node, its sliced indices, E, k) for each k of ``sort(scores)[1][..., :k]`` with k < E."""
    sources = [u for u in n.users if canon(u) == "getitem"] if canon(n) == "sort" else [n]
    by_k: dict = {}   # k -> (E, the slices)
    for u in (u for s in sources for u in s.users):
        hit = sort_top_k(u)
        if hit is not None:
            by_k.setdefault(hit[3], (hit[2], []))[1].append(u)
    for k, (e, ids) in by_k.items():
        yield n, ids, e, k


# expert ids drawn without a top-k: sampled (``multinomial(probs, k)``), random (``randint(E, (T, k))``) or
# hashed (``token_ids % E``); never rewritten (a token may draw one expert twice), always listed
MAX_DRAWN_EXPERTS = 1024   # more "experts" than this is a vocabulary (sampling a token), not a router
OTHER_ROUTERS = {"multinomial": "a sampling router (multinomial)", "randint": "a random router (randint)",
                  "mod": "a hash router (ids % E)"}


def _other_router(n: fx.Node, op: str) -> tuple[int, int] | None:
    """(E, ids per token) of an integer ``n`` drawn by one of ``OTHER_ROUTERS``, else None."""
    v = val(n)
    if not isinstance(v, torch.Tensor) or v.is_floating_point() or v.dim() not in (1, 2):
        return None
    if op == "multinomial":
        probs = val(n.args[0]) if n.args else None
        e = probs.shape[-1] if isinstance(probs, torch.Tensor) else None
    elif op == "randint":
        ints = [a for a in n.args if isinstance(a, int) and not isinstance(a, bool)]
        e = n.kwargs.get("high", ints[-1] if ints else None)
    else:   # ids % E: a hash of token ids (graph inputs), not of positions (arange)
        e = n.args[1] if len(n.args) > 1 else None
        if not _hashes_inputs(n.args[0]):
            return None
    if not isinstance(e, int) or isinstance(e, bool) or not 2 <= e <= MAX_DRAWN_EXPERTS:
        return None
    k = v.shape[-1] if v.dim() == 2 else 1
    return (e, k) if isinstance(k, int) else None


def _hashes_inputs(x, depth: int = 8) -> bool:
    """``x`` is computed from an integer graph input (token ids) and from no ``arange`` (positions)."""
    seen, stack, found = set(), [x], False
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen or len(seen) > 64:
            continue
        seen.add(n)
        if canon(n) == "arange":
            return False
        v = val(n)
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and not v.is_floating_point():
            found = True
        stack.extend(n.all_input_nodes)
    return found


def router_kind(router: fx.Node, k: int) -> str:
    """How ``router`` picks experts, for messages: "a top-2 router", "a sampling router (multinomial)"."""
    op = canon(router)
    return f"a top-{k} router ({op} + slice)" if op in SORT_ROUTERS else OTHER_ROUTERS.get(op, f"a top-{k} router")


def router_root(ids: fx.Node) -> fx.Node | None:
    """The topk / max / argmax / sliced sort node (or other router, ``OTHER_ROUTERS``) that produced
    ``ids`` (through casts, views and leading slices of the last dim), else None."""
    n, seen = ids, 0
    while isinstance(n, fx.Node) and seen < 32:
        op = canon(n)
        if op in ("topk", "max", "argmax") or op in OTHER_ROUTERS and _other_router(n, op) is not None:
            return n
        if op in ("getitem", "getattr") and isinstance(n.args[0], fx.Node) and canon(n.args[0]) in ("topk", "max"):
            return n.args[0]
        if op in ("getitem", "narrow") and isinstance(n.args[0], fx.Node):
            hit = sort_top_k(n)
            if hit is not None:
                return hit[0]
            v = val(n)   # the first k' of each token's ids (topk(k + 1)[1][:, :k]): that router's
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and leading_slice(n, v.dim() - 1, v.dim()) is not None:
                n, seen = n.args[0], seen + 1
                continue
        if op in ID_VIEWS or op == "masked_fill" and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        else:
            return None
        seen += 1
    return None
