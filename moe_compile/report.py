"""explain(): what the moe backend matched, rewrote and refused, and graph breaks in MoE code.

    report = moe_compile.explain(model, input_ids)
    print(report)                      # a table, the reasons and fixes in full, notes once each
    report.regions[0].status           # "rewritten" | "refused"
    report.graph_breaks[0].fix         # a concrete change to the user's code

explain() traces the model once with the moe backend (AOTAutograd only: quick) and reports the same
records a compile logs: regions rewritten or refused, MoE-like code no region covers
(``moe_unmatched``), graph breaks and frames Dynamo gave up on in MoE code (``break_*``), and experts
that ran eagerly with no such break to explain it (``ran_eagerly``: e.g. a graph break elsewhere inside
activation checkpointing; eager_probe.py). It has no
side effects on the user's model or compiled model: no Dynamo cache is reset (a model compiled
before runs on without recompiling), its own cache entries are dropped afterwards, expert weights
are not re-homed (the compile does that), and RNG state and buffers are restored.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import random
import sys
from collections import Counter

import torch

from . import eager_probe
from .config import MoEConfig
from .debug import format_records
from .records import REFUSED, REWRITTEN, RegionRecord, Session, placer, recording

# explain's backend: AOTAutograd with eager kernels (quick), and nothing that touches the user's
# tensors (re-homing ModuleList weights moves them into a new buffer: the compile does that)
_EXPLAIN_OPTIONS = {"moe.inductor": False, "moe.disable": ("rehome_weights",)}


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """A graph break, or a frame Dynamo gave up on, in MoE code."""
    where: str          # file:line in the user's code
    reason: str         # in full
    fix: str
    code: str = ""      # the user's source line
    reason_code: str = ""   # the stable code (passes/reasons.py: break_*)


@dataclasses.dataclass(frozen=True)
class Report:
    regions: tuple[RegionRecord, ...]
    graph_breaks: tuple[GraphBreak, ...]
    graphs: int = 0
    # what torch.compile(backend="moe") raises on this model (a setup it cannot run, e.g. an
    # expert-parallel layer that cannot be rewritten, or sharded experts Dynamo ran eagerly): explain
    # stops there and reports it
    errors: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()   # about the whole model (blocks.explain_notes: compile_blocks)

    @property
    def rewritten(self) -> list[RegionRecord]:
        return [r for r in self.regions if r.status == REWRITTEN]

    @property
    def refused(self) -> list[RegionRecord]:
        return [r for r in self.regions if r.status == REFUSED]

    def __str__(self) -> str:
        out = [f"moe_compile report: {len(self.rewritten)} MoE region(s) rewritten, {len(self.refused)} refused, "
               f"{self.graphs} graph(s), {len(self.graph_breaks)} graph break(s) in MoE code"]
        out.extend(f"compile error: torch.compile(backend=\"moe\") raises this on the model (explain stopped "
                   f"there; code after it was not traced):\n    {e}" for e in self.errors)
        out.extend(f"  note: {n}" for n in self.notes)
        if self.regions:
            out.append(format_records(self.regions))
        notes: dict[str, list[str]] = {}   # each note once, with the regions it is about
        for r in self.regions:
            for n in r.notes:
                names = notes.setdefault(n, [])
                if (r.module or "<top>") not in names:
                    names.append(r.module or "<top>")
        out.extend(f"  note [{', '.join(names)}]: {n}" for n, names in notes.items())
        for b in self.graph_breaks:
            out.append(f"graph break at {b.where} [{b.reason_code}]: {b.reason}\n    code: {b.code}\n    fix:  {b.fix}")
        return "\n".join(out)


def explain(model_or_fn, *args, **kwargs) -> Report:
    """Trace ``model_or_fn(*args, **kwargs)`` once with the moe backend and report every MoE region,
    every MoE-like piece of code no region covers, and every graph break in MoE code. It runs the model
    once: with experts sharded by ``parallelize_experts``, call it on every rank of the mesh (its
    collectives wait for the others), and print on one.

    Without side effects: the user's compiled model keeps its compiled code (no Dynamo reset, so no
    recompile after explain), its parameters keep their storage, buffers and RNG state are restored,
    and explain's own Dynamo cache entries are dropped when it returns (on a code object the user's
    compile also holds entries for: invalidated, never matched again, but their memory, the trace's graph
    and shape environment, stays until ``torch._dynamo.reset()``; review helper-115: ~19 MB per call for
    a 128-expert layer, so call it once, not per step)."""
    from .backend import capture_ctx, moe_backend

    if isinstance(model_or_fn, type) or not callable(model_or_fn):
        what = f"the class {model_or_fn.__name__}" if isinstance(model_or_fn, type) else type(model_or_fn).__name__
        raise TypeError(f"moe_compile.explain: expected a model (an nn.Module instance) or a function, got {what}; "
                        "call moe_compile.explain(model, *inputs) with the inputs of one forward call")
    fn = _unwrap(model_or_fn)
    in_place = getattr(fn, "_compiled_call_impl", None) if isinstance(fn, torch.nn.Module) else None
    # ``model.forward = torch.compile(model.forward)`` (transformers' docs): the instance's compiled forward
    # ran the user's compile (its backend, its recompile budget) inside explain's trace (review helper-116)
    own_forward = _compiled_forward(fn)
    compiled = own_forward or in_place or model_or_fn   # Dynamo runs the inner compile: the instance's forward
    compiled_with, user_options, dynamic, by_blocks = _compiled_with(compiled, fn, moe_backend)
    options, config = _explain_options(user_options)
    session = Session(quiet=True)
    session.explaining = True
    session.explain_inductor = config.inductor
    if isinstance(fn, torch.nn.Module):
        session.place = placer(fn)
    graphs = [0]

    def backend(gm, example_inputs):  # a fresh callable per call: a fresh trace, not a cache hit
        graphs[0] += 1
        return moe_backend(gm, example_inputs, options=dict(options))

    backend.moe_capture_ctx = lambda _options=None, mode=None: capture_ctx(options, mode, session=session)
    failure = None
    with _no_side_effects(fn, args, kwargs) as tried, recording() as published, eager_probe.probes(fn) as eager:
        try:
            if in_place is not None:   # model.compile(...): trace the module, not the user's compiled call
                fn._compiled_call_impl = None
            if own_forward is not None:   # what the user's compiled forward wraps, uncompiled
                fn.__dict__["forward"] = own_forward._torchdynamo_orig_callable
            torch.compile(fn, backend=backend, dynamic=dynamic, **_isolated())(*args, **kwargs)
        except Exception as exc:
            failure = _setup_error(exc) or (_eager_ep_error(exc) if eager else None)
            if failure is None:
                if len(args) == 1 and not kwargs and isinstance(args[0], (tuple, list)):   # review helper-114
                    exc.add_note(f"moe_compile.explain: the model got one {type(args[0]).__name__} argument; explain "
                                 "takes the inputs of one forward call as separate arguments: "
                                 "moe_compile.explain(model, *inputs)")
                raise
        finally:
            if in_place is not None:
                fn._compiled_call_impl = in_place
            if own_forward is not None:
                fn.__dict__["forward"] = own_forward
    found = [r for g in published for r in g]
    times = Counter(found)   # one module called twice (``a(a(x))``): two equal records, one row
    records = list(dict.fromkeys(found + list(getattr(failure, "records", ()))))
    seen = {r.where for r in records if r.is_break}
    records += [r for r in _earlier_skips(fn, tried) if r.where not in seen]
    records += eager_probe.records(fn, eager, [r for r in records if r.is_break])
    regions = tuple(r for r in records if not r.is_break)
    regions = tuple(_explain_notes(_times_note(r, times[r]), config.disable) for r in regions)
    from .blocks import compiled_blocks

    session = _compile_session(compiled) or (getattr(compiled_blocks(fn), "session", None) if by_blocks
                                                            else None)
    failed = getattr(session, "compile_errors", {})
    regions = tuple(_compile_error_of(r, failed) if r.status == REWRITTEN and failed else r for r in regions)
    breaks = tuple(dict.fromkeys(GraphBreak(r.where, r.reason, r.fix, r.source, r.code)
                                 for r in records if r.is_break))
    from .blocks import explain_notes, explain_regions

    regions = explain_regions(fn, regions) if by_blocks else regions
    return Report(regions, breaks, graphs[0], errors=(str(failure),) if failure is not None else (),
                  notes=explain_notes(fn, regions) if by_blocks else
                  _backend_note(compiled_with) + _submodules_note(fn, compiled_with, regions))


def _setup_error(exc: BaseException):
    """The backend's InvalidSetup behind an error out of torch.compile (Dynamo wraps backend errors:
    ``inner_exception``, ``raise ... from``), or None: any other error is explain's to raise."""
    from .lowering.graph_edit import InvalidSetup

    return next((e for e in _causes(exc) if isinstance(e, InvalidSetup)), None)


def _eager_ep_error(exc: BaseException):
    """The sharded experts' error (kernels/ep.py, EP_EXPERTS_ERROR) behind ``exc``, or None: raised when
    expert-parallel experts ran eagerly, which the probes then report as ``ran_eagerly`` beside it."""
    from .kernels.ep import EP_EXPERTS_ERROR

    return next((e for e in _causes(exc) if EP_EXPERTS_ERROR in str(e)), None)


def _causes(exc: BaseException):
    """``exc`` and the errors it wraps (Dynamo's ``inner_exception``, ``raise ... from``); not
    ``__context__``: an error raised while another was handled is another error."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        yield exc
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__


def _compiled_with(obj, user_obj, moe_backend) -> tuple[str | None, dict, bool | None, bool]:
    """(the backend ``obj`` was compiled with: "moe", another backend's name, None if it is not compiled;
    the options of that compile when it is backend="moe", else {}; its ``dynamic``; whether that is a
    ``compile_blocks`` call on the model, which is not compiled itself): explain() then reports what that
    compile does, not the default one."""
    from .blocks import _BlocksBackend, compiled_blocks

    ctx = _dynamo_ctx(obj)
    backend, name, dynamic = getattr(ctx, "callback", None), None, getattr(ctx, "_dynamic", None)
    for _ in range(8):   # Dynamo's wrappers of the backend, down to torch.compile's
        fn = getattr(backend, "compiler_fn", None)
        if fn is moe_backend or isinstance(fn, _BlocksBackend):
            options = dict((getattr(backend, "kwargs", None) or {}).get("options") or {})
            drawn = getattr(getattr(getattr(ctx, "_backend_ctx_ctor", None), "session", None), "fallback_random", None)
            if drawn is not None:   # the global fallback_random its compile ran with (options name it otherwise)
                options.setdefault("fallback_random", drawn)
            return "moe", options, dynamic, False
        name = name or getattr(backend, "compiler_name", None)
        backend = getattr(backend, "_torchdynamo_orig_backend", None) or fn
        if backend is None:
            break
    if ctx is not None and getattr(ctx, "callback", None) is not None:
        return str(name or getattr(backend, "__name__", "another backend")), {}, dynamic, False
    call = compiled_blocks(user_obj)
    if call is not None:
        return call.backend, dict(call.options) if call.backend == "moe" else {}, call.dynamic, True
    return None, {}, None, False


def _compile_error_of(r: RegionRecord, failed: dict) -> RegionRecord:
    """The compile's compile_error record of the region explain found as ``r`` (same line; the same module, or one
    inside the other: a block's graph names its layer ``layers.0.experts.experts``, explain's trace ``layers.0``),
    at explain's module path; else ``r``."""
    for (module, where), e in failed.items():
        if where == r.where and (module == r.module or module.startswith(f"{r.module}.") or r.module.startswith(
                f"{module}.") or not r.module):
            return dataclasses.replace(e, module=r.module, num_experts=r.num_experts, top_k=r.top_k)
    return r


def _dynamo_ctx(obj):
    """Dynamo's context of a compiled module (``dynamo_ctx``) or function (in its closure), else None."""
    ctx = getattr(obj, "dynamo_ctx", None)
    for cell in () if ctx is not None else (getattr(obj, "__closure__", None) or ()):
        try:
            if isinstance(cell.cell_contents, torch._dynamo.eval_frame._TorchDynamoContext):
                ctx = cell.cell_contents
        except ValueError:   # an empty cell
            continue
    return ctx


def _compile_session(obj):
    """The records.Session of the torch.compile(backend="moe") call that compiled ``obj``, else None."""
    return getattr(getattr(_dynamo_ctx(obj), "_backend_ctx_ctor", None), "session", None)


def _backend_note(compiled_with: str | None) -> tuple[str, ...]:
    if compiled_with in (None, "moe"):
        return ()
    return (f"this model was compiled with backend={compiled_with!r}, which rewrites no MoE region: the report "
            "shows what torch.compile(model, backend=\"moe\") would do",)


def _submodules_note(fn, compiled_with: str | None, regions) -> tuple[str, ...]:
    """A model not compiled itself whose submodules are (``layer.compile()``, or ``torch.compile(layer)``
    assigned back): explain traced the whole model, so say which are compiled and which rewritten regions
    lie outside them, and run eagerly (review helper-90: "3 rewritten" where one layer was compiled)."""
    from .backend import moe_backend

    if compiled_with is not None or not isinstance(fn, torch.nn.Module):
        return ()
    compiled = []
    for n, m in fn.named_modules():
        how = _compiled_with(getattr(m, "_compiled_call_impl", None) or m, m, moe_backend) \
            if n and not n.endswith("_orig_mod") else (None, {}, None, False)
        if how[0] == "moe" and not how[3]:   # not a compile_blocks model (its blocks are listed themselves)
            compiled.append(_plain_path(n))
    if not compiled:
        return ()
    inside = lambda path: any(path == c or path.startswith(f"{c}.") for c in compiled)  # noqa: E731
    shown = ", ".join(compiled[:3]) + (", ..." if len(compiled) > 3 else "")
    out = [f"this model is not compiled itself; {len(compiled)} submodule(s) are, with backend=\"moe\" ({shown}): "
           "explain traced a whole-model compile, regions inside those submodules are rewritten as listed, the rest "
           "runs eagerly"]
    eager = sorted({r.module or "<top>" for r in regions if r.status == "rewritten" and not inside(_plain_path(r.module))})
    if eager:
        out.append(f"{', '.join(eager)}: outside every submodule compiled with backend=\"moe\", so it runs eagerly or "
                   "as that other compile runs it (NOT rewritten); compile the model, or each block with "
                   "moe_compile.compile_blocks(model)")
    return tuple(out)


def _plain_path(path: str) -> str:
    return ".".join(p for p in path.split(".") if p != "_orig_mod")


def _explain_options(user: dict) -> tuple[dict, MoEConfig]:
    """(the compile's options as explain runs them: without Inductor, weights left where they are,
    quiet; the compile's own config: its moe.inductor, its moe.disable)."""
    config, _ = MoEConfig.from_options(None, user)
    kept = {k: v for k, v in user.items() if k.startswith("moe.") and k not in ("moe.debug", "moe.mode", "moe.rehome_weights")
            or k == "fallback_random"}   # Inductor's options and mode mean nothing without Inductor; explain never re-homes
    return {**kept, **_EXPLAIN_OPTIONS,
            "moe.disable": tuple(dict.fromkeys((*config.disable, *_EXPLAIN_OPTIONS["moe.disable"])))}, config


def _compiled_forward(fn):
    """A compiled function the module instance holds as its ``forward`` (``model.forward =
    torch.compile(model.forward)``), else None."""
    own = fn.__dict__.get("forward") if isinstance(fn, torch.nn.Module) else None
    return own if own is not None and _dynamo_ctx(own) is not None else None


def _unwrap(fn):
    """The user's module or function behind a torch.compile wrapper."""
    fn = getattr(fn, "_orig_mod", fn)
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def _times_note(r: RegionRecord, times: int) -> RegionRecord:
    """One row for a region found ``times`` > 1 times (the compile's counters count each)."""
    if times < 2:
        return r
    return dataclasses.replace(r, notes=(f"found {times} times in the traced graphs (one module called {times} times, "
                                         f"in {times} graphs, or layers this report cannot tell apart): each one "
                                         f"{r.status}",) + r.notes)


def _explain_notes(r: RegionRecord, disabled: tuple = ()) -> RegionRecord:
    """What the compile does that explain (which touches no user tensor) does not: ModuleList expert
    weights are re-homed into one buffer per linear and, where nothing else hooks their gradients,
    given to the graph as one stacked input per buffer (lowering/expert_stack.py); ``disabled``: the
    compile's ``moe.disable`` (with ``moe.rehome_weights`` / ``moe.stack_expert_params`` False in it)."""
    if not (r.status == REWRITTEN and any(o.startswith("grouped_mm_list") for o in r.ops)):
        return r
    from .lowering.expert_stack import why_not_stacked
    from .lowering.rehome import NESTED_REGION_NOTE
    from .pipeline import _LIST_NOTE

    notes = r.notes
    if any(n.startswith(NESTED_REGION_NOTE) for n in notes):   # the compile does not re-home them either
        disabled = tuple(disabled) + ("rehome_weights",)
    if {"stack_expert_params", "rehome_weights"} & set(disabled):   # stacked only where they were re-homed
        notes = tuple(n.split(_LIST_NOTE)[0] + _LIST_NOTE + " one by one (ModuleList experts; this compile sets "
                      "moe.stack_expert_params or moe.rehome_weights to False, or lists it in moe.disable): guards, "
                      "autograd and gradient accumulation cost host time for each on every step; the default stacks "
                      "them into one input per buffer" if _LIST_NOTE in n else n for n in notes)
    elif why_not_stacked() is None:
        notes = tuple(n.split(_LIST_NOTE)[0] + " per-expert weight tensors (ModuleList experts): the compile gives "
                      "the graph one stacked input per buffer instead (one autograd leaf each, gradients handed "
                      "to the same Parameters), so they cost no per-Parameter autograd or wrapper time; "
                      "options={\"moe.stack_expert_params\": False} keeps one input per Parameter"
                      if _LIST_NOTE in n else n for n in notes)
    if "rehome_weights" in disabled:
        return dataclasses.replace(r, notes=notes)
    note = ("ModuleList expert weights: torch.compile(backend=\"moe\") moves them into one buffer per linear "
            "when it compiles (same Parameters and values; explain() leaves them in place; "
            "options={\"moe.rehome_weights\": False} keeps them where they are)")
    return dataclasses.replace(r, notes=notes + (note,))


def _earlier_skips(fn, tried: set) -> list[RegionRecord]:
    """Frames of this model that an earlier moe compile saw Dynamo give up on and that explain's own
    trace did not try (Dynamo never traces a skipped frame again), and frames that hit Dynamo's recompile
    limit (explain's trace has its own budget; the model's compiled frame runs eagerly on new guards)."""
    from . import skipped_frames

    if not skipped_frames.live_skips():
        return []
    spans = []
    # every class of each module's MRO below torch's own: a frame may be a base class's forward (transformers'
    # GradientCheckpointingLayer.__call__ wraps every decoder layer; review helper-78's compile_blocks run)
    objs = ([c for m in fn.modules() for c in type(m).__mro__ if not c.__module__.startswith(("torch.", "builtins"))]
            if isinstance(fn, torch.nn.Module) else [fn])
    for obj in dict.fromkeys(objs):
        try:
            lines, first = inspect.getsourcelines(obj)
            spans.append((inspect.getsourcefile(obj), first, first + len(lines)))
        except (OSError, TypeError):
            continue
    from torch._dynamo.convert_frame import input_codes

    # still marked: Dynamo has seen the frame's code since its last reset (torch._dynamo.reset() clears the
    # marks and what it has seen; a stale record named a frame of another test's model: review helper-77's run)
    seen = {(c.co_filename, c.co_firstlineno, c.co_name) for ref in list(input_codes.seen) if (c := ref()) is not None}
    return [r for (file, line), (frame, r) in skipped_frames.live_skips().items()
            if (frame not in tried or r.code.startswith("recompile_limit")) and frame in seen
            and any(file == f and lo <= line < hi for f, lo, hi in spans)]


def _isolated() -> dict:
    """torch.compile keyword that gives explain's compile its own recompile budget (torch >= 2.13)."""
    return {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


@contextlib.contextmanager
def _no_side_effects(fn, args, kwargs):
    """Restore what running the model once under a fresh compile changes: RNG states (torch's, Python's
    ``random``, numpy's), buffers (values and objects) and Dynamo's caches (explain's entries dropped,
    frames it made Dynamo skip re-enabled)."""
    import torch._dynamo  # noqa: F401
    from torch._dynamo.utils import get_compilation_metrics

    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    module = fn if isinstance(fn, torch.nn.Module) else None
    if module is not None:
        tensors += list(module.parameters())
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    buffers = [(m, name, b, b.detach().clone()) for m in (module.modules() if module is not None else ())
               for name, b in m._buffers.items() if b is not None]
    caches = _dynamo_entries()
    t0 = max([getattr(m, "start_time_us", 0) or 0 for m in get_compilation_metrics()] + [0])
    patches = {} if _isolated() else {"recompile_limit": 1 << 30, "accumulated_recompile_limit": 1 << 30}
    if hasattr(torch._dynamo.config, "invalidate_compile_context_weakrefs"):   # what a registered backend gets:
        patches["invalidate_compile_context_weakrefs"] = True   # no weak refs to the Parameters (swap_tensors)
    limits = torch._dynamo.config.patch(**patches)
    tried: set = set()   # (file, first line, name) of every frame Dynamo tried in the block
    numpy = sys.modules.get("numpy")   # Python's and numpy's generators too (random.random() in a forward)
    py_state, np_state = random.getstate(), numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=devices), limits:
            yield tried
    finally:
        random.setstate(py_state)
        if np_state is not None:
            numpy.random.set_state(np_state)
        with torch.no_grad():
            for m, name, b, saved in buffers:
                if m._buffers.get(name) is not b:
                    m._buffers[name] = b
                if b.shape == saved.shape:
                    b.copy_(saved)
        new = [m for m in get_compilation_metrics() if (getattr(m, "start_time_us", 0) or 0) > t0]
        tried.update((m.co_filename, m.co_firstlineno, m.co_name) for m in new)
        _drop_new_entries(caches, {(m.co_filename, m.co_firstlineno, m.co_name) for m in new
                                   if getattr(m, "fail_type", None)})


def _dynamo_entries() -> dict:
    """id(code) -> (code, its cache entries) for every code object Dynamo has seen (the entries
    themselves are held: their Python wrappers keep their identity only while referenced)."""
    from torch._dynamo.convert_frame import input_codes
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    out = {}
    for ref in list(input_codes.seen):
        code = ref()
        if code is not None:
            out[id(code)] = (code, list(_debug_get_cache_entry_list(code)))
    return out


def _drop_new_entries(before: dict, failed: set) -> None:
    """Undo explain's mark on Dynamo's caches: a code object with no cache entry before is reset (its
    entries and skip mark go); one with the user's entries keeps them, explain's entries are
    invalidated (never matched again; torch >= 2.13) and a skip mark explain caused is lifted."""
    import torch._C._dynamo.eval_frame as ef

    from .skipped_frames import compile_again

    after = _dynamo_entries()
    for key, (code, entries) in after.items():
        old = before[key][1] if key in before and before[key][0] is code else []
        new = [e for e in entries if not any(e is o for o in old)]
        tried = (code.co_filename, code.co_firstlineno, code.co_name) in failed
        if not new and not tried:
            continue
        if not old:
            ef.reset_code(code)
            continue
        for e in new:
            _invalidate(e)
        if tried:
            compile_again(code)


def _invalidate(entry) -> None:
    try:
        from torch._dynamo.guards import DeletedGuardManagerWrapper

        extra = getattr(entry.guard_manager, "extra_state", None)
        if extra is not None and hasattr(extra, "invalidate"):
            extra.invalidate(entry, DeletedGuardManagerWrapper("moe_compile.explain: entry of explain's own compile"))
    except Exception:  # noqa: BLE001  (best effort: the entry stays, matched only by explain's backend)
        pass
