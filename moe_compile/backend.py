"""The ``moe`` torch.compile backend (entry point ``torch_dynamo_backends: moe``).

    torch.compile(model, backend="moe", mode=None, options={"moe.debug": True, ...})

Pipeline (``pipeline.PASSES``): the dynamo stage on a copy of Dynamo's graph (find, check, lower
MoE regions) -> Inductor via ``compile_fx`` with the mode's options and the non-``moe.*`` options as
scoped config patches, the post_grad stage hooked in as Inductor's ``post_grad_custom_post_pass``
(or, with ``moe.inductor=False``, AOTAutograd with eager kernels and the post_grad stage in its
compilers) -> the after_compile stage; the region records are published when the compiled graph
first runs (``records.PublishOnFirstCall``; ``records.publish``: counters, ``explain``, one WARNING
per refused region and compile).

Capture of data-dependent ops. Per-expert loops (``torch.where(sel == i)``, ``nonzero``, boolean
masks) reach a backend as ONE graph only when Dynamo's ``capture_dynamic_output_shape_ops`` is on
while it traces. We do not set that globally: the backend carries a ``backend_ctx_ctor`` (a context
manager Dynamo enters around tracing and every call of frames compiled with this backend) that
patches ``capture_dynamic_output_shape_ops=True`` and ``suppress_errors=True`` for the duration of
those calls only. ``suppress_errors`` makes a frame that cannot be traced with capture on (e.g.
``bincount(...).tolist()`` raising GuardOnDataDependentSymNode) run eagerly instead of crashing;
the scope then records such frames in MoE code (from Dynamo's compilation metrics) with a fix,
logged once and listed by ``moe_compile.explain``. It must not swallow our own errors: options
are validated on the first call before any tracing, and an error the backend cannot recover from
turns ``suppress_errors`` off for the rest of the call, so it reaches the user as with stock
torch.compile (the scope's patch restores the flag). torch.compile wraps backends in
``_TorchCompileWrapper`` and a debug wrapper that drop ``backend_ctx_ctor``;
``_install_ctx_shim`` (applied when this module is imported, i.e. when the backend is looked up)
adds a read-only property to the debug wrapper class that forwards it. Other backends are not
affected: the property returns their own attribute or raises AttributeError as before.
"""
from __future__ import annotations

import functools
import logging
import sys
import time

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from .config import MoEConfig
from .skipped_frames import lift_earlier_skips, lift_input_error_skips, raised_frames, report_skipped_frames

log = logging.getLogger(__name__)


def capture_ctx(options: dict | None = None, mode: str | None = None, session=None) -> "_CaptureCtx":
    """The ``backend_ctx_ctor`` for one torch.compile call: a zero-argument factory of the scope
    used while tracing and running frames compiled with ``moe`` (the Dynamo config patch, the
    compile's ``records.Session``, the check for frames Dynamo gave up on).

    Dynamo calls the factory around every call of the compiled function. Every option (``moe.*``,
    Inductor's, the mode) is validated on the first call, before Dynamo traces anything: there a
    ValueError reaches the user, while inside the backend Dynamo's ``suppress_errors`` would turn it
    into a silent eager run. Options are not re-parsed on later calls."""
    from . import records

    return _CaptureCtx(options, mode, session if session is not None else records.Session())


class _CaptureCtx:
    """``capture_ctx``'s factory: a class, not a closure, so that a compiled module pickles (torch.save of
    an OptimizedModule pickles its Dynamo context, this included); a copy starts a session of its own."""

    def __init__(self, options, mode, session):
        self.options, self.mode, self.session = options, mode, session
        self._flags: tuple | None = None

    def __reduce__(self):
        return capture_ctx, (self.options, self.mode)

    def flags(self) -> dict | None:
        if self._flags is None:
            config, _ = MoEConfig.from_options(self.mode, self.options)
            # moe.strict: errors of our passes must raise, so do not let Dynamo swallow them
            self._flags = (dict(capture_dynamic_output_shape_ops=True, suppress_errors=not config.strict)
                           if config.capture_dynamic else None,)
        return self._flags[0]

    def __call__(self):
        from .hf_experts import substituted  # HF expert loops Dynamo cannot trace, in this scope only

        f = self.flags()
        return _Scope(self.session, substituted(None if f is None else _ConfigPatch(f)), f is not None)


class _ConfigPatch:
    """``torch._dynamo.config.patch(**flags)`` at a fraction of its cost (it is entered on every call
    of the compiled model: patch() builds a class per call, ~50 us on a slow host)."""

    __slots__ = ("revert", "make")

    def __init__(self, flags: dict):
        patcher = getattr(torch._dynamo.config, "_make_closure_patcher", None)
        self.make = patcher(**flags) if patcher is not None else None
        if self.make is None:
            self.revert = torch._dynamo.config.patch(**flags)

    def __enter__(self):
        if self.make is not None:
            self.revert = self.make()
        else:
            self.revert.__enter__()

    def __exit__(self, *exc):
        if self.make is not None:
            self.revert()
        else:
            self.revert.__exit__(*exc)
        return False


class _Scope:
    """Around one call of frames compiled with ``moe``: the session the backend reports to, the
    config patch, and afterwards (only if Dynamo compiled something in this call) the records of
    frames in MoE code that Dynamo gave up on, and the nothing-rewritten warning. An exception
    leaving a graph break in MoE code (``fullgraph=True``) gets a note with the fix."""

    __slots__ = ("session", "inner", "patched", "prev", "frames", "graphs", "t0", "handling")

    def __init__(self, session, inner, patched: bool):
        self.session, self.inner, self.patched = session, inner, patched

    def __enter__(self):
        from .records import _local

        self.prev = (getattr(_local, "session", None), getattr(_local, "patched", False))
        _local.session, _local.patched = self.session, self.patched
        self.frames, self.graphs = _frames_tried(), self.session.graphs
        self.t0 = time.time_ns() // 1000
        self.handling = sys.exc_info()[1]   # a call made inside the caller's own `except` block
        if not self.session.lifted_earlier_skips:
            self.session.lifted_earlier_skips = True
            lift_earlier_skips(self.t0)
        try:
            return self.inner.__enter__()
        except BaseException:
            _local.session, _local.patched = self.prev
            raise

    def __exit__(self, exc_type, exc, tb):
        from .records import _local

        try:
            return self.inner.__exit__(exc_type, exc, tb)
        finally:
            _local.session, _local.patched = self.prev
            # Dynamo exits this scope with (None, None, None) from a `finally`: an error on its way
            # out is the one being handled
            exc = exc if exc is not None else sys.exc_info()[1]
            if exc is self.handling:
                exc = None
            if exc is not None:
                _note_break(exc)
            if _frames_tried() != self.frames or self.session.graphs != self.graphs:   # (fullgraph: no frame count)
                failed = lift_input_error_skips(self.t0) | raised_frames(self.t0, exc) if exc is not None else frozenset()
                skipped = report_skipped_frames(self.session, self.t0, failed)
                if exc is None:   # a call that raised ran nothing "as the default backend would"
                    # frames outside MoE code are named only when no graph reached this backend in the
                    # call: otherwise they may be another compile's, or have nothing to do with MoE
                    self.session.after_call(True, skipped if self.session.graphs == self.graphs else ())


def _frames_tried() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def _note_break(exc: BaseException) -> None:
    """A graph break in MoE code that reaches the user as an exception (``fullgraph=True``, or
    ``moe.strict``) gets a note with the reason code and the fix."""
    if getattr(exc, "_moe_compile_noted", False) or not hasattr(exc, "add_note"):
        return
    if type(exc).__name__ == "UncapturedHigherOrderOpError" and "aliasing" in str(exc):
        exc.add_note("moe_compile: if the inputs that alias are expert weights of a rewritten layer, the backend "
                     "re-homed them into one buffer (a nested_compile_region it could not see)\n  fix: "
                     "options={\"moe.rehome_weights\": False} keeps them where they are")
        exc._moe_compile_noted = True
        return
    stack = getattr(exc, "real_stack", None)
    if not stack:
        return
    from .passes.unclaimed import Frame, break_fix, classify_break, in_moe_code

    frames = [Frame(f.filename, f.lineno or 0, f.name, f.line or "") for f in stack]
    if not in_moe_code(frames):
        return
    from .passes import reasons

    code, detail = classify_break(frames, f"{type(exc).__name__}: {exc}")
    detail.update(what="graph break", effect="")
    exc.add_note(f"moe_compile [{code}]: {reasons.message(code, detail)}\n  fix: {break_fix(code, detail)}")
    try:
        exc._moe_compile_noted = True
    except AttributeError:  # pragma: no cover - an exception type with __slots__
        pass


def inductor_defaults(records, gm: torch.fx.GraphModule | None = None) -> dict:
    """Inductor settings this backend changes for one graph (the user's options override them).

    ``size_asserts=False`` when a rewritten region reads per-expert parameter lists (ModuleList
    experts): Inductor then checks the size and stride of every one of them on every call, forward
    and backward (2 x 384 checks for a 128-expert SwiGLU layer; 1.4 ms of a 7.4 ms host-bound step
    on an H200 host, docs/benchmarks.md). Dynamo's guards already check every graph input's sizes
    and strides before the compiled code runs.

    ``reorder_for_peak_memory=False`` when the graph moves rows across expert-parallel ranks: that
    Inductor pass moved every ``wait_tensor`` up to right after its all-to-all, undoing the
    ``ep_overlap`` schedule (lowering/overlap.py), so no expert GEMM ran under any all-to-all."""
    patches = {}
    if any(r.status == "rewritten" and any(o.startswith("grouped_mm_list") for o in r.ops) for r in records):
        patches["size_asserts"] = False
    if gm is not None and any(getattr(n.target, "__module__", None) == "moe_compile.kernels.ep_traceable"
                              for n in gm.graph.nodes if n.op == "call_function"):
        patches["reorder_for_peak_memory"] = False
    return patches


class _PostGradPass(CustomGraphPass):
    """The post_grad stage as an Inductor ``CustomGraphPass``, installed on every graph this backend
    compiles with Inductor (also when ``moe.disable`` leaves it no pass: its key still holds).

    ``uuid`` is its part of Inductor's FX graph cache key and AOTAutograd's: the stage's pass names,
    this package's version and a digest of its source (``source_digest``: an edited checkout must not
    reuse graphs that older passes, fake functions or autograd formulas made). On a cache hit the
    passes do not run; they only edit graphs (what a user must be told comes from the other stages,
    pipeline.py).

    The user's own ``post_grad_custom_post_pass`` (from the options, else Inductor's config) runs
    first. Where Inductor takes a list of passes, the user's go in that list before this one and
    Inductor runs and keys each itself (``_with_user_passes``); on an Inductor without lists they
    run inside this one (``user``), and one that Inductor cannot key (a plain callable, an empty
    ``uuid()``) makes this uuid None: Inductor then bypasses its caches, as for the user's pass alone."""

    def __init__(self, hook, user: tuple = ()):
        self.hook, self.user = hook, tuple(user)

    def __call__(self, graph):
        for p in self.user:
            p(graph)
        self.hook(graph)

    def uuid(self):
        from moe_compile import __version__

        keys = tuple(p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.user)
        if not all(keys):
            return None
        return ("moe_compile.post_grad", __version__, source_digest(), getattr(self.hook, "passes", None), keys)


def _inductor_takes_pass_lists() -> bool:
    """Whether this Inductor runs and keys each pass of a list given as a custom pass (torch 2.13: yes;
    torch 2.11: no)."""
    from torch._inductor import custom_graph_pass

    return hasattr(custom_graph_pass, "get_custom_graph_passes")


def _with_user_passes(hook, user):
    """What ``post_grad_custom_post_pass`` becomes: the user's pass(es) (None, one, or a list), then ours."""
    users = () if user is None else tuple(user) if isinstance(user, (list, tuple)) else (user,)
    users = tuple(p for p in users if not isinstance(p, _PostGradPass))   # a compile inside ours: never twice
    if not users:
        return _PostGradPass(hook)
    if _inductor_takes_pass_lists():
        return [*users, _PostGradPass(hook)]
    return _PostGradPass(hook, users)


_PACKAGES = ("moe_compile", "moe_compile.passes", "moe_compile.lowering", "moe_compile.kernels")


def package_files() -> list:
    """(package, path) of every Python file of moe_compile and its passes / lowering / kernels."""
    import importlib
    import pathlib

    return [(name, f) for name in _PACKAGES for root in importlib.import_module(name).__path__
            for f in sorted(pathlib.Path(root).glob("*.py"))]


def digest_files(files) -> str:
    """sha256 over (package, path) pairs: each file's package, name and text."""
    import hashlib

    h = hashlib.sha256()
    for name, f in files:
        h.update(f"{name}/{f.name}\0".encode())
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """The digest of this package's source (``digest_files(package_files())``), read once per process."""
    return digest_files(package_files())


def _aot_eager(gm, example_inputs, hook):
    """AOTAutograd with eager kernels (as ``aot_eager``), the post_grad stage run on each graph."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def compiler(fx_g, inputs):
        if hook.passes:
            hook(fx_g.graph)
            fx_g.recompile()  # the passes edit the graph; the module's code must follow (not left to lazy codegen)
        return boxed_nop(fx_g, inputs)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition,
                        keep_inference_input_mutations=True)(gm, example_inputs)


def _compile_rewritten(gm, example_inputs, config: MoEConfig, inductor_options: dict, records):
    from .pipeline import post_grad_hook

    hook = post_grad_hook(config)
    if not config.inductor:
        return _aot_eager(gm, example_inputs, hook)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    from .checkpoint_cudagraphs import without_cudagraphs_under_checkpoint
    from .records import current_session

    patches = {**inductor_defaults(records, gm), **list_mode_options(config.mode), **inductor_options}
    patches = without_cudagraphs_under_checkpoint(patches, current_session())   # torch #154306
    key = "post_grad_custom_post_pass"
    user = patches[key] if key in patches else getattr(torch._inductor.config, key)
    patches[key] = _with_user_passes(hook, user)
    return compile_fx(gm, example_inputs, config_patches=patches)


def moe_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """torch.compile backend: rewrite MoE regions into moe_compile ops, then hand over to Inductor.

    Failures: a pass that fails leaves its graph unrewritten (pipeline.py); compiling the rewritten
    graph failing compiles the original graph instead (refused, ``compile_error``); both warn, and
    raise with ``moe.strict``. An error that remains (bad options, Inductor failing on the original
    graph) is raised to the user, not handed to Dynamo's ``suppress_errors`` (which the capture scope
    turns on only for frames Dynamo cannot trace)."""
    # the passes evaluate ops on fake values (the lowering's GraphBuilder, stacked inputs' example
    # values): under a user's saved-tensor hooks (torch.utils.checkpoint's non-reentrant mode counts
    # the tensors they see in the forward and again when it recomputes) they would run the hooks at
    # compile time, as if the compiled call had saved those tensors (CheckpointError on the first
    # step); deferred as AOTAutograd's own tracing does (present in torch 2.11 and 2.13)
    from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing

    try:
        with _disable_saved_tensors_hooks_during_tracing():
            return _moe_backend(gm, example_inputs, mode, options)
    except Exception:
        _unsuppress()
        raise


def _ep_groups(gm) -> tuple[str, ...]:
    """Expert-parallel groups of ``gm``'s rewritten regions (none without torch.distributed's collectives)."""
    if not torch.distributed.is_available():
        return ()
    from .ep_ddp import ep_groups

    return ep_groups(gm)


def _unsuppress() -> None:
    """Inside the capture scope (which patched ``suppress_errors=True``), let the error propagate:
    the scope's patch restores the flag when the call returns."""
    from .records import _local

    if getattr(_local, "patched", False):
        torch._dynamo.config.suppress_errors = False


def _moe_backend(gm, example_inputs, mode, options):
    from . import pipeline, records as records_mod
    from .uncompilable import capture_error, compile_unrewritten

    config, inductor_options = MoEConfig.from_options(mode, options)
    session = records_mod.current_session()
    session.graphs += 1
    # the user's Inductor fallback_random option (applied when the graph compiles) also decides which rewrites
    # keep eager's random draws (pipeline._check)
    rng = {k: v for k, v in inductor_options.items() if k == "fallback_random"}
    if session.fallback_random is None:
        session.fallback_random = bool(rng.get("fallback_random", torch._inductor.config.fallback_random))
    with torch._inductor.config.patch(rng):
        new_gm, records = pipeline.run_dynamo_stage(gm, example_inputs, config)
    if records:
        compile_id = torch._guards.CompileContext.current_compile_id()
        if compile_id is not None:
            session.moe_frames.add(str(compile_id.frame_id))
    pipeline.check_ep_markers(new_gm, records)
    plan, inputs, stacked = None, example_inputs, []
    try:
        if new_gm is not gm:
            config, records = pipeline.keep_weights_in_nested_region(new_gm, records, config)
            before = pipeline.run_before_compile(new_gm, example_inputs, records, config)
            plan, inputs, stacked, records = before.plan, before.inputs, before.to_rehome, before.records
        compiled = _compile_rewritten(new_gm, inputs, config, inductor_options, records)
    except Exception as exc:
        err = capture_error(gm, exc, records) if new_gm is gm else None
        if err is not None:
            raise err from exc
        # Dynamo's restarts (e.g. a Python float the compile cannot keep symbolic) are not failures:
        # Dynamo traces the frame again and calls the backend with the new graph
        if new_gm is gm or config.strict or isinstance(exc, torch._dynamo.exc.RestartAnalysis):
            raise
        pipeline.check_ep_markers(gm, records, cause=exc)
        compiled, records = compile_unrewritten(
            lambda recs: _compile_rewritten(gm, example_inputs, config, inductor_options, recs), gm, records, exc)
        new_gm, plan, inputs, stacked = gm, None, example_inputs, []
    if plan is not None:
        from .expert_inputs import StackedInputs

        compiled = StackedInputs(compiled, plan, may_move="rehome_weights" not in config.disable)
    if new_gm is not gm and (groups := _ep_groups(new_gm)):
        from .ep_ddp import CheckedUnderDDP

        compiled = CheckedUnderDDP(compiled, groups)
    if any(r.status == records_mod.REWRITTEN for r in records):
        # after compiling: AOTAutograd's fake inputs were made with the parameters' old storage
        # offsets; the compiled code itself does not depend on them (lowering/rehome.py)
        try:
            records = pipeline.run_after_compile(new_gm, inputs, records, config, stacked)
        except Exception as exc:  # an optional optimisation: the compiled code is right without it
            if config.strict:
                raise
            log.warning("moe_compile: the after_compile passes failed (%s: %s); the rewritten graph runs without "
                        "them", type(exc).__name__, exc)
    if new_gm is not gm:
        _drop_graph_args(new_gm)
        from .forward_ad import RefuseForwardAD

        compiled = RefuseForwardAD(compiled)
    if not records:
        return compiled
    return records_mod.PublishOnFirstCall(compiled, records, session, gm)


def _drop_graph_args(gm) -> None:
    """Dynamo drops its graph's ``meta["grapharg"]`` once the backend returns (``OutputGraph.cleanup``);
    the copy the passes rewrote kept them, and with them a weak reference to every Parameter input for
    as long as the compiled code lives: ``torch.utils.swap_tensors`` refuses a tensor with one, so
    ``model.to(dtype)`` under ``torch.__future__.set_swap_module_params_on_conversion(True)`` failed
    after any moe compile (review helper-60). The copy's subgraphs too; the placeholders the lowering
    erases (stacked expert weights, lowering/expert_stack.py) drop theirs as they are erased."""
    for mod in gm.modules():
        if isinstance(mod, torch.fx.GraphModule):
            for node in mod.graph.nodes:
                node.meta.pop("grapharg", None)


moe_backend.moe_capture_ctx = capture_ctx


def _install_ctx_shim() -> bool:
    """Make torch.compile's wrappers forward ``moe_capture_ctx`` as ``backend_ctx_ctor``."""
    try:
        from torch._dynamo.repro.after_dynamo import WrapBackendDebug
    except ImportError:  # pragma: no cover - torch layout changed; capture then needs fullgraph=True
        log.warning("moe_compile: cannot scope data-dependent capture on this torch; use fullgraph=True")
        return False
    if getattr(WrapBackendDebug, "_moe_compile_ctx_shim", False):
        return True

    def backend_ctx_ctor(self):
        own = self.__dict__.get("backend_ctx_ctor")
        if own is not None:
            return own
        inner = self.__dict__.get("_torchdynamo_orig_backend")
        fn = getattr(inner, "compiler_fn", inner)
        make = getattr(fn, "moe_capture_ctx", None)
        if make is None:
            raise AttributeError("backend_ctx_ctor")
        kwargs = getattr(inner, "kwargs", None) or {}
        return make(kwargs.get("options") or {}, mode=kwargs.get("mode"))

    WrapBackendDebug.backend_ctx_ctor = property(backend_ctx_ctor)
    WrapBackendDebug._moe_compile_ctx_shim = True
    return True


_install_ctx_shim()
