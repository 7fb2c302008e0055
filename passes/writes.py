"""In-place writes a region's rewrite would not replay (finds; never mutates).

Dynamo graphs keep the user's in-place ops (``t.mul_(2)``, ``t += 1``, ``t[i] = v``, ``out=``). The
finders read a region as pure dataflow, and the lowering reads the region's inputs (expert input,
router ids and weights, expert weights, the accumulator's base) once, where the region ends. So a
write that lands between the region's first node and its last one, on a tensor the region reads or
computes, changes what eager computes and not what the rewrite computes::

    w, ids = probs.topk(K)                    w, ids = probs.topk(K)
    sw = w.flatten()[perm]        (region)    sw = w.flatten()[perm]
    w.mul_(2)                     <- found    ... y = rows * sw ...       (eager: the old w;
    ... y = rows * sw ...                                                  rewrite: w as it ends)
    for e in range(E):                        offs = cnt.cumsum(0); offs[0] += 1   <- found
        out += expert_e(xin[tok]) * ...       (the rewrite computes its own offsets)
        xin.mul_(0.9)             <- found

``foreign_write(region)`` returns the first such write (the graph is unchanged either way); the
writes the finders recognised (the combine's accumulation, ``inv[perm] = arange``, a sentinel
``clamp_``/``masked_fill_``, an in-place bias add or activation on the rows: every in-place node that
is part of ``region.nodes``) are the region's own. The rule: the rewrite moves every read of an
input to the region's end, so a write counts from the first node it replaces that reads that input
(the region's first node, or earlier: ``zeros.scatter_(1, ids, w)`` copies w before the experts run)
and writes after the end count for neither. A write to a tensor the rewrite computes itself counts
from its definition: one computed from the router's outputs (offsets, a routing matrix), and one
the region reads that no input is computed from (``r = zeros(T, E)`` filled by ``r.scatter_(1, ids,
w)`` as a statement, the combine reading ``r``; the -inf fill of Llama 4's [T, E] weights, whose
unselected entries the rewrite takes for 0). Only the scatter_ that builds the matrix is the region's.
"""
from __future__ import annotations

import contextlib
import contextvars
import operator

import torch
import torch.fx as fx

from .normalize import ancestors, arg, canon, descendants, fn_name, val
from .region import AccumulateInPlace, Region

_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.imatmul, operator.setitem}
_NOT_WRITES = {"requires_grad_", "retain_grad", "share_memory_"}
_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__"}
_VIEW_ATTRS = {"T", "mT", "H", "mH", "real", "imag", "data"}   # getattr(x, "T"), x.data, ...
# ops whose result may share storage with their first argument (conservative: ``reshape``, ``contiguous``
# and ``to`` alias when no copy is needed; every in-place op returns its ``self``)
_VIEWS = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "t", "transpose", "permute",
          "expand", "expand_as", "view_as", "narrow", "select", "as_strided", "diagonal", "detach", "alias",
          "contiguous", "to", "type_as", "float", "half", "bfloat16", "double", "int", "long", "type",
          "chunk", "split", "unbind", "split_with_sizes", "movedim", "swapaxes", "mT", "real", "imag",
          "unfold", "squeeze_", "unsqueeze_", "align_as", "reshape_as", "ravel", "broadcast_to", "tensor_split",
          "moveaxis", "hsplit", "vsplit", "dsplit", "_get_data_attr", "view_as_real", "view_as_complex",
          "swapdims", "adjoint", "conj", "resolve_conj", "resolve_neg", "indices", "values",
          "atleast_1d", "atleast_2d", "atleast_3d", "requires_grad_", "share_memory_", "positive", "cpu", "cuda",
          "bool", "short", "char", "byte", "unsafe_chunk", "unsafe_split", "unsafe_split_with_sizes"}
# ops that return a tuple of views of their tensor arguments, item i of argument i
_TUPLE_VIEWS = {"broadcast_tensors", "meshgrid", "atleast_1d", "atleast_2d", "atleast_3d"}

# ops that read their tensor argument's shape, dtype and device, not its values
_SHAPE_ONLY = {"new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
               "full_like", "size", "dim", "numel"}
_FILLS = {"full", "full_like", "new_full"}


def written(node: fx.Node) -> fx.Node | None:
    """The tensor an in-place call node writes (its ``self`` or its ``out=``), else None."""
    if node.op not in ("call_function", "call_method"):
        return None
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        return out
    if _inplace_target(node) or _inplace_flag(node):
        return node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    return None


def all_written(node: fx.Node) -> list[fx.Node] | None:
    """Every tensor a call node writes in place: ``written``'s, each tensor of a list first argument
    (``torch._foreach_add_([a, b], 1)``) or of a tuple ``out=`` (``torch.sort(x, out=(v, i))``), and each argument
    an op's schema marks as written (a custom op's ``mutates_args``, whatever its name). [] when it writes nothing;
    None when it writes something this cannot name (an in-place call on an argument that is no tensor node)."""
    if node.op not in ("call_function", "call_method"):
        return []
    found = [t for t in [written(node)] if t is not None]
    out = node.kwargs.get("out")
    if isinstance(out, (tuple, list)):
        found += [t for t in out if isinstance(t, fx.Node)]
    first = node.args[0] if node.args else None
    if _inplace_name(node) and isinstance(first, (tuple, list)):
        found += [t for t in first if isinstance(t, fx.Node)]
    found += _schema_writes(node)
    if not found and writes_in_place(node):
        return None
    return list(dict.fromkeys(found))


_SCHEMA_WRITES: dict = {}   # op -> ((position, name, keyword only) of each argument its schemas mark written)


def _schema_writes(node: fx.Node) -> list[fx.Node]:
    """The arguments an OpOverload's (or every overload of a packet's) schema marks as written."""
    target = node.target if node.op == "call_function" else None
    if not isinstance(target, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        return []
    out = []
    for i, name, kwarg_only in _cached(_SCHEMA_WRITES, target, _written_args, target):
        v = node.args[i] if i < len(node.args) and not kwarg_only else node.kwargs.get(name)
        out += [t for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, fx.Node)]
    return out


def _written_args(target) -> tuple:
    schemas = [getattr(target, o)._schema for o in target.overloads()] \
        if isinstance(target, torch._ops.OpOverloadPacket) else [target._schema]
    return tuple(dict.fromkeys((i, a.name, a.kwarg_only) for schema in schemas for i, a in enumerate(schema.arguments)
                               if a.alias_info is not None and a.alias_info.is_write))


def _cached(table: dict, key, compute, arg):
    """``table[key]``, ``compute(arg)`` the first time; ``compute(arg)`` every time for an unhashable key."""
    try:
        return table[key]
    except KeyError:
        value = table[key] = compute(arg)
        return value
    except TypeError:   # an unhashable key (a callable target)
        return compute(arg)


_INPLACE_TARGETS: dict = {}   # (op, target) -> whether the call writes its first argument by its name alone


def _inplace_target(node: fx.Node) -> bool:
    """``operator.iadd``, ``t.add_``, ``t.__setitem__``: in place by what is called, whatever the arguments
    (once per target: ``written`` runs ~6 times per node of a graph)."""
    return _cached(_INPLACE_TARGETS, (node.op, node.target), inplace_call, node)


def inplace_call(node) -> bool:
    """In place by what is called (a node, or anything with its ``op`` and ``target``: the lowering's steps)."""
    return node.op == "call_function" and node.target in _INPLACE_OPERATORS or _inplace_name(node) \
        or _name(node) in _INPLACE_DUNDERS


def writes_in_place(node: fx.Node) -> bool:
    """``node`` writes into a tensor it was given: ``written`` finds one, or the call is an in-place op
    on a list of tensors (``torch._foreach_add_``) or has a tuple ``out=`` (``torch.max(.., out=(v, i))``)."""
    return written(node) is not None or node.op in ("call_function", "call_method") and (
        isinstance(node.kwargs.get("out"), (tuple, list)) or _inplace_name(node))


def _name(node: fx.Node):
    return node.target if node.op == "call_method" else fn_name(node.target)


def _inplace_name(node: fx.Node) -> bool:
    """``t.add_``, ``torch.fill_``, ``torch._foreach_add_``: a trailing ``_`` (not a dunder, not
    ``requires_grad_`` and the like)."""
    name = _name(node)
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES


def _inplace_flag(node: fx.Node) -> bool:
    """``F.relu(x, inplace=True)`` or ``F.relu(x, True)``: a function whose ``inplace`` argument is set."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op != "call_function" or True not in node.args[1:]:
        return False
    sig = _signature(node.target)
    if sig is None or "inplace" not in sig.parameters:
        return False
    try:
        bound = sig.bind(*node.args, **node.kwargs)
    except TypeError:   # arguments that do not bind
        return False
    return bound.arguments.get("inplace") is True


_SIGNATURES: dict = {}


def _signature(target):
    """``inspect.signature(target)`` once per function (None without one): a builtin's is parsed from its
    text signature on every call, 0.2 ms each; ``written`` asks for it on every call with a positional
    ``True`` (``keepdim``, ``as_tuple``), 0.8 s of a 5 s dynamo stage at 128 experts x 4 layers."""
    return _cached(_SIGNATURES, target, _bind_signature, target)


def _bind_signature(target):
    import inspect

    try:
        return inspect.signature(target)
    except (TypeError, ValueError):   # builtins without a signature
        return None


def storage_base(node, memo: dict) -> fx.Node:
    """The storage ``node`` may share: walked back through views, basic indexing and in-place ops."""
    start = node
    while isinstance(node, fx.Node):
        if node in memo:
            node = memo[node]
            break
        op = canon(node)
        nxt = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if nxt is None:
            break
        if op == "getitem" and canon(nxt) in _TUPLE_VIEWS and not isinstance(val(nxt), torch.Tensor):
            items = nxt.args[0] if len(nxt.args) == 1 and isinstance(nxt.args[0], (list, tuple)) else nxt.args
            i = node.args[1]
            if isinstance(i, int) and -len(items) <= i < len(items) and isinstance(items[i], fx.Node):
                node = items[i]
                continue
            break
        if op in _VIEWS or written(node) is nxt or (op == "getitem" and basic_index(node)) \
                or (op == "getattr" and len(node.args) > 1 and node.args[1] in _VIEW_ATTRS):
            node = nxt
            continue
        shared = _shares_storage_with_input(node)
        if shared is None:
            break
        node = shared
    memo[start] = node
    return node


def _shares_storage_with_input(node: fx.Node) -> fx.Node | None:
    """An input of ``node`` (for an item of a tuple, an input of the op that made it) whose storage
    ``node``'s value shares, by the fake values Dynamo recorded: a view no list above names (an op
    that returns its input as it is). None where the values are unknown or no storage is shared."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def ref(t):
        try:
            return StorageWeakRef(t.untyped_storage()) if isinstance(t, torch.Tensor) else None
        except Exception:   # a value without a storage (a sparse or nested tensor, a subclass)
            return None

    own = ref(val(node))
    if own is None:
        return None
    inputs = list(node.all_input_nodes)
    if canon(node) == "getitem" and inputs:
        inputs += inputs[0].all_input_nodes
    return next((a for a in inputs if (r := ref(val(a))) is not None and r == own), None)


_GRAPH_SCANS: contextvars.ContextVar = contextvars.ContextVar("moe_compile_graph_scans", default=None)


@contextlib.contextmanager
def graph_scans_shared(shared: bool = True):
    """Inside (where ``shared``): a whole-graph scan (``per_graph``) is built once per graph and key and
    shared by every caller. For the passes that only read the graph (finders, checks): their results hold
    while no node changes, and a region's checks otherwise rescan the graph once per layer. Outside, or
    not ``shared`` (a pass that edits the graph): built per call."""
    token = _GRAPH_SCANS.set({} if shared else None)
    try:
        yield
    finally:
        _GRAPH_SCANS.reset(token)


def per_graph(graph: fx.Graph, key: str, build):
    """``build()``, or inside ``graph_scans_shared`` the value built for this graph and key before."""
    shared = _GRAPH_SCANS.get()
    if shared is None:
        return build()
    if (id(graph), key) not in shared:
        shared[id(graph), key] = (graph, build())   # the graph held: its id is not reused meanwhile
    return shared[id(graph), key][1]


def basic_index(node: fx.Node) -> bool:
    """``t[i]`` / ``t[a:b, None, ...]`` (a view), not ``t[index_tensor]`` (a copy); tuple outputs of
    ``chunk``/``split``/``topk`` are views of their producer too (conservative for ``topk``: no harm)."""
    idx = node.args[1]
    items = idx if isinstance(idx, tuple) else (idx,)
    return not any(isinstance(i, fx.Node) and hasattr(val(i), "dtype") for i in items)


def foreign_write(region: Region) -> fx.Node | None:
    """The first in-place write that lands on storage the region reads or computes while it matters,
    and is not one of the region's own writes; None if there is none.

    Where a write matters: on a tensor the rewrite reads as it is (the expert input, router ids and
    weights, expert weights, the accumulator), between the region's first and last node (the
    rewrite reads them once, after its last node); on a tensor computed inside the region or from
    the router's outputs on the way to it (offsets, a routing matrix, gathered weights: the rewrite
    computes its own from ids and weights), anywhere between its definition and the region's end."""
    order, writes = _graph_writes(region.x.graph)
    span = [order[n] for n in region.nodes if n in order]
    if not span:
        return None
    start, end = min(span), max(span)
    c = region.combine
    own = set(region.nodes) | set(c.mutations if isinstance(c, AccumulateInPlace) else c.erase)
    # ``acc[idx] += y`` is getitem (a copy), iadd on that copy, setitem: the iadd is the mutation's own
    own |= {a for m in tuple(own) for a in m.all_input_nodes if written(a) is not None}
    router = region.router
    inputs = {region.x, router.ids} | ({router.weights} if router.weights is not None else set())
    inputs |= {n for slot in region.experts.slots for n in slot if isinstance(n, fx.Node)}
    if isinstance(c, AccumulateInPlace):
        inputs |= {c.acc, *c.aliases} | ({c.base} if c.base is not None else set())
    elif c.base is not None:   # shared(x).scatter_add(..): the rewrite reads the base where the region ends
        inputs.add(c.base)
    # computed from the router's outputs on the way into the region (not the router itself, which stays),
    # and what those read that no input is computed from (``r = zeros(T, E); r.scatter_(1, ids, w)`` as a
    # statement: the combine reads the zeros node, whose zeros the rewrite assumes)
    # (walks bounded by graph order: a node computed from the router's outputs comes after the first of them,
    # one the region's nodes are computed from comes before its end; a whole-model graph holds many layers)
    outputs = [router.ids, router.weights]
    lo = min(order[o] for o in outputs if o is not None)
    before, past = (lambda n: order.get(n, lo) < lo), (lambda n: order.get(n, end) > end)   # unknown: walked
    derived = (descendants(outputs, past) & ancestors(region.nodes, before) - ancestors(outputs, before)) \
        | set(region.nodes)
    derived |= ancestors(derived) - ancestors(inputs)
    memo: dict = per_graph(region.x.graph, "writes.storage_base", dict)   # shared by the graph's regions
    since: dict = {}   # storage -> order from which a write to it counts
    for n in inputs:
        b = storage_base(n, memo)
        since[b] = min(since.get(b, start), start)
    for n in derived - inputs:
        b = storage_base(n, memo)
        since[b] = min(since.get(b, order[n]), order[n])
    # a [T, E] weight matrix (Llama 4: sigmoid(full(-inf).scatter_(1, ids, s))): the rewrite reads its
    # selected entries and takes the rest for 0, from the fill it was built in: both count from their definition
    pre = ancestors([router.weights]) if router.per_expert and router.weights is not None else set()
    for n in pre - ancestors(inputs - {router.weights}):
        if n is router.weights or canon(n) in _FILLS:
            b = storage_base(n, memo)
            since[b] = min(since.get(b, order[n]), order[n])
    # eager reads an input where a node the rewrite replaces reads it (``zeros.scatter_(1, ids, w)`` copies w
    # before the region starts); the rewrite reads it where the region ends: a write in between counts
    first_read: dict = {}   # storage -> order of the first replaced node reading it (not a view of it)
    for n in derived:
        if canon(n) in _SHAPE_ONLY:
            continue
        for a in n.all_input_nodes:
            b = storage_base(a, memo)
            if b in since and storage_base(n, memo) is not b:
                since[b] = min(since[b], order[n])
                first_read[b] = min(first_read.get(b, order[n]), order[n])
    for i, n, target in writes:
        if i >= end:
            break
        if n not in own:
            b = storage_base(target, memo)
            if b in since and order[n] > since[b] and not _builds_matrix(n, b, router, first_read, order, pre):
                return n
    return None


def graph_order(graph: fx.Graph) -> dict:
    """{node: its index in the graph} (``per_graph``: built once per graph while the passes only read it)."""
    return _graph_writes(graph)[0]


def _graph_writes(graph: fx.Graph) -> tuple[dict, list]:
    """({node: its index in the graph}, [(index, node, the tensor it writes)] of the graph's in-place writes
    in graph order): one scan per graph while the passes only read it (``per_graph``), not one per region."""
    def build():
        order, writes = {}, []
        for i, n in enumerate(graph.nodes):
            order[n] = i
            target = written(n)
            if target is not None:
                writes.append((i, n, target))
        return order, writes

    return per_graph(graph, "writes.order", build)


def _builds_matrix(n: fx.Node, b: fx.Node, router, first_read: dict, order: dict, pre: set) -> bool:
    """``n`` is the scatter_ that builds the routing matrix in its fresh fill ``b``, the matrix the rewrite
    computes itself: ``zeros(T, E).scatter_(1, ids, w)`` with the router's ids and weights, before the
    region reads it (``r = zeros(..); r.scatter_(..)`` as a statement, or chained); or, for a [T, E]
    weight matrix, ``full(-inf).scatter_(1, ids, s)`` on its way (Llama 4)."""
    if canon(n) != "scatter_" or written(n) is not b or arg(n, 1, "dim") != 1 or arg(n, 2, "index") is not router.ids \
            or arg(n, 4, "reduce") is not None:
        return False
    if canon(b) in _FILLS:
        return n in pre
    return canon(b) in ("zeros", "zeros_like", "new_zeros") and arg(n, 3, "src") is router.weights \
        and order[n] < first_read.get(b, len(order))

