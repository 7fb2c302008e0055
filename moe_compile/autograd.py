"""One compiled backward for models with many expert parameters (ModuleList experts).

A plain autograd backward runs one engine node per parameter (AccumulateGrad) and hands every
gradient over one by one: for a 128-expert SwiGLU layer that is 384 nodes and several ms of host
time per step, which the GPU work of the layer (~4 ms on an H200) cannot hide. Compiled autograd
traces the whole backward, gradient accumulation included, into one graph and runs it as one call:

    model = torch.compile(model, backend="moe")
    with moe_compile.compiled_backward():
        loss = model(x).sum()
        loss.backward()          # one compiled graph; every p.grad as with a plain backward

The backward graph is compiled with ``backend`` (default: this backend, which leaves backward
graphs to Inductor). This wraps ``torch._dynamo.compiled_autograd._enable``, a private torch API
(present in torch 2.11 and 2.13); ``torch._dynamo.config.compiled_autograd = True`` does the same for
backward calls made inside a compiled function.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


@contextlib.contextmanager
def compiled_backward(backend: Any = "moe", dynamic: bool | None = None, **options: Any) -> Iterator[None]:
    """Run every ``.backward()`` inside the block through compiled autograd.

    ``backend``/``options``: how the traced backward graph is compiled (``torch.compile``'s).
    ``dynamic``: treat sizes in the backward as dynamic; default as ``torch.compile`` does (static
    until a size changes)."""
    import torch
    from torch._dynamo import compiled_autograd

    enable = getattr(compiled_autograd, "_enable", None)
    if enable is None:
        raise RuntimeError(
            f"compiled_backward: torch {torch.__version__} has no torch._dynamo.compiled_autograd._enable; "
            "set torch._dynamo.config.compiled_autograd = True and call .backward() inside the compiled function")
    if dynamic is None:
        dynamic = not torch._dynamo.config.assume_static_by_default
    compiler = torch.compile(backend=backend, options=options or None)
    with enable(compiler, dynamic=dynamic):
        yield
