"""unrouted: MoE-looking expert sets that no top-k router selects (part of the never-silent scan of
``passes/unclaimed.py``, which calls it; finds and reports, never mutates).

Contract::

    experts: ModuleList elements' matmuls (one key per digit of the module path: ``experts.3.fc1``,
             ``experts.3.0`` of Sequential experts), ``W[e]`` slices of stacked [E, ...] weights, or a
             ``bmm`` / ``einsum`` over all of a stacked W
    gated, for >= 2 experts, on their inputs or outputs, by a per-expert selection of that expert e:
        ids == e            integer ids compared with several numbers (hash / table ids: router_draws;
                            ids that are an input of the graph, e.g. a checkpoint body's: ids_outside)
        W[ids]              each token's expert weights gathered from a stacked W by integer ids that hash
                            the graph's inputs or look them up in a buffer (``tid2eid[input_ids]``,
                            ``h & (E - 1)``): router_draws; not ids given as they are (labels, edge types)
        mask[:, e]          column e of a graph input that is not a Parameter or buffer, picking rows (a
                            one-hot dispatch mask made outside the graph, past a graph break): ids_outside
        scores[:, e]        column e of the block's gate scores (a matmul of the tokens with a 2-D
                            Parameter of the block writing [.., E], and what follows it short of another
                            Parameter's matmul): moe_unmatched when it picks rows (threshold, top-p),
                            else soft_moe / routing_matrix_form (weighted mixtures)
  -> one Unclaimed record per expert set, unless a candidate region or the router scan of
     unclaimed.py already covers its block, or its members run one after the other (a stack of layers).

Compared ids may number the experts otherwise (``eid == (e + 1) % E``, ``enumerate(experts, start=1)``), but
two experts must be gated by different numbers; a score column must be the expert's index. Negative
controls (per-head projections, attention, a gated MLP, a classifier's top-k, rows picked by two numbers
fed to every head) are in tests/test_never_silent.py.
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .normalize import arg, attribute_path, canon, common_module, module_path, source_name, val, where_in_user_code
from .token_paths import MATMULS, param_of, upstream
from .unclaimed_base import _GATHERS, Unclaimed, _claimed_by, _dims, _near, _same_block, chained, disabled_note


# the gates of the experts' inputs and outputs: a product, a masked write, an indexed add
_COMBINES = {"mul", "einsum", "bmm", "matmul", "where", "index_add", "index_add_", "index_put", "index_put_",
             "setitem", "masked_fill", "masked_scatter", "div"}


# views and casts between a dispatch mask input and the column an expert takes of it
_VIEWS = {"view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze", "flatten", "contiguous", "to",
          "long", "int", "bool", "float"}

# a module path segment that numbers an expert: "3" (ModuleList, Sequential), "expert_3" (ModuleDict by name)
_NUMBERED = re.compile(r"(\w*expert\w*?_?)?(\d+)", re.I)


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _under(path: str, block: str) -> bool:
    """The module ``path`` is ``block`` or inside it."""
    return not block or path == block or path.startswith(block + ".")


def _experts(gm: fx.GraphModule, params: set, weights: set) -> dict:
    """The expert sets of the graph: {key: (E, owner, {matmul node: expert index, or None for all E}, listed)}.
    An nn.ModuleList element's matmul on its 2-D Parameter (``experts.3.fc1``: key ``experts``, index 3,
    E = the elements the graph uses, at least 2; one key per digit of the path: ``experts.3.0`` of
    Sequential experts is in ``experts`` and in ``experts.3``), or a matmul on stacked weights [E, ...] (``W[e]``: index
    e; ``bmm`` / ``einsum`` on ``W``: all of them). ``owner``: the module the gating must come from."""
    out: dict = {}
    for n in gm.graph.nodes:
        if (canon(n) or "") not in MATMULS:
            continue
        for a in n.all_input_nodes:
            p = param_of(a, weights)
            if p is None:
                continue
            d = _dims(p)
            if len(d) >= 3 and isinstance(d[0], int) and d[0] >= 2:
                entry = out.setdefault(attribute_path(p) or p.name, (d[0], module_path(n), {}, False))
                entry[2][n] = _slice_index(a, p, d[0])
                break
            segs = module_path(n).split(".")
            numbered = [(i, m) for i, g in enumerate(segs) if (m := _NUMBERED.fullmatch(g))]
            if len(d) == 2 and p in params and numbered:
                # experts.3.fc1, experts.3.0 (Sequential experts), layers.0.moe.experts.3.fc1, and ModuleDict
                # experts keyed by name: experts.expert_3.wi (Switch Transformers, NLLB-MoE)
                for i, m in numbered:
                    container = ".".join(segs[:i])
                    key = ".".join(x for x in (container, m.group(1)) if x)
                    entry = out.setdefault(key, [0, _parent(container), {}, True])
                    entry[2][n] = int(m.group(2))
                break
    for key, entry in list(out.items()):
        if isinstance(entry, list):   # ModuleList: E = the distinct elements used
            out[key] = (len(set(entry[2].values())), entry[1], entry[2], True)
    return {k: out[k] for k in sorted(out, key=len) if out[k][0] >= 2}   # outer ModuleLists first


def _slice_index(a: fx.Node, p: fx.Node, e: int) -> int | None:
    """The expert a weight operand ``a`` takes from the stacked ``p`` (``W[e]``, ``W.select(0, e)``), None for all."""
    n = a
    while isinstance(n, fx.Node) and n is not p:
        i = _int_at(n, e, dim0=True)
        if i is not None:
            return i
        n = n.args[0] if n.args else None
    return None


def _int_at(n: fx.Node, e: int, dim0: bool = False) -> int | None:
    """The expert number a basic index ``n`` takes at a dim of size ``e`` (``t[:, e]``, ``t[e]``,
    ``t.select(d, e)``; with ``dim0`` only the first dim), else None."""
    op = canon(n)
    t = n.args[0] if n.args else None
    d = _dims(t) if isinstance(t, fx.Node) and isinstance(val(t), torch.Tensor) else ()
    if not d or op not in ("getitem", "select") or len(n.args) < 2:
        return None
    if op == "select":
        dim, i = arg(n, 1, "dim", None), arg(n, 2, "index", None)
        ok = isinstance(dim, int) and (dim % len(d) == 0 or not dim0) and statically_known_true(d[dim] == e)
        return i if ok and isinstance(i, int) and not isinstance(i, bool) and 0 <= i < e else None
    idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    if any(isinstance(a, fx.Node) for a in idx):
        return None
    if Ellipsis in idx:
        cut = idx.index(Ellipsis)
        pairs = _positions(idx[:cut], 0, 1) + _positions(idx[cut + 1:][::-1], len(d) - 1, -1)
    else:
        pairs = _positions(idx, 0, 1)
    for pos, a in pairs:
        if dim0 and pos != 0:
            continue
        if isinstance(a, int) and not isinstance(a, bool) and 0 <= pos < len(d) and statically_known_true(d[pos] == e) \
                and 0 <= a < e:
            return a
    return None


def _positions(idx, start: int, step: int) -> list:
    """(dim, index entry) of a basic index's entries from ``start`` (``None`` takes no dim)."""
    out, pos = [], start
    for a in idx:
        if a is None:
            continue
        out.append((pos, a))
        pos += step
    return out


def _compared(n: fx.Node) -> tuple[fx.Node, int] | None:
    """(ids, e) of ``ids == e`` where the integer ``ids`` are compared with two or more numbers."""
    if canon(n) != "eq" or len(n.args) < 2:
        return None
    a, b = n.args[:2]
    ids, e = (a, b) if isinstance(b, int) else (b, a)
    if not isinstance(ids, fx.Node) or not isinstance(e, int) or isinstance(e, bool):
        return None
    v = val(ids)
    if not isinstance(v, torch.Tensor) or v.is_floating_point() or v.dtype == torch.bool:
        return None
    numbers = {x for u in ids.users if canon(u) == "eq" for x in u.args[:2]
               if isinstance(x, int) and not isinstance(x, bool)}
    return (ids, e) if len(numbers) >= 2 else None


def _scores(gm: fx.GraphModule, e: int, owner: str, key: str, params: set, weights: set) -> set:
    """What the owner's gates compute: a matmul of the tokens with a 2-D Parameter of the owner (not of
    the experts) that writes [.., E], and what is computed from it short of another Parameter's matmul."""
    def param_matmul(n):
        return (canon(n) or "") in MATMULS and any(param_of(a, weights) is not None for a in n.all_input_nodes)

    gates = [n for n in gm.graph.nodes if param_matmul(n) and _dims(n)[-1:] == (e,)
             and _under(module_path(n), owner) and not (key and _under(module_path(n), key))
             and any(len(_dims(p)) == 2 and e in _dims(p) for a in n.all_input_nodes
                     if (p := param_of(a, params)) is not None)
             and any(param_of(a, weights) is None for a in n.all_input_nodes)]
    seen, stack = set(), list(gates)
    while stack:
        n = stack.pop()
        if n in seen or n.op == "output" or n not in gates and param_matmul(n):
            continue
        seen.add(n)
        stack.extend(n.users)
    return seen


def _selectors(starts, i, e: int, scores: set, weights: set, depth: int) -> list:
    """(kind, node, rows) of the per-expert selections of expert ``i`` among what ``starts`` are computed
    from (at most ``depth`` ops back, short of Parameters' matmuls; an indexed read follows its index
    only, ``rows``: the selection picks rows): ``ids == j`` ("compare", ids compared with several
    numbers; j may differ from i) or column ``i`` of the gates' [.., E] scores ("slice", ``probs[:, i]``)."""
    out, seen, stack = [], set(), [(s, 0, False) for s in starts]
    while stack:
        n, d, rows = stack.pop()
        if not isinstance(n, fx.Node) or n in seen or d > depth:
            continue
        seen.add(n)
        if _compared(n) is not None:   # any number: the experts may be numbered otherwise (checked in unrouted)
            out.append(("compare", n, rows))
            continue
        if n in scores and _int_at(n, e) == i:
            out.append(("slice", n, rows))
            continue
        src = _source(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
        if rows and src is not None and src.op == "placeholder" and not attribute_path(src) and _int_at(n, e) == i:
            out.append(("outside", n, rows))   # column e of a dispatch mask made outside the graph: mask[:, e]
            continue
        op = canon(n) or ""
        if n.op == "placeholder" or op in MATMULS and any(param_of(a, weights) is not None for a in n.all_input_nodes):
            continue
        index = [a for a in (n.args[1] if len(n.args) > 1 and isinstance(n.args[1], (tuple, list)) else n.args[1:])
                 if isinstance(a, fx.Node)] if op in _GATHERS and isinstance(val(n.args[0]), torch.Tensor) else []
        if index:
            stack += [(a, d + 1, True) for a in index]
        else:
            picks = op in ("nonzero", "argwhere") or op == "where" and len(n.args) == 1
            stack += [(a, d + 1, rows or picks) for a in n.all_input_nodes]
    return out


def _gathered_by(m: fx.Node, weights: set, e: int) -> fx.Node | None:
    """The integer ids ``m`` (a matmul) gathers its stacked weight [E, ...] by along dim 0 (``W[ids]``,
    ``W.index_select(0, ids)``, through views and casts), when they are a hash or a table lookup of the
    graph's inputs (``_hashed``), else None. Ids given as they are (class labels, edge types, task or
    adapter ids) and arithmetic on positions (relative-position tables) are not routing."""
    for a in m.all_input_nodes:
        p = param_of(a, weights)
        n = a
        while p is not None and isinstance(n, fx.Node) and n is not p:
            op = canon(n) or ""
            idx = None
            if op == "getitem" and len(n.args) > 1:
                first = n.args[1][0] if isinstance(n.args[1], (tuple, list)) and n.args[1] else n.args[1]
                idx = first if isinstance(first, fx.Node) else None
            elif op == "index_select" and arg(n, 1, "dim", None) in (0, -len(_dims(n.args[0]) or (0,))):
                idx = arg(n, 2, "index", None)
            if isinstance(idx, fx.Node):
                v = val(idx)
                if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool \
                        and _dims(n.args[0])[:1] == (e,) and _hashed(idx):
                    return idx
                return None
            n = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    return None


# how hash routers make ids: a remainder or a bit mask (ids % E, ids & (E - 1), an LSH's bits); a lookup in a
# table (tid2eid[input_ids]) is a gather from a buffer
_HASH_OPS = {"remainder", "mod", "fmod", "bitwise_and", "and", "and_", "__and__", "bitwise_xor", "xor", "__xor__"}


def _hashed(ids: fx.Node, depth: int = 8) -> bool:
    """``ids`` are computed (not a graph input as they are) by a hash of the graph's inputs or a lookup of
    them in a buffer (through at most ``depth`` ops)."""
    seen, stack = set(), [(ids, 0)]
    while stack:
        n, d = stack.pop()
        if not isinstance(n, fx.Node) or n in seen or d > depth or n.op == "placeholder":
            continue
        seen.add(n)
        op = canon(n) or getattr(n.target, "__name__", "")
        if op in _HASH_OPS:
            return True
        src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if op in _GATHERS and src is not None and src.op == "placeholder" and "_buffers" in source_name(src):
            return True   # a table lookup: buffer[ids]
        stack += [(x, d + 1) for x in n.all_input_nodes]
    return False


def _consumers(m: fx.Node, hops: int = 4) -> list[fx.Node]:
    """The ops that combine ``m``'s output with something else, through at most ``hops`` single-input ops."""
    out, stack, seen = [], [(m, 0)], set()
    while stack:
        n, h = stack.pop()
        for u in n.users:
            if u in seen or (canon(u) or "") in MATMULS - {"einsum", "bmm", "matmul"}:
                continue
            seen.add(u)
            if len(u.all_input_nodes) > 1 and (canon(u) or "") in _COMBINES:
                out.append(u)
            elif len(u.all_input_nodes) == 1 and h < hops:
                stack.append((u, h + 1))
    return out


def unrouted(gm, params, weights, claimed_nodes, claimed_modules, listed, disabled, routed=frozenset()
             ) -> list[Unclaimed]:
    """Expert sets that a per-expert selection gates with no top-k router (module doc, "selections").
    ``routed``: placeholders of a checkpoint body that its caller fed a router's indices; comparisons of
    those count wherever they sit (a checkpointed method of the root block belongs to no module)."""
    out: list[Unclaimed] = []
    for key, (e, owner, members, listed_) in _experts(gm, params, weights).items():
        if any(m in claimed_nodes for m in members):
            continue
        found = []     # (expert index, kind, selection node, rows)
        for own in dict.fromkeys([owner, _parent(owner)] if owner else [owner]):
            scores = _scores(gm, e, own, key if listed_ else "", params, weights)
            for m, i in members.items():
                ids = _gathered_by(m, weights, e)
                if ids is not None:   # W[ids]: each token's experts gathered by ids of no top-k router
                    found.append((None, "gather", ids, True))
                    continue
                if i is None:   # bmm / einsum on all the experts: their outputs weighted by the scores
                    found += [(None, "slice", u, False) for u in _consumers(m) if any(
                        a in scores and e in _dims(a) and not _near(a, lambda x: x in members)
                        for a in u.all_input_nodes)]
                    continue
                ins = [a for a in m.all_input_nodes if param_of(a, weights) is None]
                sel = _selectors(ins, i, e, scores, weights, 7)
                for u in _consumers(m):
                    sel += _selectors([a for a in u.all_input_nodes if not _near(a, lambda x: x is m)],
                                      i, e, scores, weights, 4)
                found += [(i, kind, n, rows) for kind, n, rows in sel
                          if (_under(module_path(n), own) or kind == "compare" and _source(_compared(n)[0]) in routed)
                          and not (listed_ and _under(module_path(n), key))]
            if found:
                break
        # per expert: its experts must be gated by different numbers (rows picked once, by one or two numbers,
        # and fed to every expert are not a selection per expert)
        numbers: dict = {}
        for i, kind, n, _ in found:
            if kind == "compare":
                numbers.setdefault(i, set()).add(_compared(n)[1])
        if len({frozenset(v) for v in numbers.values()}) < 2:
            found = [f for f in found if f[1] != "compare"]
        if len({i for i, *_ in found}) < 2 and not any(i is None for i, *_ in found) or chained(members):
            continue
        nodes = [n for _, _, n, _ in found]
        module = common_module(nodes + list(members))
        if any(_claimed_by(module, m, module) for m in claimed_modules) or any(_same_block(module, u.module) for u in listed + out):
            continue
        out.append(_unrouted_record(key, e, members, found, module, disabled))
    return out


def _source(n: fx.Node) -> fx.Node:
    """``n`` before views and casts."""
    while (canon(n) or "") in _VIEWS and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _unrouted_record(key, e, members, found, module, disabled) -> Unclaimed:
    i0, kind, sel, _ = found[0]
    rows = any(r for *_, r in found)
    first = next(iter(members))
    at = where_in_user_code(sel) or where_in_user_code(first) or "?"
    sep = "" if key.endswith("_") else "."   # experts.expert_<e> (a ModuleDict keyed by name), experts.<e>
    label = f"`{key}{sep}<e>`" if all(isinstance(i, int) for i in members.values()) else f"`{key}`"
    evidence = (f"the {e} experts {label} (`{first.name}`) "
                + ("with each token's expert weights gathered by its ids" if kind == "gather"
                   else "on the rows each expert's selection picks" if rows else "weighted per expert"))
    detail = {"k": "?", "e": e, "router_at": where_in_user_code(sel) or "?", "evidence": evidence, "node": sel.name,
              "disabled": disabled_note(disabled)}
    if kind == "outside":
        mask = _source(sel.args[0])
        detail["router"] = (f"a dispatch mask `{mask.name}` that is an input of this graph (computed outside it: e.g. "
                            "a router split off by a graph break, or a torch.utils.checkpoint body given the mask)")
        return Unclaimed(module, at, e, 0, detail, "ids_outside")
    if kind in ("compare", "gather"):
        ids = _compared(sel)[0] if kind == "compare" else sel
        if _source(ids).op == "placeholder":   # given as they are, or a view of them
            detail["router"] = (f"expert ids `{ids.name}` that are an input of this graph (computed outside it: "
                                "e.g. a torch.utils.checkpoint body given the router's ids)")
            return Unclaimed(module, at, e, 0, detail, "ids_outside")
        detail["router"] = (f"a hash or table router (`{ids.name}` compared with each expert number)" if kind == "compare"
                            else f"a hash or table router (`{ids.name}` gathers each token's expert weights)")
        return Unclaimed(module, at, e, 0, detail, "router_draws")
    if rows:
        detail["router"] = f"a router without a top-k (`{sel.name}`: each expert's share of the router's scores)"
        return Unclaimed(module, at, e, 0, detail)
    topk = any(canon(a) == "topk" for a in upstream([sel], 96))
    return Unclaimed(module, at, e, 0, detail, "routing_matrix_form" if topk else "soft_moe")

