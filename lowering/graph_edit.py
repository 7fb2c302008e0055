"""Graph-editing primitives of the lowering: node building with fake values, dead-code elimination,
removal of the runtime asserts that guarded a region's data-dependent sizes.

Dynamo graphs are not functional: in-place method calls (``out.index_add_``), ``setitem`` and
runtime asserts have no users but must stay, so every erasure here goes through ``is_impure``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from moe_compile.passes.normalize import ASSERT_OPS, SIZE_QUERIES, SYM_NUMBERS, canon, is_inplace_method, val
from moe_compile.passes.writes import storage_base, writes_in_place, written


class LoweringError(RuntimeError):
    """Raised when a region cannot be rewritten; the pipeline then keeps the original graph."""


class InvalidSetup(ValueError):
    """The user's setup cannot run correctly (e.g. FSDP sharding expert shards across ranks that hold
    different experts): raised to the user, never turned into an unrewritten graph."""


class GraphBuilder:
    """Creates nodes after a cursor, giving each a fake ``example_value`` computed under ``mode``
    (the fake mode of the graph's own values) and the stack/module metadata of ``meta_from``."""

    def __init__(self, graph: fx.Graph, after: fx.Node, mode, meta_from: fx.Node):
        self.graph, self.cursor, self.mode, self.meta_from = graph, after, mode, meta_from

    @staticmethod
    def fake_mode_of(node: fx.Node, who: str):
        mode = getattr(val(node), "fake_mode", None)
        if mode is None:
            raise LoweringError(f"{who}: `{node.name}` has no fake value to propagate metadata from")
        return mode

    def _val(self, x):
        if isinstance(x, fx.Node):
            return x.meta["example_value"]
        if isinstance(x, (list, tuple)):
            return type(x)(self._val(i) for i in x)
        if isinstance(x, dict):
            return {key: self._val(i) for key, i in x.items()}
        return x

    def __call__(self, op: str, target, args=(), kwargs=None) -> fx.Node:
        kwargs = kwargs or {}
        with self.graph.inserting_after(self.cursor):
            node = self.graph.create_node(op, target, tuple(args), dict(kwargs))
        self.cursor = node
        a, k = self._val(node.args), self._val(node.kwargs)
        with self.mode:
            v = getattr(a[0], target)(*a[1:], **k) if op == "call_method" else target(*a, **k)
        node.meta["example_value"] = v
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in self.meta_from.meta:
                node.meta[key] = self.meta_from.meta[key]
        return node

    def fn(self, target, *args, **kwargs):
        return self("call_function", target, args, kwargs)

    def method(self, name, *args, **kwargs):
        return self("call_method", name, args, kwargs)


def is_impure(node: fx.Node) -> bool:
    """Kept by dead-code elimination even without users: in-place methods and functions, ``setitem``, asserts,
    torch's side-effectful functions, and any call whose recorded value is not a tensor or a size
    (Dynamo records context changes this way: grad mode, autocast, functorch's vmap nesting around
    ``associative_scan``, API-usage logging)."""
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "call_method":
        return is_inplace_method(node) or writes_in_place(node)
    if node.op != "call_function":
        return False
    if node.target in (operator.setitem,) or canon(node) in ASSERT_OPS or node.is_impure() \
            or _kept_write(node):
        return True
    return node.target.__module__ != "_operator" and not _computes_values(node) \
        if hasattr(node.target, "__module__") else False


def _kept_write(node: fx.Node) -> bool:
    """A torch function that writes its arguments (``torch.add(b, 1, out=b)``, ``torch.fill_``,
    ``torch._foreach_add_``, ``torch.index_put_``, ``operator.iadd``; they record a tensor value like
    pure calls) into storage that outlives it: an input's, or a tensor something else reads. A write
    into a temporary nothing else reads is dead: ``out[tok] += y`` leaves ``iadd(out[tok], y)`` (a
    copy, by advanced indexing) once the rewrite has erased the ``setitem`` that read it; so is one whose
    other readers only ask its sizes (Dynamo's runtime asserts on ``out[mask]``'s data-dependent length:
    kept, they kept the write, the expert code feeding it and a nonzero per expert)."""
    if not writes_in_place(node):
        return False
    target = written(node)
    memo: dict = {}
    for t in [target] if target is not None else node.all_input_nodes:   # a list or a tuple out=: any input
        base = storage_base(t, memo)
        if base.op in ("placeholder", "get_attr") or any(u is not node and canon(u) not in SIZE_QUERIES
                                                         for u in base.users):
            return True
    return False


_VALUES = (torch.Tensor, *SYM_NUMBERS)


def _computes_values(node: fx.Node) -> bool:
    """The node's recorded value is tensors or sizes (Dynamo records none for calls it keeps for
    their effect; the nodes the lowering builds always have one)."""
    v = val(node)
    if isinstance(v, (tuple, list)):
        return any(isinstance(x, _VALUES) for x in v)
    return isinstance(v, _VALUES)


def eliminate_dead_code(g: fx.Graph) -> None:
    """Erase nodes without users that ``is_impure`` calls pure, in this graph only.

    Not ``fx.Graph.eliminate_dead_code``: that one also walks every subgraph the graph reaches
    through ``get_attr`` (the bodies of higher-order ops such as a custom autograd Function's
    forward and backward) with torch's default impurity rule, which calls Dynamo's in-place
    method calls pure. It erased ``scatter_add_`` from the backward of Hugging Face PhiMoE's
    ``PhimoeMultiplier`` and trained the router with a wrong gradient."""
    for node in reversed(g.nodes):
        if not node.users and not is_impure(node):
            g.erase_node(node)


def finish(gm: fx.GraphModule) -> None:
    """After a rewrite: drop the orphaned asserts and dead code, lint. The caller regenerates the code
    (``gm.recompile()``) once its last edit is made: each regeneration of a whole-model graph's code
    costs ~0.2 s at 12k nodes (review helper-83), and the dynamo stage edits a graph in four passes."""
    erase_orphaned_asserts(gm.graph)
    eliminate_dead_code(gm.graph)
    gm.graph.lint()


def in_graph_order(g: fx.Graph, nodes) -> list[fx.Node]:
    """``nodes`` sorted by their position in ``g``: fx nodes compare by position in O(1) (their sort keys);
    a torch without that gets one order table (``list(g.nodes).index`` per node made lowering quadratic in a
    model's size: review helper-83, 1.7 s of 9.6 at 128 experts x 8 layers)."""
    try:
        return sorted(nodes)
    except TypeError:
        order = {n: i for i, n in enumerate(g.nodes)}
        return sorted(nodes, key=order.__getitem__)


def erase_orphaned_asserts(g: fx.Graph) -> None:
    """Remove runtime asserts whose inputs are only kept alive by them (a rewritten region's sizes)."""
    asserts = [n for n in g.nodes if n.op == "call_function" and canon(n) in ASSERT_OPS]
    live: set[fx.Node] = set()
    skip = set(asserts)   # a set: Dynamo adds an assert per expert (a list made this quadratic: helper-83)
    roots = [n for n in g.nodes if n not in skip and is_impure(n)]
    while roots:
        n = roots.pop()
        if n in live:
            continue
        live.add(n)
        roots.extend(n.all_input_nodes)
    for a in reversed(asserts):
        if not all(_alive_without_asserts(i, live) for i in a.all_input_nodes):
            g.erase_node(a)


def _alive_without_asserts(n: fx.Node, live: set) -> bool:
    """True if n's value is needed by something other than asserts (sym-size chains count as
    needed when their tensor source is)."""
    if n in live:
        return True
    stack, seen = [n], set()
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        if m in live:
            return True
        if isinstance(val(m), torch.Tensor):
            continue  # a tensor that nothing live needs: the assert guards a dead value
        stack.extend(m.all_input_nodes)
    return False


# What Dynamo hangs on its GraphModule besides the graph (torch/_dynamo/output_graph.py), read by
# AOTAutograd: _param_name_to_source + each placeholder's _dynamo_source (which inputs are
# parameters: static for CUDA graphs, deduplicated guards) and meta["dynamo_compile_id"].
_DYNAMO_GM_ATTRS = ("_param_name_to_source", "_source_to_user_stacks", "compile_subgraph_reason", "_backend_id")


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a node-by-node copy of gm's graph (node meta copied shallowly) that
    keeps Dynamo's annotations. Without them AOTAutograd treats the copy as a non-Dynamo graph and
    marks no parameter static: CUDA graphs then copied every expert weight into their input buffers
    on every replay (0.9 ms per step for a Qwen3-30B-A3B layer on an H200).

    Of Dynamo's lazy class where gm is (``_LazyGraphModule``): its code is generated where it first runs
    or is read, once, not here and again after each pass that edits it (0.2-0.6 s each for a graph of
    12k nodes: 128 experts x 4 layers); a copy discarded (nothing rewritten) never generates any."""
    graph = fx.Graph()
    val_map: dict = {}
    out = graph.graph_copy(gm.graph, val_map, return_output_node=True)
    if out is not None:
        graph.output(out[0] if isinstance(out, tuple) else out.args[0])
    new = _lazy_if(gm)(gm, graph)
    # subgraphs of higher-order ops (autograd.Function bodies, checkpoint, cond) are copied too:
    # the copy must share no graph with the original, which is what runs if a pass fails
    for node in graph.find_nodes(op="get_attr"):
        sub = getattr(new, node.target, None)
        if isinstance(sub, fx.GraphModule) and "." not in node.target:
            setattr(new, node.target, copy_graph_module(sub))
    new.meta.update(getattr(gm, "meta", {}))
    for name in _DYNAMO_GM_ATTRS:
        if hasattr(gm, name):
            setattr(new, name, getattr(gm, name))
    for old, copied in val_map.items():
        if hasattr(old, "_dynamo_source"):
            copied._dynamo_source = old._dynamo_source
    return new


def _lazy_if(gm: fx.GraphModule) -> type:
    """The GraphModule class for a copy of ``gm``: torch's lazy one where gm is lazy (a private torch class,
    present in torch >= 2.2; where it is not, the eager ``fx.GraphModule``)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return fx.GraphModule
    return _LazyGraphModule if isinstance(gm, _LazyGraphModule) else fx.GraphModule
