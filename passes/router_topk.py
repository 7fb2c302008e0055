"""find_router_topks: the ``torch.topk`` calls that route the tokens of rewritten MoE regions.

Contract (finds and checks, never mutates)::

    logits = linear(x, W_router)                         (the walk stops at GEMMs and graph inputs;
                                                          it follows in-place writes: mask.scatter_)
    ... = topk(f(logits), k[, dim=-1])                   any number of them (DeepSeek-V3's group
    ids = ...                                            limit has three), float scores, last dim
    perm, inv, offs = moe_compile.route_permute(ids, E)  <- seed: the lowering emitted it
  -> TopkMatch(node=topk, scores, k, seed=route_permute) for each topk whose outputs are only read
     by index (``[0]``, ``[1]``, ``.values``, ``.indices``) and then only by readers that cannot
     see the order of its k entries (below); ``lowering/router_topk.py`` makes it
     ``moe_compile.router_topk(scores, k)`` (sorted).

The walk stops at GEMMs, at the tokens a region gathers (the input of ``permute_rows`` or
``permute_scale``: the router is computed from them) and at moe_compile ops (an earlier layer), so a topk of the user's before the
router is never reached.

The order of the k entries: ``sorted=False`` leaves it unspecified (it differs between devices);
``sorted=True`` fixes it up to ties, and equal entries come out in torch's own order, which the op's
does not reproduce (torch.topk's CUDA kernel returned tied experts 1, 0 where the op returns 0, 1,
measured on an H200: a reader of position 0 then gets another expert id, and the gradient of
``values[:, 0]`` reaches another score). So a call of either kind qualifies only where no reader
can tell one order from another (k == 1 always: there is one order). Its values and indices are
*slot tensors*: entry j of a row is slot j, and both outputs hold a row's slots in one order.
Walking forward in graph order, each reader of a slot tensor must be one of::

    sum / mean / amax / ... over the last dim, max()        -> order-free: the walk ends there
    m.scatter_(-1, idx, 1.0) / m.scatter(...), a number      -> a set write: m stays order-free
    x.gather(-1, idx), x not a slot tensor                   -> a slot tensor: x[row, idx[row, j]]
    elementwise over slot tensors of one shape and tensors   -> a slot tensor: w / w.sum(-1, True),
      of last dim 1 (in place only into a slot tensor)          w * scale, .to(dtype), where(...)
    softmax(-1) / log_softmax(-1), ones_like / full_like     -> a slot tensor
    reshape keeping the last dim k, or to 1-D (row-major)    -> a slot tensor
    a region's pair input: route_permute(ids, E), the        -> the region: it reads (expert id,
      weights of its unpermute_combine / weighted_swiglu /      weight) pairs as a set (rows sorted
      permute_scale / w.reshape(-1)[perm]                       by expert, a token's k rows summed)

and every pair input of such a region must be a slot tensor of the same call (ids paired with
weights in another order would pair other experts and weights). Anything else keeps torch.topk: a
reader of route_permute's outputs that is neither a pair reader nor a known pair-free op (``_PAIR_FREE``),
a position read (``ids[:, 0]``, ``values[..., 0]``), argmax, sort, cumsum, a transpose, a graph
output, an unknown op, an in-place write of a slot tensor into another tensor, a slot tensor of
another topk call in the same elementwise op or region. What the swap can change is
only floating-point summation order: of reductions over the last dim (the router's weight sum),
of the combine's sum over a token's k rows.

Why: torch.topk's CUDA kernel (a radix select per row, then a sort) took 61 us per Qwen3-30B-A3B
router call (8192 x 128 scores) on an H200, ~1.7% of the MoE block's GPU time; the op's Triton
kernel reads each row once. DeepSeek-V3's two ``sorted=False`` calls per layer (top groups, top
experts) took ~0.11 ms of a 4-layer DeepSeek-V3-like training step on an H200. Only routers of
rewritten regions are considered, so user code outside MoE regions is never touched; a topk that
does not qualify stays as it is (it is correct, only slower), so nothing here is a refusal.
"""
from __future__ import annotations

import dataclasses
import operator
from heapq import heappop, heappush

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .normalize import arg, canon, is_inplace_method, route_permute_output, same_shape, shape, val

# ops that end the walk back from the expert ids: the router's own GEMM, and anything before it
_STOP = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "einsum", "baddbmm"})
_WALK_LIMIT = 200   # nodes visited per region (back) or per topk call (forward): a router is a few dozen ops


@dataclasses.dataclass(frozen=True)
class TopkMatch:
    node: fx.Node     # the topk call
    scores: fx.Node   # its input [..., E]
    k: int
    seed: fx.Node     # the route_permute whose expert ids it computes (which region it routes)


def _mutated_by(n: fx.Node) -> list[fx.Node]:
    """In-place method calls on n (``mask.scatter_(1, idx, 1)``): what they read flows into n."""
    return [u for u in n.users if is_inplace_method(u) and u.args and u.args[0] is n]


def _routers_of(ids: fx.Node, stops: set):
    """topk nodes among ids' ancestors (through in-place writes), back to the router GEMM, the
    tokens a region gathers, or an earlier moe_compile op: never into the code before the router."""
    seen, stack, found = set(), [ids], []
    while stack and len(seen) < _WALK_LIMIT:
        n = stack.pop()
        if n in seen or n in stops or n.op != "call_function" and n.op != "call_method":
            continue
        seen.add(n)
        op = canon(n) or ""
        if op in _STOP or op.startswith("moe_compile::"):
            continue
        if op == "topk":
            found.append(n)
        stack.extend(n.all_input_nodes)
        stack.extend(_mutated_by(n))
    return found


def _read_by_index(node: fx.Node) -> bool:
    """Every user takes one output: [0] / [1] / .values / .indices."""
    for u in node.users:
        if canon(u) == "getitem" and u.args[0] is node and u.args[1] in (0, 1):
            continue
        if canon(u) == "getattr" and u.args[0] is node and u.args[1] in ("values", "indices"):
            continue
        return False
    return True


# ------------------------------------------------------------- readers of a topk call
_ROWS, _FLAT = "rows", "flat"   # a slot tensor's layout: [..., k], or [N * k] (its rows one after another)
_REDUCTIONS = frozenset({"sum", "nansum", "mean", "amax", "amin", "prod", "logsumexp", "all", "any"})
_ELEMENTWISE = frozenset({  # slot j of the output is computed from slot j of the inputs only
    "add", "iadd", "sub", "mul", "div", "neg", "pow", "exp", "log", "sigmoid", "sqrt", "rsqrt", "abs", "clamp",
    "masked_fill", "where", "eq", "ne", "gt", "ge", "lt", "le",
    "to", "type", "float", "double", "half", "bfloat16", "long", "int", "detach", "contiguous", "clone"})
_FILLS = frozenset({"ones_like", "zeros_like", "full_like"})   # one value in every slot: the same in any order
_RESHAPES = frozenset({"reshape", "view", "flatten"})
_IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv)   # w /= s
_ROUTE = "moe_compile::route_permute"
# region op -> ((position, name) of the weights it reads per (token, slot) pair, (position, name) of
# the route_permute output that pairs them with the expert ids)
_PAIR_READERS = {"moe_compile::unpermute_combine": ((2, "weights"), (1, "inv")),
                 "moe_compile::weighted_swiglu": ((1, "weights"), (2, "perm")),
                 "moe_compile::permute_scale": ((4, "weights"), (1, "perm"))}
# region ops that read route_permute's outputs and no per-pair weights; any other reader of them (an op
# added later, one this module does not know) counts as a pair input that is no slot tensor, so the call
# stays torch.topk. (permute_scale, missing here, let a router whose input weights were not this call's
# values be swapped: its ids reordered, the weights not: 0.6-0.9 off, found by review.)
_PAIR_FREE = frozenset({"moe_compile::permute_rows", "moe_compile::unpermute_sum", "moe_compile::grouped_mm",
                        "moe_compile::grouped_mm_list", "moe_compile::grouped_mm_cat",
                        "moe_compile::grouped_mm_list_cat"})
_UNKNOWN_READER = object()   # in no slot map


def _op_of(u: fx.Node) -> str | None:
    """u's canonical op; an in-place method named as its op (``div_`` -> ``div``)."""
    return u.target[:-1] if is_inplace_method(u) else canon(u)


def _writes_first_arg(u: fx.Node) -> bool:
    return is_inplace_method(u) or u.op == "call_function" and u.target in _IN_PLACE_OPERATORS


def _is_last(dim, ndim: int) -> bool:
    return isinstance(dim, int) and not isinstance(dim, bool) and ndim > 0 and dim in (-1, ndim - 1)


def _slot_args(u: fx.Node, slots: dict) -> list[fx.Node]:
    """The arguments of u that are slot tensors, once per appearance."""
    found = []
    fx.node.map_arg((u.args, u.kwargs), lambda a: found.append(a) if a in slots else None)
    return found


def _reads_only(u: fx.Node, slots: dict, i: int, name: str) -> fx.Node | None:
    """The slot tensor u reads as its argument (i, name), when it is the only slot tensor u reads."""
    found = _slot_args(u, slots)
    return found[0] if len(found) == 1 and arg(u, i, name) is found[0] else None


def _reduces_slots(u: fx.Node, slots: dict) -> bool:
    """``w.sum(-1)``, ``w.amax(-1)``, ``w.mean()``, ``w.max()``: a reduction over the last dim (or every
    dim) whose value and gradient are the same for every order of the slots. Not ``max(-1)`` /
    ``min(-1)``: their backward sends the gradient to the index they return, the first of tied slots
    (amax / amin split it between ties); not an ``axis=`` or other keyword this does not read."""
    n, op = _reads_only(u, slots, 0, "input"), _op_of(u)
    if n is None or _writes_first_arg(u) or op not in _REDUCTIONS | {"max", "min"}:
        return False
    if not set(u.kwargs) <= {"dim", "keepdim", "dtype"}:
        return False
    if op in ("max", "min"):  # max(x): a value (ties share the gradient); max(x, dim) -> (values, indices)
        return len(u.args) == 1 and not u.kwargs
    dim, ndim = arg(u, 1, "dim"), len(shape(n))
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    return dim is None or dims == () or any(_is_last(d, ndim) for d in dims)


def _counts_slots(u: fx.Node, slots: dict) -> bool:
    """``histc(ids.float(), bins=E)``, ``bincount(ids)``: counts over every entry (no weights), the same
    for every order (torchtitan's ``tokens_per_expert``); no gradient flows through either."""
    n = _reads_only(u, slots, 0, "input")
    return (n is not None and not _writes_first_arg(u) and _op_of(u) in ("histc", "bincount")
            and not any(isinstance(a, fx.Node) for a in (*u.args[1:], *u.kwargs.values())))


def _writes_a_set(u: fx.Node, slots: dict) -> bool:
    """``m.scatter_(-1, idx, 1.0)`` / ``m.scatter(-1, idx, 1.0)``: one number written at each index of
    a row (m no slot tensor): the rows of m come out the same for every order."""
    n = _reads_only(u, slots, 2, "index")
    if n is None or _op_of(u) != "scatter" or slots[n] != _ROWS or "reduce" in u.kwargs or len(u.args) > 4:
        return False
    src, m = arg(u, 3, "src", u.kwargs.get("value")), shape(arg(u, 0, "input"))
    return (isinstance(src, (int, float, bool)) and m is not None and len(m) == len(shape(n))
            and _is_last(arg(u, 1, "dim"), len(m)))


def _gathers_by_slots(u: fx.Node, slots: dict) -> bool:
    """``x.gather(-1, idx)`` (x no slot tensor): slot j of the output is x[row, idx[row, j]]."""
    n, x = _reads_only(u, slots, 2, "index"), shape(arg(u, 0, "input"))
    return (n is not None and slots[n] == _ROWS and x is not None and len(x) == len(shape(n))
            and _is_last(arg(u, 1, "dim"), len(x)) and not arg(u, 3, "sparse_grad", False))


def _elementwise_layout(u: fx.Node, slots: dict) -> str | None:
    """Slot by slot over slot tensors of u's own shape and tensors that broadcast one value over a
    row (last dim 1, or 0-d); in place only into a slot tensor. The output keeps the slots' order."""
    out, ins = shape(u), _slot_args(u, slots)
    if out is None or not ins or _writes_first_arg(u) and u.args[0] not in slots:
        return None
    if not all(same_shape(shape(a), out) for a in ins) or len({slots[a] for a in ins}) != 1:
        return None
    for a in u.all_input_nodes:
        s = shape(a)
        if a not in slots and s and not (len(s) <= len(out) and statically_known_true(s[-1] == 1)):
            return None
    return slots[ins[0]]


def _reshaped_layout(u: fx.Node, n: fx.Node, k: int) -> str | None:
    """Rows kept whole and in order: to [..., k], or to 1-D (not a view as another dtype)."""
    out, v, vn = shape(u), val(u), val(n)
    if out is None or v.dtype != vn.dtype:
        return None
    return _FLAT if len(out) == 1 else _ROWS if statically_known_true(out[-1] == k) else None


def _slot_layout(u: fx.Node, slots: dict, k: int) -> str | None:
    """The layout of u's output when it is a slot tensor in the order of u's slot inputs, else None."""
    op = _op_of(u)
    if op == "gather":
        return _ROWS if _gathers_by_slots(u, slots) else None
    if op in _ELEMENTWISE:
        return _elementwise_layout(u, slots)
    n = _reads_only(u, slots, 0, "input")
    if n is None or _writes_first_arg(u):
        return None
    if op in _FILLS:
        return slots[n]
    if op in ("softmax", "log_softmax"):
        return _ROWS if slots[n] == _ROWS and _is_last(arg(u, 1, "dim"), len(shape(n))) else None
    return _reshaped_layout(u, n, k) if op in _RESHAPES else None


def _pair_read(u: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(route_permute, what u reads of its region one value per (token, slot) pair): the expert ids
    (route_permute itself), the weights of unpermute_combine / weighted_swiglu (paired by inv /
    perm) or ``w[perm]`` (1-D weights the permuted rows are scaled by); None for other nodes."""
    op = canon(u)
    if op == _ROUTE:
        return u, arg(u, 0, "expert_ids")
    if op in _PAIR_READERS:
        (at, name), (src, src_name) = _PAIR_READERS[op]
        route = route_permute_output(arg(u, src, src_name), src_name)
        return (route, arg(u, at, name)) if route is not None else None
    if op == "getitem" and len(u.args) == 2 and shape(u.args[0]) is not None and len(shape(u.args[0])) == 1:
        route = route_permute_output(u.args[1], "perm")
        return (route, u.args[0]) if route is not None else None
    return None


def _pair_inputs(route: fx.Node) -> list:
    """Everything the region of ``route`` reads one value per (token, slot) pair; ``_UNKNOWN_READER`` for
    a reader of its outputs that is neither a known pair reader nor in ``_PAIR_FREE``."""
    inputs = []
    for u in [route] + [u for out in route.users for u in out.users]:
        p = _pair_read(u)
        if p is not None:
            if p[0] is route:
                inputs.append(p[1])
        elif canon(u) not in _PAIR_FREE:
            inputs.append(_UNKNOWN_READER)
    return inputs


def _enqueue_readers(n: fx.Node, pos: dict, waiting: dict, queue: list) -> None:
    """Queue n's readers not seen yet, by graph position (``waiting``: position -> node)."""
    for r in n.users:
        if pos[r] not in waiting:
            waiting[pos[r]] = r
            heappush(queue, pos[r])


def _readers_see_no_order(topk: fx.Node, k: int, pos: dict) -> bool:
    """True if no reader of a topk's outputs can tell the order of its k entries (the
    rules of the module docstring). Readers are visited in graph order, so each sees its inputs
    classified: another slot tensor (followed), order-free (the walk ends), or a pair input of a
    region, whose pair inputs must then all be slot tensors of this call."""
    if k == 1:
        return True
    if any(shape(u) is None for u in topk.users):
        return False
    slots = {u: _ROWS for u in topk.users}   # [0] / [1] / .values / .indices (_read_by_index)
    waiting, queue, routes = {}, [], set()
    for n in slots:
        _enqueue_readers(n, pos, waiting, queue)
    while queue:
        if len(waiting) > _WALK_LIMIT:
            return False
        u = waiting[heappop(queue)]
        layout, pair = _slot_layout(u, slots, k), _pair_read(u)
        if layout is not None and shape(u) is not None:
            slots[u] = layout
            _enqueue_readers(u, pos, waiting, queue)
        elif pair is not None and _slot_args(u, slots) == [pair[1]]:
            routes.add(pair[0])
        elif not (_reduces_slots(u, slots) or _counts_slots(u, slots) or _writes_a_set(u, slots)):
            return False
    return all(x in slots for r in routes for x in _pair_inputs(r))


def _match(n: fx.Node, seed: fx.Node, pos: dict) -> TopkMatch | None:
    scores, k = arg(n, 0, "input"), arg(n, 1, "k")
    s = val(scores)
    if not isinstance(scores, fx.Node) or not isinstance(s, torch.Tensor) or not s.is_floating_point() or s.dim() < 1:
        return None
    dim = arg(n, 2, "dim", -1)
    if not isinstance(k, int) or dim not in (-1, s.dim() - 1) or arg(n, 3, "largest", True) is not True:
        return None
    if n.kwargs.get("out") is not None or not isinstance(s.shape[-1], int) or not 1 <= k <= s.shape[-1]:
        return None
    if not _read_by_index(n):
        return None
    if not _readers_see_no_order(n, k, pos):
        return None  # a reader may see torch's own order (of tied entries, when sorted): kept as written
    return TopkMatch(n, scores, k, seed)


def find_router_topks(gm: fx.GraphModule) -> list[TopkMatch]:
    found: dict[fx.Node, TopkMatch] = {}
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}   # graph order: producers before readers
    # the token rows each region gathers: the router is computed from them, what made them is not router
    gathers = ("moe_compile::permute_rows", "moe_compile::permute_scale")
    stops = {n.args[0] for n in gm.graph.nodes if canon(n) in gathers}
    for node in gm.graph.nodes:
        if canon(node) != "moe_compile::route_permute" or not isinstance(node.args[0], fx.Node):
            continue
        for t in _routers_of(node.args[0], stops):
            m = t not in found and _match(t, node, pos)
            if m:
                found[t] = m
    return list(found.values())
