"""Scoped substitution of Hugging Face expert loops that Dynamo can never trace.

transformers' "eager" experts (``for expert_idx in expert_hit:``, a loop over a data-dependent list)
graph-break inside a loop, so Dynamo skips the whole frame whatever its flags and the backend never
sees the experts. While a frame compiled with ``backend="moe"`` is traced or runs (the backend's
``capture_ctx``, Dynamo's ``backend_ctx_ctor``), ``substituted()`` makes those experts trace as a
grouped form the finders rewrite::

    @use_experts_implementation experts, experts_implementation="eager"
        -> the model's own declared grouped implementation, ExpertsInterface["grouped_mm"]
           (transformers' own classes, exactly, with all their code transformers': no class patch,
           no registered "eager", no user "grouped_mm" or patched helper of it; else traced as written)
    DbrxExperts (no declared implementation)         -> _dbrx_grouped:   sort + grouped GEMMs + unsort
    LongcatFlashExperts (identity experts among E+Z) -> _longcat_grouped: the same for ids < E, plus
                                                        x * (sum of the weights of slots with ids >= E)
    JetMoeTopKGating / JetMoeParallelExperts         -> counts stay a tensor (histc of the sorted ids)
        (``expert_size.tolist()`` + ``split``)          and each ParallelExperts is one grouped GEMM

Scope: nothing is installed outside the context; inside it, each substitute checks
``torch.compiler.is_compiling()`` and otherwise calls the original code, so eager calls (the
user's own, a frame Dynamo skipped, another thread's) run exactly what they ran before. Dynamo
guards the compiled code on the substitute being installed, and the context is entered around
every call of those frames. Equality with the eager loops (outputs and every gradient) is tested
per architecture in tests/test_forms_hf_eager.py.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import types

import torch

from moe_compile.kernels import gemm_ops as _gemm_ops  # noqa: F401  (registers moe_compile::grouped_mm)

log = logging.getLogger(__name__)

_lock = threading.Lock()
_depth = 0
_installed: list[tuple[object, str, object]] = []   # (owner, attribute, previous value or _MISSING)
_MISSING = object()
_cache: dict[tuple[type, object], object] = {}         # one substitute per (class, attribute or forward):
                                                       # a stable identity Dynamo guards on
_grouped: list = []      # transformers' grouped_mm_experts_forward, checked at the last install
_root: list = []         # transformers' package directory
_dispatch: list = []     # [transformers.integrations.moe, the code of its decorated forward, and __init__]
_modules: list = []      # [len(sys.modules), the decorated classes of the loaded transformers modeling modules]
_own_codes: dict = {}    # code object -> its file is in transformers' package
_same_file: dict = {}    # (code object, a module's file) -> the code is that file's
_methods_checked: dict = {}   # class -> (the values of its and its transformers bases' __dict__, their ids, verdict)
_calls_checked: dict = {}   # function -> (the (globals, name, value) it reached, _only_own_calls' verdict)


class substituted:
    """Context manager: the substitutes are installed while any thread is inside one (refcounted).
    ``inner``: another context manager entered inside it (the backend's Dynamo config patch)."""

    __slots__ = ("inner",)

    def __init__(self, inner=None):
        self.inner = inner

    def __enter__(self):
        _acquire()
        try:
            return self.inner.__enter__() if self.inner is not None else None
        except BaseException:
            _release()
            raise

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc) if self.inner is not None else False
        finally:
            _release()


def _acquire() -> None:
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1 and "transformers" in sys.modules:
            try:
                _install()
            except Exception as exc:   # never into the user's call: nothing substituted, the loops traced as written
                _restore()
                log.warning("moe_compile: substituting transformers' expert loops failed (%s: %s); they are "
                            "traced as written", type(exc).__name__, exc)


def _release() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0:
            _restore()


def _restore() -> None:
    for owner, attr, old in reversed(_installed):
        if old is _MISSING:
            owner.pop(attr, None) if isinstance(owner, dict) else delattr(owner, attr)
        elif isinstance(owner, dict):
            owner[attr] = old
        else:
            setattr(owner, attr, old)
    _installed.clear()


# ----------------------------------------------------------------------------- installation
def _install() -> None:
    moe = sys.modules.get("transformers.integrations.moe")
    grouped = _stock_grouped(moe) if moe is not None else None
    if grouped is not None:
        _grouped[:] = [grouped]
        for cls, dispatch in _declared_classes(moe):
            _put(cls, "forward", dispatch, (cls, dispatch), lambda: _declared_substitute(cls, dispatch))
    patched = {m for m, c, a, _ in _CLASS_SUBSTITUTES if _patched(m, c, a)}
    # read here, outside any trace (Dynamo does not see a function's __qualname__ as Python does)
    _stock_forward.clear()
    _stock_forward.update({(m, c): not _patched(m, c, "forward") for m, c in _CALLED_MODULES})
    for module, cls_name, attr, make in _CLASS_SUBSTITUTES:
        mod = sys.modules.get(module)
        cls = getattr(mod, cls_name, None) if mod is not None else None
        if cls is None or attr not in cls.__dict__:
            continue
        original = cls.__dict__[attr]
        if getattr(original, "_moe_compile_substitute", False):
            continue
        if module in patched:   # a user's patch or a kernel swapped in (JetMoE's gating and experts go as a
            continue            # pair: the gating's tensor counts need the experts' substitute): traced as written
        _put(cls, attr, original, (cls, attr), lambda: make(cls, original))


def _put(cls, attr: str, original, key, build) -> None:
    """Set ``cls.attr`` to the substitute cached under ``key`` (built once: a stable identity Dynamo
    guards on) and record ``original`` for ``_restore``."""
    if key not in _cache:
        _cache[key] = build()
        _cache[key]._moe_compile_substitute = True
    _installed.append((cls, attr, original))
    setattr(cls, attr, _cache[key])


def _transformers_root() -> str:
    if not _root:
        _root.append(os.path.join(os.path.dirname(os.path.abspath(sys.modules["transformers"].__file__)), ""))
    return _root[0]


def _own_code(fn) -> bool:
    """``fn`` is a Python function whose code is in transformers' package (a patch defined elsewhere,
    or a ``functools.wraps`` wrapper of one, has its own code object)."""
    if not isinstance(fn, types.FunctionType):
        return False
    code = fn.__code__
    own = _own_codes.get(code)
    if own is None:
        own = _own_codes[code] = os.path.abspath(code.co_filename).startswith(_transformers_root())
    return own


def _stock(fn, module: str, qualname: str) -> bool:
    """``fn`` is transformers' own function ``module.qualname`` (not a patch put on the class): read
    from its code object, which ``functools.wraps`` does not copy."""
    mod = sys.modules.get(module)
    code, path = getattr(fn, "__code__", None), getattr(mod, "__file__", None)
    if code is None or path is None or code.co_qualname != qualname:
        return False
    same = _same_file.get((code, path))
    if same is None:
        same = _same_file[(code, path)] = os.path.abspath(code.co_filename) == os.path.abspath(path)
    return same


def _patched(module: str, cls_name: str, attr: str) -> bool:
    """The class's ``attr`` is not transformers' own (and not our substitute)."""
    cls = getattr(sys.modules.get(module), cls_name, None)
    fn = cls.__dict__.get(attr) if cls is not None else None
    return fn is not None and not getattr(fn, "_moe_compile_substitute", False) \
        and not _stock(fn, module, f"{cls_name}.{attr}")


def _only_own_calls(fn) -> bool:
    """``fn`` and every Python function of its module it names (transitively) are transformers' own
    code: a patched helper of the grouped path (``_grouped_linear``, ``_grouped_mm``) is seen here.
    The verdict is kept with the globals it read, and read again only when one of them changed."""
    deps, ok = _calls_checked.get(fn, ((), None))
    if ok is not None and all(g.get(n) is v for g, n, v in deps):
        return ok
    deps, stack, seen, ok = {}, [fn], set(), True
    while stack and ok:
        f = stack.pop()
        if f in seen:
            continue
        seen.add(f)
        if not _own_code(f):
            ok = False
            break
        codes, g = [f.__code__], f.__globals__
        while codes:
            code = codes.pop()
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
            for n in code.co_names:   # globals and attribute names: the callables among them matter
                v = g.get(n)
                if v is None or isinstance(v, (types.ModuleType, type)) or not callable(v):
                    continue
                deps[(id(g), n)] = (g, n, v)
                wrapped = getattr(v, "__wrapped__", None) if type(v).__module__ == "functools" else None
                if isinstance(v, types.FunctionType) or isinstance(wrapped, types.FunctionType):
                    stack.append(v if isinstance(v, types.FunctionType) else wrapped)   # lru_cache: its function
                elif not _torch_callable(v):
                    ok = False   # a partial, a callable object, ...: a user's, put in transformers' place
    _calls_checked[fn] = (tuple(deps.values()), ok)
    return ok


def _torch_callable(v) -> bool:
    """A builtin or one of torch's own callables (ops, C functions)."""
    mod = getattr(v, "__module__", None) or type(v).__module__ or ""
    return isinstance(v, (types.BuiltinFunctionType, types.BuiltinMethodType)) or mod.split(".")[0] == "torch"


def _stock_grouped(moe):
    """transformers' ``ExpertsInterface["grouped_mm"]`` when every part of it and of the dispatch is
    transformers' own: no "eager" registered by a user (local or global: the decorated forward would
    call it), no user function as "grouped_mm", no patched helper of it. Else None (nothing installed)."""
    interface = getattr(moe, "ALL_EXPERTS_FUNCTIONS", None)
    if interface is None or "eager" in interface or "grouped_mm" not in interface:
        return None
    fn = interface["grouped_mm"]
    return fn if _only_own_calls(fn) else None


def _plain_call(m, cls) -> bool:
    """Calling ``m`` runs ``cls.forward`` and nothing else: the exact class (not a subclass), no forward
    of its own on the instance, no module or global forward hooks. The substitutes compute what the
    stock loop gets from such a call without making it."""
    from torch.nn.modules import module as nn_module

    return cls is not None and type(m) is cls and "forward" not in vars(m) \
        and not (m._forward_hooks or m._forward_pre_hooks) \
        and not (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def _stock_call(m, module: str, cls_name: str) -> bool:
    """``_plain_call`` of transformers' own, unpatched ``module.cls_name``."""
    return _plain_call(m, getattr(sys.modules.get(module), cls_name, None)) \
        and _stock_forward.get((module, cls_name), False)


def _autocast(module) -> bool:
    """torch.autocast is on for the device of ``module``'s weights. The eager experts' products then
    run in the autocast dtype, while the grouped substitutes' ``torch._grouped_mm`` (or transformers'
    fallback) runs in the weights' dtype: substituting would change the values, so the original code
    is traced (it graph-breaks, and the backend reports that MoE code with its fix)."""
    p = next(iter(module.parameters()), None)
    return p is not None and torch.is_autocast_enabled(p.device.type)


def _dispatch_code(moe):
    """The code object of the forward ``use_experts_implementation`` puts on a class (one per
    transformers module object: read off a decorated probe class)."""
    if _dispatch[:1] != [moe]:
        probe = moe.use_experts_implementation(type("_Probe", (torch.nn.Module,), {"forward": lambda self: None}))
        _dispatch[:] = [moe, probe.__dict__["forward"].__code__, probe.__dict__["__init__"].__code__]
    return _dispatch[1]


def _decorated(cls) -> bool:
    """``use_experts_implementation`` decorated ``cls`` (its forward or __init__ is the decorator's)."""
    return any(getattr(cls.__dict__.get(a), "__code__", None) is c for a, c in zip(("forward", "__init__"), _dispatch[1:]))


def _declared_classes(moe):
    """(class, its dispatching forward) for transformers' own ``@use_experts_implementation`` classes
    among the loaded modeling modules, dispatching over ``ALL_EXPERTS_FUNCTIONS`` to their own loop
    as "eager", whose every method (theirs and their bases', below nn.Module) is transformers' code:
    a class-level patch or a user's class is never substituted, a user's subclass is checked per call."""
    code, interface = _dispatch_code(moe), moe.ALL_EXPERTS_FUNCTIONS
    if _modules[:1] != [len(sys.modules)]:
        found = []
        for name, mod in list(sys.modules.items()):
            if name.startswith("transformers.models.") and ".modeling_" in name and mod is not None:
                found += [c for c in vars(mod).values() if isinstance(c, type) and c.__module__ == name
                          and issubclass(c, torch.nn.Module) and _decorated(c)]
        _modules[:] = [len(sys.modules), found]
    out = []
    for cls in _modules[1]:
        fwd = cls.__dict__.get("forward")
        if getattr(fwd, "__code__", None) is not code or not fwd.__closure__:
            continue
        cells = dict(zip(fwd.__code__.co_freevars, (c.cell_contents for c in fwd.__closure__)))
        if cells.get("experts_interface") is interface and _stock(
                cells.get("original_forward"), cls.__module__, f"{cls.__qualname__}.forward") and _methods_own(cls):
            out.append((cls, fwd))
    return out


def _methods_own(cls) -> bool:
    """Every function ``cls`` and its bases below nn.Module define (methods, static and class methods,
    properties) is transformers' code."""
    mine = [c for c in cls.__mro__ if c is not torch.nn.Module and c is not object
            and c.__module__.startswith("transformers.")]
    values = tuple(v for c in mine for v in vars(c).values())
    ids = tuple(map(id, values))   # the values stay referenced below: an equal id is the same object
    seen = _methods_checked.get(cls)
    if seen is not None and seen[1] == ids:
        return seen[2]
    _methods_checked[cls] = (values, ids, _methods_all_own(mine))
    return _methods_checked[cls][2]


def _methods_all_own(classes) -> bool:
    for c in classes:
        for v in vars(c).values():
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            fns = (v.fget, v.fset, v.fdel) if isinstance(v, property) else (v,)
            for f in fns:
                if f is not None and callable(f) and not isinstance(f, type) and not _own_code(f):
                    return False
    return True


def _declared_substitute(cls, dispatch):
    """The forward of ``cls`` inside the scope: its declared grouped implementation while Dynamo
    traces an instance of exactly ``cls`` whose config asks for "eager" (not under torch.autocast:
    ``_autocast``) and that has no ``_apply_gate`` of its own (the grouped path calls
    ``self._apply_gate``, the stock loops compute the gate inline); the class's own dispatching
    forward otherwise (eagerly, for a subclass, for another implementation)."""
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling() and type(self) is cls and not _autocast(self) \
                and "_apply_gate" not in vars(self) \
                and getattr(self.config, "_experts_implementation", None) in ("eager", None):
            return _grouped[0](self, *args, **kwargs)
        return dispatch(self, *args, **kwargs)
    return forward


# ----------------------------------------------------------------------------- grouped forms
def _gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [S, K] @ w[e] [K, N] per group of rows (offs: int32 cumulative ends): F.grouped_mm in bf16
    (torch.compile lowers torch's grouped_mm in bf16 only), else transformers' fallback op where its
    backward traces, else moe_compile's grouped_mm (the matchers read all three as a grouped GEMM)."""
    x = x.to(w.dtype)
    if w.dtype == torch.bfloat16 and hasattr(torch.nn.functional, "grouped_mm"):
        return torch.nn.functional.grouped_mm(x, w, offs=offs)
    if _traceable_fallback():
        return torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs)
    return torch.ops.moe_compile.grouped_mm(x, w, offs)


def _traceable_fallback() -> bool:
    """transformers::grouped_mm_fallback exists and its backward is an op of its own. Before that
    (transformers 5.17) the backward ran ``offs.tolist()`` in Python, which AOTAutograd cannot trace:
    a graph left holding the op (a refused region, e.g. JetMoE's attention experts) failed to compile
    in training."""
    ops = torch.ops.transformers
    return hasattr(ops, "grouped_mm_fallback") and hasattr(ops, "grouped_mm_fallback_backward")


def _route(ids: torch.Tensor, num_experts: int):
    """(sorted ids, perm, rows per expert) of the flat ids; ids >= num_experts sort last, in no group
    (histc, not bincount: a fixed-length result, no host sync)."""
    sorted_ids, perm = torch.sort(ids.reshape(-1))
    counts_in = sorted_ids.float() if sorted_ids.device.type in ("cpu", "mps") else sorted_ids.int()
    return sorted_ids, perm, torch.histc(counts_in, bins=num_experts, min=0, max=num_experts - 1)


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def _unsort_sum(rows: torch.Tensor, perm: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0), device=perm.device)
    return rows[inv].view(tokens, k, rows.shape[-1]).sum(dim=1)


def _when_compiling(grouped, always: bool = False):
    """A factory of substitutes: ``grouped`` while Dynamo traces (or ``always``) an instance of exactly
    the class (a user's subclass may override what the loop calls), the original forward where
    ``grouped`` returns NotImplemented, for a subclass or outside a trace."""
    def make(cls, original):
        def forward(self, *args, **kwargs):
            if (always or torch.compiler.is_compiling()) and type(self) is cls and not _autocast(self):
                out = grouped(self, *args, **kwargs)
                if out is not NotImplemented:
                    return out
            return original(self, *args, **kwargs)
        return forward
    return make


def dbrx_grouped(self, hidden_states, top_k_index, top_k_weights):
    """DbrxExperts.forward as sort + three grouped GEMMs over the [E * F, H] weights viewed [E, F, H]."""
    batch = hidden_states.shape[0]
    x = hidden_states.reshape(-1, self.hidden_size)
    e, k = self.num_experts, top_k_index.shape[-1]
    _, perm, counts = _route(top_k_index, e)
    offs = _offsets(counts)
    rows = x[perm // k]
    shape = (e, self.ffn_hidden_size, self.hidden_size)
    mlp = self.mlp
    if not _stock_call(mlp, "transformers.models.dbrx.modeling_dbrx", "DbrxExpertGLU"):
        return NotImplemented   # the loop calls self.mlp: a hook, subclass or patch there would be skipped
    gate = _gmm(rows, mlp.w1.view(shape).transpose(1, 2), offs)
    up = _gmm(rows, mlp.v1.view(shape).transpose(1, 2), offs)
    out = _gmm(mlp.activation_fn(gate) * up, mlp.w2.view(shape), offs)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    out = _unsort_sum(out, perm, x.shape[0], k).to(hidden_states.dtype)
    return out.view(batch, -1, self.hidden_size)


def longcat_grouped(self, hidden_states, top_k_index, top_k_weights):
    """LongcatFlashExperts.forward: the E routed experts grouped, the identity experts (ids >= E) as
    x times the sum of their routing weights."""
    if self.gate_up_proj is None:
        return NotImplemented
    identity = getattr(self, "identity_expert", None)
    if identity is not None and not _plain_call(identity, torch.nn.Identity):
        return NotImplemented   # computed as x * weights here, never called: a hook or module there would be skipped
    e, k = self.num_routed_experts, top_k_index.shape[-1]
    sorted_ids, perm, counts = _route(top_k_index, e)
    offs = _offsets(counts)
    rows = hidden_states[perm // k]
    # ids >= e (identity experts) sort last and fall in no group: their rows are zeroed (what
    # transformers' own grouped_mm does for expert-parallel sentinels)
    dropped = (sorted_ids >= e).unsqueeze(-1)
    rows = rows.masked_fill(dropped, 0.0)
    h = _gmm(rows, self.gate_up_proj[:e].transpose(1, 2), offs).masked_fill(dropped, 0.0)
    gate, up = h.chunk(2, dim=-1)
    out = _gmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), offs).masked_fill(dropped, 0.0)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    routed = _unsort_sum(out, perm, hidden_states.shape[0], k)
    identity_w = torch.where(top_k_index >= e, top_k_weights, torch.zeros_like(top_k_weights))
    identity = hidden_states * identity_w.sum(dim=-1, keepdim=True)
    return (routed + identity).to(hidden_states.dtype)


def jetmoe_gating_grouped(self, hidden_states):
    """JetMoeTopKGating.forward with the rows per expert left a tensor (no ``.tolist()``)."""
    logits = self.layer(hidden_states).float()
    top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
    top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
    _, index_sorted_experts, expert_size = _route(top_k_indices, self.num_experts)   # a tensor, not a list
    batch_index = index_sorted_experts.div(self.top_k, rounding_mode="floor")
    batch_gates = top_k_gates.flatten()[index_sorted_experts]
    return index_sorted_experts, batch_index, batch_gates, expert_size, logits


def jetmoe_experts_grouped(self, inputs, expert_size):
    """JetMoeParallelExperts.forward as one grouped GEMM when the rows per expert are a tensor (from
    the substituted gating: also when a graph break left this call to run eagerly)."""
    if not isinstance(expert_size, torch.Tensor):
        return NotImplemented
    return _gmm(inputs, self.weight.transpose(1, 2), _offsets(expert_size))


# modules the stock loops call and the substitutes do not (their math is inlined): substituted only
# while such a call would run transformers' own forward (``_stock_call``)
_CALLED_MODULES = (("transformers.models.dbrx.modeling_dbrx", "DbrxExpertGLU"),)
_stock_forward: dict[tuple[str, str], bool] = {}

# (module, class, attribute, factory(class, original) -> substitute): classes with no declared grouped
# implementation whose forward Dynamo cannot trace
_CLASS_SUBSTITUTES = (
    ("transformers.models.dbrx.modeling_dbrx", "DbrxExperts", "forward", _when_compiling(dbrx_grouped)),
    ("transformers.models.longcat_flash.modeling_longcat_flash", "LongcatFlashExperts", "forward",
     _when_compiling(longcat_grouped)),
    ("transformers.models.jetmoe.modeling_jetmoe", "JetMoeTopKGating", "forward",
     _when_compiling(jetmoe_gating_grouped)),
    ("transformers.models.jetmoe.modeling_jetmoe", "JetMoeParallelExperts", "forward",
     _when_compiling(jetmoe_experts_grouped, always=True)),
)
