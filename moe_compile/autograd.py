"""One compiled backward for models with many expert parameters (ModuleList experts).

A plain autograd backward runs one engine node per parameter (AccumulateGrad) and hands every
gradient over one by one: for a 128-expert SwiGLU layer that is 384 nodes and several ms of host
time per step, which the GPU work of the layer (~4 ms on an H200) cannot hide. Compiled autograd
traces the whole backward, gradient accumulation included, into one graph and runs it as one call:

    model = torch.compile(model, backend="moe")
    with moe_compile.compiled_backward():
        loss = model(x).sum()
        loss.backward()          # one compiled graph; every p.grad as with a plain backward

In a single process without FSDP2 the backend already gives ModuleList experts one graph input and
one autograd leaf per buffer (lowering/expert_stack.py); this is for graphs that keep one input per
Parameter (multi-process jobs, FSDP2, ``moe.stack_expert_params=False``).

The backward graph is compiled with ``backend`` (default: this backend, which leaves backward
graphs to Inductor). This wraps ``torch._dynamo.compiled_autograd._enable``, a private torch API
(present in torch 2.11 and 2.13); ``torch._dynamo.config.compiled_autograd = True`` does the same for
backward calls made inside a compiled function.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator


@contextlib.contextmanager
def compiled_backward(backend: Any = "moe", dynamic: bool | None = None, options: dict | None = None,
                      **more_options: Any) -> Iterator[None]:
    """Run every ``.backward()`` inside the block through compiled autograd.

    ``backend``/``options``: how the traced backward graph is compiled (``torch.compile``'s), e.g.
    ``options={"moe.inductor": False}``; keyword options that are identifiers are merged in.
    ``dynamic``: treat sizes in the backward as dynamic; default as ``torch.compile`` does (static
    until a size changes). The options are validated when the block is entered."""
    import torch
    from torch._dynamo import compiled_autograd

    enable = getattr(compiled_autograd, "_enable", None)
    if enable is None:
        raise RuntimeError(
            f"compiled_backward: torch {torch.__version__} has no torch._dynamo.compiled_autograd._enable; "
            "set torch._dynamo.config.compiled_autograd = True and call .backward() inside the compiled function")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(f"compiled_backward: dynamic must be True, False or None, got {dynamic!r}")
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"compiled_backward: options must be a dict, e.g. {{\"moe.inductor\": False}}, got "
                        f"{type(options).__name__}")
    if "mode" in more_options:
        raise TypeError("compiled_backward: no mode= argument; give the Inductor mode as options={\"moe.mode\": ...}")
    if dynamic is None:
        dynamic = not torch._dynamo.config.assume_static_by_default
    options = {**(options or {}), **more_options}
    if backend == "moe":  # backward graphs hold no MoE region: no nothing-rewritten warning per backward
        from .config import MoEConfig

        MoEConfig.from_options(None, options)   # a bad option raises here, not inside Dynamo
        backend = quiet_backend()
    compiler = torch.compile(backend=backend, options=options or None)
    with enable(compiler, dynamic=dynamic):
        yield


@functools.cache
def quiet_backend():
    """The moe backend reporting to one quiet session, for graphs that hold no MoE region by
    construction: compiled-autograd backward graphs, a model's loss function (``compile_blocks``).
    There the nothing-rewritten warning would be noise (it would fire for every backward)."""
    from .backend import capture_ctx, moe_backend
    from .records import Session

    def moe_backward(gm, example_inputs, **kwargs):
        return moe_backend(gm, example_inputs, **kwargs)

    moe_backward.moe_capture_ctx = functools.partial(capture_ctx, session=Session(quiet=True))
    return moe_backward
