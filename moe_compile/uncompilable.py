"""When compiling a graph fails: the rewritten graph (ours to fix), or the original graph with the
data-dependent sizes the capture scope gave it (the user's to avoid, with one option).

``compile_unrewritten``: compiling a rewritten graph failed (a bug of ours): its regions are refused
with ``compile_error`` (warned) and the original graph is compiled instead.

``capture_error``: the backend's capture scope (``backend.capture_ctx``) lets Dynamo capture
where/nonzero/boolean masks in the frames it compiles, so that per-expert loops reach one graph;
stock torch.compile breaks the graph at those ops instead. When torch itself cannot compile such a
graph (e.g. AOTAutograd guarding on an unbacked size in a cumsum's backward), the user gets an error
that names the cause and the option that gives stock torch.compile's behaviour
(``capture_compile_error``): a clear error, never a quiet eager run.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("moe_compile")


def captured_data_dependent(gm: torch.fx.GraphModule) -> bool:
    """The graph has data-dependent sizes (where/nonzero/masks captured by the capture scope)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return any(free_unbacked_symbols(n.meta.get("example_value")) for n in gm.graph.nodes
               if isinstance(n.meta.get("example_value"), torch.Tensor))


class CaptureCompileError(RuntimeError):
    """torch could not compile a graph with the data-dependent sizes the capture scope gave it."""


def capture_error(gm: torch.fx.GraphModule, exc: BaseException, records=()) -> CaptureCompileError | None:
    """The error to raise instead of ``exc`` (``from exc``) when ``gm`` has captured data-dependent sizes:
    its message names the cause and the fix (``capture_compile_error``); else None. ``records``: the
    graph's (none: the sizes are in code that holds nothing MoE-like, e.g. attention within clusters)."""
    from .passes import reasons

    if not (captured_data_dependent(gm) and _data_dependent_error(exc)):
        return None
    detail = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              "scope": _refused_scope(records) if records else
              "; the graph holds no MoE code the backend recognises: stock torch.compile breaks the graph at those "
              "ops and compiles the rest"}
    return CaptureCompileError(f"moe_compile [capture_compile_error]: {reasons.message('capture_compile_error', detail)}"
                               f"\n  fix: {reasons.fix('capture_compile_error')}")


def _refused_scope(records) -> str:
    """The graph's refused MoE regions, named with their codes and reasons (what explain() lists for them):
    the data-dependent sizes the error is about are theirs when nothing was rewritten."""
    from . import records as records_mod

    refused = [r for r in records if r.status == records_mod.REFUSED and r.code]
    if not refused:
        return ""
    shown = "; ".join(f"{r.module or '<top>'} [{r.code}]: {r.reason}" for r in refused[:2])
    more = f" (and {len(refused) - 2} more: moe_compile.explain lists them)" if len(refused) > 2 else ""
    return f"; its MoE code was not rewritten: {shown}{more}"


def _data_dependent_error(exc: BaseException) -> bool:
    """``exc`` (or an exception it was raised from) is torch failing on a data-dependent size."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, GuardOnDataDependentSymNode) or "data-dependent" in str(exc) \
                or type(exc).__name__ in ("DataDependentOutputException", "DynamicOutputShapeException"):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def compile_unrewritten(compile_graph, gm, records, exc):
    """Compiling the rewritten graph failed with ``exc``: compile the original ``gm`` with
    ``compile_graph(records)``, its rewritten regions refused with ``compile_error``: (the compiled
    callable, the records)."""
    import dataclasses

    from . import records as records_mod
    from .passes import reasons

    log.warning("moe_compile: compiling the rewritten graph failed (%s: %s); compiling it unrewritten",
                type(exc).__name__, exc)
    detail = {"error": f"{type(exc).__name__}: {exc}"}
    records = [dataclasses.replace(r, status=records_mod.REFUSED, ops=(), notes=(), code="compile_error",
                                   reason=reasons.message("compile_error", detail), fix=reasons.fix("compile_error"))
               if r.status == records_mod.REWRITTEN else r for r in records]
    try:
        return compile_graph(records), records
    except Exception as exc2:
        err = capture_error(gm, exc2, records)
        if err is None:
            raise
        raise err from exc2
