"""The one description of an MoE region, shared by every finder, the legality check and the lowering.

Legend: T tokens, K top-k slots, N = T*K routed (token, slot) pairs, E experts, H width.

A finder (``loop_regions``, ``grouped_regions``) turns what it saw in a Dynamo graph into a
``Candidate``: the assembled ``Region`` when every part was found, and the ``Finding``s it made on
the way (facts such as "an op the rewrite cannot replay touches the expert rows", each with a
stable code from ``reasons.py``). ``legality.check`` decides: a candidate with findings, or whose
region breaks a rule, is refused with the finding's code and wording; otherwise the region goes to
``lowering.region.lower_region``, the only code that edits the graph.

    Region
      router   Router(ids [T, K] | [T], weights multiplied into the expert output (None: 1), K, E;
               or into the expert input with scale_input)
      x        the expert input [T, H] (rows are gathered from it)
      experts  ExpertMLP: the expert function as steps replayed once over all routed rows; each
               linear names its per-expert weight (and bias) operands by slot
      combine  AccumulateInPlace (per-expert loops: acc[idx] += ..., index_add_, ...)
               | ReplaceOutput    (all-pairs forms: one node computes the combined output)
      nodes    every node of the region (the lowering erases those left dead)

Node-valued fields are ``torch.fx.Node``s of the graph being rewritten.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx


@dataclass(frozen=True)
class Router:
    """The router outputs a region consumes (the router itself stays in the graph).

    ``weights``: the node the graph multiplies the expert rows by, taken as it is (never a node
    that only has the same forward value: ``legality.weights_path`` checks the ops between them);
    the lowering reshapes it to [T, K].

    ``scale_input``: the weights multiply each expert's INPUT row (expert(x * w), Llama 4); the
    lowering weights the permuted rows before the expert and combines with weight 1 (never moved past
    a nonlinear op). ``per_expert``: ``weights`` is a [T, E] matrix that is zero off the selection;
    the lowering takes each pair's weight with gather(weights, 1, ids). ``input_dtype``: with
    ``scale_input``, the dtype the model casts its input rows to before the product (torchtitan's
    ``rows.to(float32) * w``), replayed by the lowering; None when it multiplies the rows as they are."""
    ids: fx.Node
    weights: fx.Node | None
    top_k: int
    num_experts: int
    scale_input: bool = False
    per_expert: bool = False
    input_dtype: object = None


@dataclass(frozen=True)
class Step:
    """One op of the expert function. ``args``/``kwargs`` encode operands as ("in",) for the
    region's rows, ("step", i) for step i's result, ("slot", s) for operand slot s, or constants."""
    op: str                   # fx op: call_function | call_method
    target: object
    args: tuple
    kwargs: tuple             # sorted (key, value) pairs
    linear: tuple | None      # (weight slot, bias slot or None, layout "nk" | "kn") for linears
    dtype: object = None      # linears: the dtype the product computed in (Dynamo's recorded value), which
                              # torch.autocast makes differ from the operands'
    bias_after: bool = False  # the bias slot is added after the product (``x @ W + b``), not F.linear's own
    sum_dtype: object = None  # bias_after: the dtype of the sum (the product's, or the bias's when that is
                              # wider and the add is not in place: torch's type promotion, under autocast)


@dataclass(frozen=True)
class ExpertMLP:
    """The expert function. ``slots[s]``: expert 0..E-1's operand of slot s, or one node for all
    experts (a 3-D weight [E, in, out] / [E, out, in], a 2-D bias [E, out], or a shared operand)."""
    steps: tuple[Step, ...]
    slots: tuple[tuple[fx.Node, ...], ...]


@dataclass(frozen=True)
class AccumulateInPlace:
    """Loop forms: expert contributions are added into ``acc`` in place (``acc`` starts as zeros, or
    as ``base`` when not None); ``readers`` read the finished sum through ``aliases``.
    ``overwrite``: top-1 writes ``acc[idx] = c`` over a base (``out = x.clone()`` in Switch-style
    layers): a routed token's row is replaced by its expert's output, an unrouted one keeps the base."""
    acc: fx.Node
    base: fx.Node | None
    dtype: torch.dtype
    aliases: tuple[fx.Node, ...]
    mutations: tuple[fx.Node, ...]
    readers: tuple[fx.Node, ...]
    overwrite: bool = False


@dataclass(frozen=True)
class ReplaceOutput:
    """All-pairs forms: ``output`` (and its in-place ``aliases``, read after it) is the combined
    result; ``erase`` lists the region's side-effecting nodes on region-internal tensors. ``base``: the
    tensor an out-of-place accumulation adds the rows to (``shared(x).scatter_add(0, idx, rows)``,
    torchtitan's shared expert): the output is base + the combined rows (None: zeros)."""
    output: fx.Node
    dtype: torch.dtype
    aliases: tuple[fx.Node, ...] = ()
    erase: tuple[fx.Node, ...] = ()
    base: fx.Node | None = None


Combine = AccumulateInPlace | ReplaceOutput


@dataclass(frozen=True)
class Region:
    module: str               # qualified module path, e.g. "model.layers.0.mlp.experts"
    form: str                 # e.g. "loop/where+index_add_", "sorted/gather-sum"
    where: str                # file:line in the user's code
    x: fx.Node
    router: Router
    experts: ExpertMLP
    combine: Combine
    nodes: tuple[fx.Node, ...]


@dataclass(frozen=True)
class Finding:
    """A fact a finder observed that blocks the rewrite: ``code`` is a key of
    ``reasons.REASONS``; ``detail`` fills its message (sorted (key, value) pairs)."""
    code: str
    node: fx.Node | None = None
    detail: tuple[tuple[str, object], ...] = ()

    @staticmethod
    def of(code: str, node: fx.Node | None = None, /, **detail) -> "Finding":
        return Finding(code, node, tuple(sorted(detail.items())))


@dataclass(frozen=True)
class Candidate:
    """What a finder found: ``region`` is None when the parts could not be assembled (then
    ``findings`` says why)."""
    module: str
    form: str
    where: str
    region: Region | None
    findings: tuple[Finding, ...] = ()
    num_experts: int = 0
    top_k: int = 0


def stacked_source(nodes: tuple[fx.Node, ...]) -> fx.Node | None:
    """The one node holding every expert's operand: ``nodes[0]`` when it is the only one (a 3-D
    weight or 2-D bias for all experts), or P when expert e's operand is P[e] for every e."""
    if len(nodes) == 1:
        return nodes[0]
    first = nodes[0]
    src = first.args[0] if first.op == "call_function" and first.target is operator.getitem else None
    if src is None or any(n.op != "call_function" or n.target is not operator.getitem
                          or not _same_value(n.args[0], src) or n.args[1] != e for e, n in enumerate(nodes)):
        return None
    return src


def _same_value(a, b) -> bool:
    """One node, or two calls of the ep_experts marker on the same value (a module property read
    once per expert in a loop traces one marker call per read, each on its own trace of the
    property's body: ``to_local()`` of the same DTensor Parameter, ``_DivideGrad`` applied to it)."""
    return a is b or (is_ep_marker(a) and is_ep_marker(b) and a.args[1:] == b.args[1:] and a.kwargs == b.kwargs
                      and _same_trace(a.args[0], b.args[0]))


def _same_trace(a, b) -> bool:
    """Two traces of one pure computation: the same node, or the same ``to_local()`` / getitem /
    ``autograd_function_apply`` (forward and backward bodies of identical code: the same values and
    the same gradient) of the same inputs. Anything else is not known to be the same value."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return False
    if _same_to_local(a, b):
        return _same_trace(a.args[0], b.args[0])
    if (a.op, a.target) != (b.op, b.target) or len(a.args) != len(b.args) or a.kwargs != b.kwargs:
        return False
    if a.op == "call_function" and a.target is operator.getitem:
        return a.args[1] == b.args[1] and _same_trace(a.args[0], b.args[0])
    if a.op == "call_function" and a.target is getattr(torch.ops.higher_order, "autograd_function_apply", None):
        bodies = all(_same_body(x, y) for x, y in zip(a.args[:2], b.args[:2]))
        return bodies and all(_same_trace(x, y) for x, y in zip(a.args[2:], b.args[2:]))
    return False


def _same_to_local(a: fx.Node, b: fx.Node) -> bool:
    """Two ``to_local()`` calls with the same arguments: ``x.to_local()`` (torch 2.13), or torch 2.11's
    function ``prim_to_local``, one closure per call over the call's arguments (equal cells: equal calls)."""
    if len(a.args) != 1 or len(b.args) != 1 or a.kwargs != b.kwargs or a.op != b.op:
        return False
    if a.op == "call_method":
        return a.target == b.target == "to_local"
    fa, fb = a.target, b.target
    names = {getattr(fa, "__name__", ""), getattr(fb, "__name__", "")}
    same_code = getattr(fa, "__code__", 0) is getattr(fb, "__code__", 1)
    if a.op != "call_function" or names != {"prim_to_local"} or not same_code:
        return False
    try:
        cells = [[c.cell_contents for c in (f.__closure__ or ())] for f in (fa, fb)]
        return bool(cells[0] == cells[1])
    except Exception:  # noqa: BLE001  (arguments that cannot be read or compared are not known to be equal)
        return False


def _same_body(a, b) -> bool:
    """Two ``get_attr`` nodes of subgraphs that compute the same thing: node for node the same ops on
    the same arguments (names aside: each trace names its placeholders after its own nodes)."""
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.op == b.op == "get_attr"):
        return False
    owner = a.graph.owning_module
    x, y = getattr(owner, a.target, None), getattr(owner, b.target, None)
    if not (isinstance(x, fx.GraphModule) and isinstance(y, fx.GraphModule)):
        return False
    xs, ys = list(x.graph.nodes), list(y.graph.nodes)
    if len(xs) != len(ys):
        return False
    pair = dict(zip(xs, ys))
    for n, m in pair.items():
        if n.op != m.op or n.op == "get_attr" or (n.op != "placeholder" and n.target != m.target):
            return False
        if fx.map_arg((n.args, n.kwargs), lambda v: pair[v]) != (m.args, m.kwargs):
            return False
    return True


# ops a weight may pass through between the ep_experts marker and the expert linear
EP_VIEWS = {"transpose", "permute", "t", "contiguous", "swapaxes", "mT"}


def is_ep_marker(node) -> bool:
    target = getattr(node, "target", None)
    name = getattr(target, "_qualified_op_name", None) or getattr(getattr(target, "_overloadpacket", None),
                                                                 "_qualified_op_name", None)
    return name == "moe_compile::ep_experts"


def ep_marker(nodes: tuple[fx.Node, ...]) -> fx.Node | None:
    """The ``moe_compile.ep_experts`` marker behind an expert operand slot (experts sharded over an
    expert-parallel mesh by ``parallelize_experts``: args (local shard, E, group name)), possibly
    through views (``W.transpose(-2, -1)``), else None."""
    from .normalize import canon

    src = stacked_source(nodes)
    while src is not None and not is_ep_marker(src) and canon(src) in EP_VIEWS \
            and isinstance(src.args[0] if src.args else None, fx.Node):
        src = src.args[0]
    return src if is_ep_marker(src) else None
