"""The ``moe`` torch.compile backend (entry point ``torch_dynamo_backends: moe``).

    torch.compile(model, backend="moe", mode=None, options={"moe.debug": True, ...})

Pipeline: Dynamo graph -> find/check/lower MoE regions (``pipeline.run_passes``) -> Inductor via
``compile_fx`` with the mode's options and the non-``moe.*`` options as scoped config patches
(or, with ``moe.inductor=False``, AOTAutograd with eager kernels).

Capture of data-dependent ops. Per-expert loops (``torch.where(sel == i)``, ``nonzero``, boolean
masks) reach a backend as ONE graph only when Dynamo's ``capture_dynamic_output_shape_ops`` is on
while it traces. We do not set that globally: the backend carries a ``backend_ctx_ctor`` (a context
manager Dynamo enters around tracing and every call of frames compiled with this backend) that
patches ``capture_dynamic_output_shape_ops=True`` and ``suppress_errors=True`` for the duration of
those calls only. ``suppress_errors`` makes a frame that cannot be traced with capture on (e.g.
``bincount(...).tolist()`` raising GuardOnDataDependentSymNode) run eagerly instead of crashing;
``moe_compile.explain`` reports such frames with a fix. torch.compile wraps backends in
``_TorchCompileWrapper`` and a debug wrapper that drop ``backend_ctx_ctor``;
``_install_ctx_shim`` (applied when this module is imported, i.e. when the backend is looked up)
adds a read-only property to the debug wrapper class that forwards it. Other backends are not
affected: the property returns their own attribute or raises AttributeError as before.
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch

from .config import MoEConfig

log = logging.getLogger(__name__)


def capture_ctx(options: dict | None = None):
    """The ``backend_ctx_ctor`` for one torch.compile call: a zero-argument factory of the Dynamo
    config scope used while tracing and running frames compiled with ``moe``.

    Dynamo calls the factory around every call of the compiled function; the options are validated
    on the first call only (outside Dynamo's suppress_errors: a bad option must reach the user as
    ValueError), not re-parsed each time."""

    @functools.cache
    def flags() -> dict | None:
        config, _ = MoEConfig.from_options(None, options)
        # moe.strict: errors of our passes must raise, so do not let Dynamo swallow them
        return dict(capture_dynamic_output_shape_ops=True, suppress_errors=not config.strict) \
            if config.capture_dynamic else None

    def ctor():
        f = flags()
        return contextlib.nullcontext() if f is None else torch._dynamo.config.patch(**f)

    return ctor


def inductor_defaults(records) -> dict:
    """Inductor settings this backend changes for one graph (the user's options override them).

    ``size_asserts=False`` when a rewritten region reads per-expert parameter lists (ModuleList
    experts): Inductor then checks the size and stride of every one of them on every call, forward
    and backward (2 x 384 checks for a 128-expert SwiGLU layer; 1.4 ms of a 7.4 ms host-bound step
    on an H200 host, docs/benchmarks.md). Dynamo's guards already check every graph input's sizes
    and strides before the compiled code runs."""
    listy = any(r.status == "rewritten" and any(o.startswith("grouped_mm_list") for o in r.ops) for r in records)
    return {"size_asserts": False} if listy else {}


def _compile_rewritten(gm, example_inputs, config: MoEConfig, inductor_options: dict, records=()):
    if not config.inductor:
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = {**inductor_defaults(records), **list_mode_options(config.mode), **inductor_options}
    return compile_fx(gm, example_inputs, config_patches=patches)


def moe_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """torch.compile backend: rewrite MoE regions into moe_compile ops, then hand over to Inductor."""
    from . import pipeline, report

    config, inductor_options = MoEConfig.from_options(mode, options)
    gm, records = pipeline.run_passes(gm, example_inputs, config)
    compiled = _compile_rewritten(gm, example_inputs, config, inductor_options, records)
    if config.rehome_weights and records:
        # after compiling: AOTAutograd's fake inputs were made with the parameters' old storage
        # offsets; the compiled code itself does not depend on them (lowering/rehome.py)
        from moe_compile.lowering.rehome import rehome_notes

        records = rehome_notes(gm, example_inputs, records)
    report.publish(records)
    return compiled


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
        return make((getattr(inner, "kwargs", None) or {}).get("options") or {})

    WrapBackendDebug.backend_ctx_ctor = property(backend_ctx_ctor)
    WrapBackendDebug._moe_compile_ctx_shim = True
    return True


_install_ctx_shim()
