"""Where expert ids come from: the routers of a Dynamo graph (finds; never mutates).

``routers(graph)`` yields every node that picks experts for tokens, with its index outputs, the
expert count E and the ids per token: ``topk`` / ``max(dim)`` / ``argmax`` over a [.., E] score, and
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
    return OTHER_ROUTERS.get(canon(router), f"a top-{k} router")


def router_root(ids: fx.Node) -> fx.Node | None:
    """The topk / max / argmax node (or other router, ``OTHER_ROUTERS``) that produced ``ids``
    (through casts and views), else None."""
    n, seen = ids, 0
    while isinstance(n, fx.Node) and seen < 32:
        op = canon(n)
        if op in ("topk", "max", "argmax") or op in OTHER_ROUTERS and _other_router(n, op) is not None:
            return n
        if op in ("getitem", "getattr") and isinstance(n.args[0], fx.Node) and canon(n.args[0]) in ("topk", "max"):
            return n.args[0]
        if op in ID_VIEWS or op == "masked_fill" and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        else:
            return None
        seen += 1
    return None
