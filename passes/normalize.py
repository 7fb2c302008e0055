"""One table that names Dynamo graph ops the same way whatever their spelling.

Dynamo graphs are torch-level and not normalised: ``sel == i`` is ``operator.eq`` on 2.13 but a
``__eq__`` method call on 2.11; ``F.linear`` may be ``torch._C._nn.linear``; ``x.mul(y)``,
``torch.mul(x, y)`` and ``x * y`` are three spellings of one op. ``canon(node)`` maps all of them
to one short name ("eq", "linear", "mul", ...), or None for nodes that are not calls.
"""
from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

_OPERATORS = {
    operator.eq: "eq", operator.ne: "ne", operator.mul: "mul", operator.imul: "mul",
    operator.add: "add", operator.iadd: "iadd", operator.sub: "sub", operator.isub: "sub",
    operator.truediv: "div", operator.itruediv: "div", operator.floordiv: "floordiv",
    operator.mod: "mod", operator.getitem: "getitem", operator.setitem: "setitem",
    operator.neg: "neg", operator.matmul: "matmul", operator.gt: "gt", operator.ge: "ge",
    operator.lt: "lt", operator.le: "le", operator.pow: "pow", operator.and_: "and", operator.or_: "or",
}

# method / function names that differ from the canonical name
_ALIASES = {
    "__eq__": "eq", "__ne__": "ne", "__mul__": "mul", "__rmul__": "mul", "__add__": "add",
    "__radd__": "add", "__iadd__": "iadd", "__sub__": "sub", "__truediv__": "div", "__floordiv__": "floordiv",
    "__getitem__": "getitem", "__setitem__": "setitem", "__matmul__": "matmul", "__neg__": "neg",
    "__gt__": "gt", "__ge__": "ge", "__lt__": "lt", "__le__": "le", "__and__": "and", "__or__": "or",
    "__pow__": "pow", "multiply": "mul", "true_divide": "div", "divide": "div", "subtract": "sub",
    "floor_divide": "floordiv", "remainder": "mod", "fmod": "mod", "greater": "gt", "greater_equal": "ge",
    "less": "lt", "less_equal": "le", "not_equal": "ne", "concat": "cat", "concatenate": "cat",
    "sigmoid_": "sigmoid", "add_": "add_inplace", "mul_": "mul_inplace", "clip": "clamp",
    "prim_to_local": "to_local",   # torch 2.11's Dynamo traces DTensor.to_local() as a function of that name
    "argsort": "argsort", "type_as": "type_as", "swapaxes": "transpose", "swapdims": "transpose",
}


def fn_name(fn: Any) -> str:
    if isinstance(fn, torch._ops.OpOverload):
        return fn._opname
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return fn._qualified_op_name.split("::")[-1]
    return getattr(fn, "__name__", str(fn))


_META_KEY = "moe_compile_op"


def annotate(graph: fx.Graph) -> None:
    """The ``normalize`` pass: name every call node's op once (``canon`` then reads the name)."""
    for node in graph.nodes:
        node.meta[_META_KEY] = _canon(node)


# canonical ops that read only a tensor's metadata (its sizes, strides, rank), never its values
SIZE_QUERIES = {"sym_size", "size", "dim", "sym_numel", "numel", "sym_stride"}
# ``x[:, None]`` / ``x[..., None]`` of a 1-D x: its values as one column, in their order
COLUMN_INDEXES = ((slice(None), None), (Ellipsis, None))

# runtime asserts Dynamo leaves on data-dependent sizes: no users, kept for their effect
ASSERT_OPS = {"_assert_scalar", "sym_constrain_range_for_size", "sym_constrain_range", "_assert_async",
              "_check_is_size", "_check"}


def canon(node: fx.Node) -> str | None:
    """Canonical op name of a call node, else None."""
    name = node.meta.get(_META_KEY, _UNSET)
    return _canon(node) if name is _UNSET else name


_UNSET = object()


def _canon(node: fx.Node) -> str | None:
    if node.op == "call_function":
        t = node.target
        if t in _OPERATORS:
            return _OPERATORS[t]
        if isinstance(t, torch._ops.OpOverload) and t.namespace not in ("aten", "prim"):
            return f"{op_namespace(t)}::{t._opname}"
        if isinstance(t, torch._ops.OpOverloadPacket) and t._qualified_op_name.split("::")[0] not in ("aten",):
            return t._qualified_op_name.replace(f"{_TWINS}::", "moe_compile::", 1)
        name = fn_name(t)
    elif node.op == "call_method":
        name = node.target
    elif node.op == "call_module":
        return "module"
    else:
        return None
    return _ALIASES.get(name, name)


_TWINS = "moe_compile_rt"   # kernels/runtime_ops.NAMESPACE: the twins compiled graphs call, the same ops


def op_namespace(op: torch._ops.OpOverload) -> str:
    """An op's namespace, with the moe_compile_rt twins counted as moe_compile."""
    return "moe_compile" if op.namespace == _TWINS else op.namespace


def is_inplace_method(node: fx.Node) -> bool:
    """``t.scatter_(...)``, ``t.add_(...)``: a method call that writes its own ``self`` (not ``__dunder__``)."""
    return node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__")


def arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument of a call node (positions counted with self for methods)."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def val(n: Any) -> Any:
    """The fake value Dynamo recorded for a node (tensor, tuple, SymInt), or the constant itself."""
    if isinstance(n, fx.Node):
        return n.meta.get("example_value", n.meta.get("val"))
    return n


def shape(n: Any) -> tuple | None:
    v = val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype_of(n: Any) -> torch.dtype | None:
    v = val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


ROUTE_OUTPUTS = {"perm": 0, "inv": 1, "offsets": 2}   # moe_compile.route_permute's outputs, by index


def route_permute_output(node: Any, name: str) -> fx.Node | None:
    """The ``moe_compile.route_permute`` call whose output ``name`` (``ROUTE_OUTPUTS``) ``node`` is
    (``getitem(route_permute(...), i)``), else None."""
    if not isinstance(node, fx.Node) or canon(node) != "getitem" or node.args[1] != ROUTE_OUTPUTS[name]:
        return None
    rp = node.args[0]
    return rp if isinstance(rp, fx.Node) and canon(rp) == "moe_compile::route_permute" else None


SYM_NUMBERS = (torch.SymInt, torch.SymFloat, torch.SymBool)   # a graph's symbolic numbers (sizes, dynamic floats)
_TRACE_FRAME = re.compile(r'\s*File "([^"]+)", line (\d+), in (\S+)')


def stack_frames(node: fx.Node) -> list[tuple[str, int, str, str]]:
    """(file, line, function, source line) of each frame of the user stack recorded on the node
    (``meta["stack_trace"]``), outermost first."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    out = []
    for i, line in enumerate(lines):
        m = _TRACE_FRAME.match(line)
        if m:
            nxt = lines[i + 1].strip() if i + 1 < len(lines) and not _TRACE_FRAME.match(lines[i + 1]) else ""
            out.append((m.group(1), int(m.group(2)), m.group(3), nxt))
    return out


def where_in_user_code(node: fx.Node) -> str:
    """'file.py:LINE' of the user's source line that produced the node (last frame), or ''."""
    frames = stack_frames(node)
    return f"{frames[-1][0].rsplit('/', 1)[-1]}:{frames[-1][1]}" if frames else ""


def where_in_block(node: fx.Node, router: fx.Node) -> str:
    """'file.py:LINE' of the line in the MoE block's own code that reaches ``node``: in the deepest frame that
    ``node``'s stack shares with the router's (``out += self.experts[e](x[tok])``, not the expert MLP's own
    ``return self.down(...)``), else ``where_in_user_code(node)``."""
    frames, theirs = stack_frames(node), stack_frames(router)
    shared = 0
    while shared < min(len(frames), len(theirs)) and frames[shared][::2] == theirs[shared][::2]:
        shared += 1   # same file and function
    if not shared:
        return where_in_user_code(node)
    file, line = frames[shared - 1][:2]
    return f"{file.rsplit('/', 1)[-1]}:{line}"


def user_name(node: fx.Node) -> str:
    """A name a user knows for the node: its module's path (``moe.experts.0.gate``), else its source line."""
    return module_path(node) or where_in_user_code(node) or node.name


def same_shape(a: tuple | None, b: tuple | None) -> bool:
    """Two shapes (of ints or SymInts) provably equal: as many dims, each provably the same size."""
    return a is not None and b is not None and len(a) == len(b) and all(
        statically_known_true(x == y) for x, y in zip(a, b))


def source_name(n: fx.Node) -> str:
    """Dynamo's name of a graph input (``L['self']._parameters['w']``), or ''."""
    src = getattr(n, "_dynamo_source", None)
    name = getattr(src, "name", None)   # a method in torch 2.11, a property in 2.13
    try:
        return str(name() if callable(name) else name or "")
    except Exception:  # noqa: BLE001  (a source that cannot name itself)
        return ""


def module_path(node: fx.Node) -> str:
    """Qualified module name of the innermost nn.Module that produced the node ('' at top)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _clean_module_path(path)


def attribute_path(n: fx.Node) -> str:
    """Dotted path of a parameter or buffer graph input, relative to its frame's root as
    ``module_path`` spells modules (``L['self']._modules['mlp']._parameters['weight']`` ->
    ``mlp.weight``), or '' for any other input."""
    name = source_name(n)
    if "._parameters['" not in name and "._buffers['" not in name:
        return ""
    return _clean_module_path(name.replace("._parameters['", "._modules['").replace("._buffers['", "._modules['"))


def _self_names() -> tuple[str, ...]:
    """Names of the traced frame's own module: ``self``, and the first argument of the method Dynamo is
    tracing when it is spelled otherwise (``def forward(s, x)``: Dynamo's paths start ``L['s']``, which
    a report names from the module itself, as explain() does)."""
    tracing = torch._guards.TracingContext.try_get()
    codes = getattr(tracing, "traced_code", None) or ()
    code = codes[0] if codes else None
    qualname = getattr(code, "co_qualname", "").split(".")
    if code is None or code.co_argcount < 1 or len(qualname) < 2 or qualname[-2] == "<locals>":
        return ("self",)   # not a method: its first argument is a module the user named
    return ("self", code.co_varnames[0])


def _clean_module_path(path: str) -> str:
    # Dynamo spells it L['self'].layers[0].mlp or L['self'].experts._modules['0'] depending on version;
    # a module reached through a local or global other than self starts with L['block'] / G['model']
    path = re.sub(r"^[LG]\['([^']*)'\]", lambda m: "" if m.group(1) in _self_names() else m.group(1), path)
    # a module whose class defines __getattr__ (peft's wrappers) is read through its instance dict:
    # L['self'].__dict__['_modules']['base_model']
    path = re.sub(r"\.__dict__\['_(?:modules|parameters|buffers)'\]\['([^']*)'\]", r".\1", path)
    path = path.replace("._modules['", ".").replace("']", "")
    path = path.replace("[", ".").replace("]", "")
    path = path.strip(".")
    # a block compiled in place (module.compile(), compile_blocks) reached by a hook's inlined call from the
    # model's trace: layers.0._compiled_call_impl._torchdynamo_inline.__self__.mlp is layers.0.mlp
    path = path.replace("._compiled_call_impl._torchdynamo_inline.__self__", "")
    # a module reached through other objects (peft's parametrized weights: type(...).__dict__[...].fget's
    # closure) has no attribute path from the model: none, so a region is named by its other nodes (helper-82)
    return path if re.fullmatch(r"[\w.]*", path) and "__closure__" not in path else ""


def common_module(nodes) -> str:
    """Longest common dotted prefix of the nodes' module paths."""
    paths = [module_path(n).split(".") for n in nodes if module_path(n)]
    if not paths:
        return ""
    prefix = paths[0]
    for p in paths[1:]:
        i = 0
        while i < min(len(prefix), len(p)) and prefix[i] == p[i]:
            i += 1
        prefix = prefix[:i]
    return ".".join(prefix)


def _reachable(starts, step) -> set[fx.Node]:
    """The nodes among ``starts`` (anything else, e.g. None, is skipped) and every node reached from
    them by ``step`` (a node's users, or its inputs)."""
    seen, stack = set(), [n for n in starts if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(step(n))
    return seen


def descendants(nodes, stop=None) -> set[fx.Node]:
    """``nodes`` and every node computed from them; with ``stop``, not walked past a node for which
    ``stop(node)`` holds (the node itself is included)."""
    return _reachable(nodes, lambda n: () if stop is not None and stop(n) else n.users)


def ancestors(nodes, stop=None) -> set[fx.Node]:
    """``nodes`` and every node they are computed from; with ``stop``, not walked past a node for which
    ``stop(node)`` holds (the node itself is included)."""
    return _reachable(nodes, lambda n: () if stop is not None and stop(n) else n.all_input_nodes)


_SAME_VALUES = {"to", "long", "int", "contiguous", "clone", "detach"}


def dtype_view(n: fx.Node) -> bool:
    """``t.view(dtype)``: the same bytes read as another dtype, not the same values."""
    return canon(n) == "view" and any(isinstance(a, torch.dtype) for a in (*n.args[1:], *n.kwargs.values()))


def _index_source(ids: fx.Node, through) -> fx.Node | None:
    """The ``topk`` / ``max(dim)`` / ``argmax`` node whose index output ``ids`` is (its ``[1]`` or
    ``.indices``, or the argmax itself), reached back through ops named in ``through``; else None."""
    n = ids
    while canon(n) in through and n.args and isinstance(n.args[0], fx.Node) and not dtype_view(n):
        n = n.args[0]
    op = canon(n)
    if op in ("getitem", "getattr") and isinstance(n.args[0], fx.Node) and canon(n.args[0]) in ("topk", "max") \
            and n.args[1] in (1, "indices") and "out" not in n.args[0].kwargs:   # out=: buffers others may write
        return n.args[0]
    return n if op == "argmax" and "out" not in n.kwargs else None


def distinct_per_row(ids: fx.Node) -> bool:
    """True if the integer tensor ``ids`` [T, K] cannot name one expert twice in a row: it is the
    index output of ``topk`` / ``max(dim)`` / ``argmax`` (through casts and copies), or K == 1."""
    s = shape(ids)
    if s is not None and len(s) == 2 and s[-1] == 1:
        return True
    return _index_source(ids, _SAME_VALUES) is not None
