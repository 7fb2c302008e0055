"""The ``moe`` torch.compile backend (entry point ``torch_dynamo_backends: moe``).

    torch.compile(model, backend="moe", mode=None, options={"moe.debug": True, ...})

Pipeline (``pipeline.PASSES``): the dynamo stage on a copy of Dynamo's graph (find, check, lower
MoE regions) -> Inductor via ``compile_fx`` with the mode's options and the non-``moe.*`` options as
scoped config patches, the post_grad stage hooked in as Inductor's ``post_grad_custom_post_pass``
(or, with ``moe.inductor=False``, AOTAutograd with eager kernels and the post_grad stage in its
compilers) -> the after_compile stage -> the region records are published.

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
        from .hf_experts import substituted  # HF expert loops Dynamo cannot trace, in this scope only

        f = flags()
        return substituted(None if f is None else torch._dynamo.config.patch(**f))

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


class _PostGradPass:
    """The post_grad stage as Inductor's ``post_grad_custom_post_pass`` (a CustomGraphPass: its
    uuid keeps Inductor's FX graph cache correct), after the user's own pass if they set one."""

    def __init__(self, hook, user_pass=None):
        self.hook, self.user_pass = hook, user_pass

    def __call__(self, graph):
        if self.user_pass is not None:
            self.user_pass(graph)
        self.hook(graph)

    def uuid(self):
        from moe_compile import __version__

        user = getattr(self.user_pass, "uuid", lambda: repr(self.user_pass))() if self.user_pass else None
        return ("moe_compile.post_grad", __version__, user)


def _aot_eager(gm, example_inputs, hook):
    """AOTAutograd with eager kernels (as ``aot_eager``), the post_grad stage run on each graph."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def compiler(fx_g, inputs):
        if hook is not None:
            hook(fx_g.graph)
        return boxed_nop(fx_g, inputs)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition,
                        keep_inference_input_mutations=True)(gm, example_inputs)


def _compile_rewritten(gm, example_inputs, config: MoEConfig, inductor_options: dict, records, notes: list):
    from .pipeline import post_grad_hook

    hook = post_grad_hook(config, notes)
    if not config.inductor:
        return _aot_eager(gm, example_inputs, hook)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = {**inductor_defaults(records), **list_mode_options(config.mode), **inductor_options}
    if hook is not None:
        patches["post_grad_custom_post_pass"] = _PostGradPass(hook, patches.get("post_grad_custom_post_pass"))
    return compile_fx(gm, example_inputs, config_patches=patches)


def moe_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """torch.compile backend: rewrite MoE regions into moe_compile ops, then hand over to Inductor."""
    import dataclasses

    from . import pipeline, records as records_mod

    config, inductor_options = MoEConfig.from_options(mode, options)
    gm, records = pipeline.run_dynamo_stage(gm, example_inputs, config)
    notes: list = []
    compiled = _compile_rewritten(gm, example_inputs, config, inductor_options, records, notes)
    if records:
        # after compiling: AOTAutograd's fake inputs were made with the parameters' old storage
        # offsets; the compiled code itself does not depend on them (lowering/rehome.py)
        records = pipeline.run_after_compile(gm, example_inputs, records, config)
    if notes:
        records = [dataclasses.replace(r, notes=r.notes + tuple(dict.fromkeys(notes))) if r.status == "rewritten"
                   else r for r in records]
    records_mod.publish(records)
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
