"""moe_source: whether a user stack is MoE code, read from its source (finds only; no graph).

Used for graph breaks and frames Dynamo gave up on (``passes/unclaimed.py``, the backend's capture
scope), where only file names, line numbers and function names are known:

``in_moe_code(frames)``
    class or function names such as ``*Experts``, ``*SparseMoeBlock``, ``*Router``, ``*MoE``,
    ``TopKGate``; a source line naming experts or routers (not a bare ``topk``); or, whatever the names, a function that calls ``topk(`` and
    then groups tokens by expert before the failing line. At a function's first line (a frame given
    up as a whole: nothing says which line failed) its whole body counts: a per-expert loop (a ``for``
    variable that both selects tokens and picks an expert), after the router if the body has one.
``routes_per_expert(cls)`` / ``routes(cls)``
    a class whose source routes and loops over experts (explain's eager probe: ModuleList experts
    whatever their attribute is called) / calls a router op (3-D expert containers next to a router).
``enclosing_class`` / ``declares_experts_implementation``
    the top-level class around a line, and whether transformers' ``@use_experts_implementation``
    decorates it.
``in_compile_region`` / ``compile_region_frame``
    whether ``torch.compiler.nested_compile_region`` decorates the function around a line / around a
    frame of some nodes' user stacks.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import linecache
import os
import re


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame of a user stack: file, line number, function name, source line."""
    filename: str
    lineno: int
    name: str
    line: str = ""

    @property
    def at(self) -> str:
        return f"{self.filename.rsplit('/', 1)[-1]}:{self.lineno}"

    @property
    def source(self) -> str:
        return (self.line or linecache.getline(self.filename, self.lineno) or "").strip()


def node_frames(node) -> list[Frame]:
    """The user stack recorded on an fx node (``meta["stack_trace"]``), outermost first."""
    from .normalize import stack_frames

    return [Frame(*f) for f in stack_frames(node)]


# not a bare "topk": metrics, samplers, beam search and top-k pooling call it too (a router they
# hold is found from the graph: its ids leave it, or the function routes and then groups tokens)
# (not "routing" / "gating" alone: capsule routing, context gating and gMLP's spatial gating unit are no MoE)
_MOE_NAME = re.compile(r"expert|router|(top_?k|noisy|sparse|switch|moe)_?(gate|gating|routing)|sparse_?moe|"
                       r"moe_?(block|layer|mlp)|moe$|^moe", re.I)
_MOE_LINE = re.compile(r"expert|router|routing", re.I)
_CLASS = re.compile(r"^class\s+(\w+)")


def enclosing_class(filename: str, lineno: int) -> tuple[str, int]:
    """(name, line) of the top-level class whose body holds ``filename:lineno`` ('' if none)."""
    for i in range(lineno, 0, -1):
        line = linecache.getline(filename, i)
        if line and not line[0].isspace() and line.strip() and not line.startswith(("#", "@", ")")):
            m = _CLASS.match(line)
            return (m.group(1), i) if m else ("", 0)
    return "", 0


def declares_experts_implementation(filename: str, lineno: int) -> bool:
    """The class holding ``filename:lineno`` is decorated with transformers' @use_experts_implementation
    (so ``experts_implementation="grouped_mm"`` applies to it), and transformers has that implementation."""
    cls, at = enclosing_class(filename, lineno)
    if not cls:
        return False
    i = at - 1
    while i > 0 and linecache.getline(filename, i).startswith("@"):
        if "use_experts_implementation" in linecache.getline(filename, i):
            try:
                from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
            except ImportError:
                return False
            return "grouped_mm" in ALL_EXPERTS_FUNCTIONS
        i -= 1
    return False


# a function that picks experts with a top-k (or calls its router module: ``w, ids = self.router(x)``) and then
# groups tokens by expert, whatever its names say (narrow on purpose: an argmax + ``== labels`` accuracy, or a
# top-k / top-p sampler, is not MoE code)
_ROUTES = re.compile(r"\btopk\(|\.router\(")
_SELECTS = re.compile(r"\bwhere\(\s*[\w.]+\s*==|\b(one_hot|nonzero|argsort|sort|bincount|histc)\(")


def _routes_then_selects(filename: str, lineno: int, limit: int = 120) -> bool:
    """The function holding ``filename:lineno`` calls a router op (top-k, argmax, sampling) and then
    groups by expert (``ids == e``, ``where``, ``one_hot``, ``nonzero``, a sort, counts) before that line.
    At the first line of a function (its ``def`` or decorator: a frame Dynamo gave up on as a whole,
    where nothing says which line failed), the whole body counts: a ``_per_expert_loop`` in it (after the
    router when the body has one; routing in a helper or a gate module leaves only the loop)."""
    body = _function_body(filename, lineno)
    if body is not None:   # the router may be a helper or a gate module (``w, ids = self.gate(x)``): the loop says it
        routed = _ROUTES_WHOLE.search(body)
        return _per_expert_loop(body[routed.end():]) if routed else _per_expert_loop(body, calls=True)
    lines = []
    for i in range(lineno, max(lineno - limit, 0), -1):
        line = linecache.getline(filename, i)
        lines.append(line)
        if line.lstrip().startswith("def "):
            break
    text = "".join(reversed(lines))
    routed = _ROUTES.search(text)
    if not routed:   # the router may be a gate module or a helper: a per-expert loop around the line says it
        return _in_per_expert_loop(filename, lineno)
    if not _SELECTS.search(text, routed.end()):
        return False
    # and computes with experts somewhere in the function (a top-k, nonzero and .item() of a beam search,
    # a kNN monitor or a top-5 accuracy computes with none)
    whole = _enclosing_function(filename, lineno)
    return whole is None or bool(_EXPERT_COMPUTE.search(whole))


# expert compute in a function's text: an indexed module called (experts[e](..)), a grouped GEMM (F.grouped_mm
# or torch._grouped_mm: no word boundary before "grouped" there; transformers' grouped_mm_fallback; a helper
# named gmm / grouped_gemm), a batched one
_EXPERT_COMPUTE = re.compile(r"\w\[[^\]\n]+\]\s*\(|\b_?grouped_(mm|gemm)\w*\(|\b_?gmm\(|\bbmm\(|\beinsum\(|\bexpert",
                             re.I)


def _parsed(filename: str) -> tuple[list[str], ast.AST | None]:
    """``filename``'s lines (linecache's) and their syntax tree, None where they do not parse."""
    lines = linecache.getlines(filename)
    return lines, _parse("".join(lines))


@functools.lru_cache(maxsize=16)
def _parse(text: str) -> ast.AST | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def _enclosing_function(filename: str, lineno: int) -> str | None:
    """The text of the innermost function holding ``filename:lineno``, else None."""
    lines, tree = _parsed(filename)
    best = _innermost_function(tree, lineno)
    return "".join(lines[best.lineno - 1:best.end_lineno]) if best is not None else None


def _innermost_function(tree: ast.AST | None, lineno: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    best = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= lineno <= (node.end_lineno or 0):
            if best is None or node.lineno >= best.lineno:
                best = node
    return best


# calls that break Dynamo's graph wherever they are: inside a loop's body Dynamo gives up on the loop and
# reports only its `for` line (reason "step_unsupported")
_REGION_DECORATORS = {"nested_compile_region", "mark_compile_region"}


def in_compile_region(filename: str, lineno: int) -> bool:
    """The innermost function holding ``filename:lineno`` is decorated with
    ``torch.compiler.nested_compile_region`` (as ``@nested_compile_region``, ``@torch.compiler.nested_compile_region``
    or called: ``@nested_compile_region(...)``)."""
    best = _innermost_function(_parsed(filename)[1], lineno)
    for d in best.decorator_list if best is not None else ():
        d = d.func if isinstance(d, ast.Call) else d
        if (d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", None)) in _REGION_DECORATORS:
            return True
    return False


def compile_region_frame(nodes) -> Frame | None:
    """The first frame of the nodes' user stacks that runs in a ``nested_compile_region`` function (one Dynamo
    inlined into the graph instead of keeping it as an ``invoke_subgraph``), else None."""
    seen = set()
    for n in nodes:
        classes = {c for _, c in (n.meta.get("nn_module_stack") or {}).values() if isinstance(c, type)}
        for f in node_frames(n):
            if (f.filename, f.lineno) not in seen:
                seen.add((f.filename, f.lineno))
                # decorated in the source, or wrapped later (``cls.forward = nested_compile_region(cls.forward)``)
                if in_compile_region(f.filename, f.lineno) or any(_marked_method(c, f) for c in classes) \
                        or _marked_in_module(f):
                    return f
    return None


def _marked_in_module(f: Frame) -> bool:
    """A nested_compile_region wrapper whose code holds the frame's line among the globals of the module loaded
    from the frame's file, or the attributes of its classes: a function or method wrapped under any name
    (``@ncr``, ``Model.block = nested_compile_region(Model.block)``, ``region = nested_compile_region(fn)``)."""
    import sys

    for module in [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == f.filename]:
        for value in list(vars(module).values()):
            members = list(vars(value).values()) if isinstance(value, type) else [value]
            if any(_marked_code_holds(getattr(v, "__marked_compile_region_fn__", None), f) for v in members):
                return True
    return False


def _marked_code_holds(fn, f: Frame) -> bool:
    code = getattr(fn, "__code__", None)
    if code is None or code.co_filename != f.filename:
        return False
    lines = [line for _, _, line in code.co_lines() if line is not None]
    return bool(lines) and code.co_firstlineno <= f.lineno <= max(lines)


def _marked_method(cls: type, f: Frame) -> bool:
    """``cls.<f.name>`` is a function wrapped by nested_compile_region whose code holds the frame's line."""
    return _marked_code_holds(getattr(getattr(cls, f.name, None), "__marked_compile_region_fn__", None), f)


_UNTRACEABLE_METHODS = {"retain_grad", "tolist", "register_full_backward_hook"}   # not .cpu(): traced
_UNTRACEABLE_FUNCTIONS = {"print", "breakpoint"}


def untraceable_in_loop(filename: str, lineno: int) -> str | None:
    """In the body of the ``for`` loop at ``filename:lineno``: the first call Dynamo cannot trace
    (``y.retain_grad()``, ``print(...)``, ``.tolist()``), as "`source` at file:line", else None."""
    lines, tree = _parsed(filename)
    if tree is None:
        return None
    loop = next((n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While)) and n.lineno == lineno), None)
    if loop is None:
        return None
    calls = sorted((n for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, ast.Call)),
                   key=lambda n: (n.lineno, n.col_offset))
    for call in calls:
        f = call.func
        if isinstance(f, ast.Attribute) and f.attr in _UNTRACEABLE_METHODS or \
                isinstance(f, ast.Name) and f.id in _UNTRACEABLE_FUNCTIONS:
            return f"`{lines[call.lineno - 1].strip()}` at {os.path.basename(filename)}:{call.lineno}"
    return None


_ROUTES_WHOLE = re.compile(r"\btopk\(|\bargmax\(|\.max\(\s*(dim\s*=\s*)?-?\d")
_LOOP = re.compile(r"\bfor\s+\(?\s*(\w+)(?:\s*,\s*(\w+))?\s*\)?\s+in\b")


def _per_expert_loop(text: str, calls: bool = False) -> bool:
    """A ``for`` loop in ``text`` whose variable both selects tokens (``ids == e``, ``ids.eq(e)``,
    ``where(mask[e])``; not a Python branch ``if i == ...``) and picks an expert (``_picks``). A per-class
    metric (``labels == c``) selects but picks nothing; a class-weighted loss (``self.cw[c] * ...``) picks no call."""
    for m in _LOOP.finditer(text):
        rest = text[m.end():]
        index, element = m.groups()
        names = [v for v in (index, element) if v]
        kept = "\n".join(line for line in rest.splitlines() if not line.lstrip().startswith(("if ", "elif ", "while ")))
        selects = any(re.search(rf"==\s*{v}\b|\b{v}\s*==|\.eq\(\s*{v}\s*\)|\bwhere\(\s*[\w.]+\[\s*{v}\s*\]", kept)
                      for v in names)
        if selects and _picks(rest, index, element, calls):
            return True
    return False


def _picks(rest: str, index: str, element: str | None, calls: bool) -> bool:
    """The loop body ``rest`` picks an expert with its variable: a weight indexed (``self.w1[e]``; not
    with ``calls``: only a module called counts), an indexed module called (``experts[e](...)``), or bound
    first and then called (``expert = self.experts[e]`` ... ``expert(x[tok])``, Mixtral's loop), the loop's
    element called (``for e, expert in enumerate(self.experts): ... expert(x[tok])``), or an expert
    container given the variable (``self.experts.fwd(e, x[tok])``)."""
    names = [v for v in (index, element) if v]
    weight = "" if calls else rf"\bself\.[\w.]+\[\s*{{v}}\s*\]|"
    if any(re.search(weight.format(v=v) + rf"\w\[\s*{v}\s*\]\s*\(|\b[\w.]*[eE]xpert\w*(\.\w+)*\(\s*{v}\s*[,)]", rest)
           for v in names):
        return True
    bound = [a for v in names for a in re.findall(rf"^\s*(\w+)\s*=\s*[\w.]+\[\s*{v}\s*\]\s*$", rest, re.M)]
    return any(re.search(rf"\b{a}\s*\(", rest) for a in [*bound, *([element] if element else [])])


def _in_per_expert_loop(filename: str, lineno: int) -> bool:
    """``filename:lineno`` lies in a ``for`` loop that is a ``_per_expert_loop`` (a module called: the
    loop alone must say it, with no router in sight): a break inside Mixtral's loop whose router is a gate
    module (``w, ids = self.gate(x)``), as a ``fullgraph=True`` error names it (its line, not the def)."""
    lines = linecache.getlines(filename)
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(node, (ast.For, ast.AsyncFor)) and node.lineno <= lineno <= (node.end_lineno or 0)
               and _per_expert_loop("".join(lines[node.lineno - 1:node.end_lineno]), calls=True)
               for node in ast.walk(tree))


def _function_body(filename: str, lineno: int) -> str | None:
    """The body of the function whose ``def`` (or first decorator) is at ``lineno``, else None."""
    first = linecache.getline(filename, lineno).lstrip()
    if not first.startswith(("def ", "async def ", "@")):
        return None
    lines = linecache.getlines(filename)
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lineno in (
                node.lineno, *(d.lineno for d in node.decorator_list)):
            return "".join(lines[node.body[0].lineno - 1:node.end_lineno])
    return None


def _mro_sources(cls: type):
    """(class, its source) for each class of ``cls``'s MRO below torch's own (those that have one)."""
    import inspect

    for c in cls.__mro__:
        if c.__module__.startswith(("torch.", "builtins")):
            continue
        try:
            yield c, inspect.getsource(c)
        except (OSError, TypeError):
            continue


def _class_sources(cls: type):
    """The source of each class of ``cls``'s MRO below torch's own (those that have one)."""
    return (src for _, src in _mro_sources(cls))


@functools.lru_cache(maxsize=512)
def routes_per_expert(cls: type) -> bool:
    """Some class of ``cls``'s MRO (below torch's own) has source that routes (top-k, argmax) and loops
    over experts calling them (``_per_expert_loop``): its nn.ModuleLists may be experts whatever their names."""
    for src in _class_sources(cls):
        routed = _ROUTES_WHOLE.search(src)
        if routed and _per_expert_loop(src[routed.end():], calls=True):
            return True
    return False


@functools.lru_cache(maxsize=512)
def routes(cls: type) -> bool:
    """Some class of ``cls``'s MRO (below torch's own), or a function of that class's module it calls, has
    source that calls a router op (top-k, argmax): PhiMoE's router calls its module's ``sparsemixer``."""
    sources = list(_mro_sources(cls))
    return any(_ROUTES_WHOLE.search(src) for _, src in sources) \
        or any(_ROUTES_WHOLE.search(f) for c, src in sources for f in _called_function_sources(c, src))


_CALLED = re.compile(r"(?<![\w.])(\w+)\(")


def _called_function_sources(c: type, src: str):
    """The source of each function defined in class ``c``'s module that ``src`` (its source) calls by its bare
    name (``sparsemixer(scores, ...)``)."""
    import inspect
    import sys

    module = sys.modules.get(c.__module__)
    for name in dict.fromkeys(_CALLED.findall(src)) if module is not None else ():
        f = getattr(module, name, None)
        if inspect.isfunction(f) and f.__module__ == c.__module__:
            try:
                yield inspect.getsource(f)
            except (OSError, TypeError):
                continue


def in_moe_code(frames) -> bool:
    """Whether a user stack is inside MoE code: names of its classes and functions, its source line, or
    a function of it that routes and then groups tokens by expert (whatever the names)."""
    frames = list(frames)
    for f in frames:
        cls, _ = enclosing_class(f.filename, f.lineno)
        if _MOE_NAME.search(cls) or _MOE_NAME.search(f.name or ""):
            return True
    if frames and _MOE_LINE.search(frames[-1].source):
        return True
    return any(_routes_then_selects(f.filename, f.lineno) for f in frames if f.filename and f.lineno)
