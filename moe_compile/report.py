"""explain(): what the moe backend matched, rewrote and refused, and graph breaks in MoE code.

    report = moe_compile.explain(model, input_ids)
    print(report)                      # a table
    report.regions[0].status           # "rewritten" | "refused"
    report.graph_breaks[0].fix         # a concrete change to the user's code
"""
from __future__ import annotations

import dataclasses

import torch

from .debug import format_records
from .records import REFUSED, REWRITTEN, RegionRecord, recording

_MOE_WORDS = ("expert", "moe", "router", "routing", "gate", "topk", "top_k", "where", "nonzero", "tolist",
              "bincount", "one_hot", "histc", "split")


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    where: str     # file:line in the user's code
    reason: str
    fix: str
    code: str = ""


@dataclasses.dataclass(frozen=True)
class Report:
    regions: tuple[RegionRecord, ...]
    graph_breaks: tuple[GraphBreak, ...]
    graphs: int = 0

    @property
    def rewritten(self) -> list[RegionRecord]:
        return [r for r in self.regions if r.status == REWRITTEN]

    @property
    def refused(self) -> list[RegionRecord]:
        return [r for r in self.regions if r.status == REFUSED]

    def __str__(self) -> str:
        out = [f"moe_compile report: {len(self.rewritten)} MoE region(s) rewritten, {len(self.refused)} refused, "
               f"{self.graphs} graph(s), {len(self.graph_breaks)} graph break(s) in MoE code"]
        if self.regions:
            out.append(format_records(self.regions))
        for r in self.regions:
            out.extend(f"  note [{r.module}]: {n}" for n in r.notes)
        for b in self.graph_breaks:
            out.append(f"graph break at {b.where}: {b.reason}\n    code: {b.code}\n    fix:  {b.fix}")
        return "\n".join(out)


_FIXES = (
    ("expert_hit", "transformers' eager experts loop iterates over a data-dependent list of hit experts, so the "
     "experts never reach a graph. Load the model with experts_implementation=\"grouped_mm\" (the default in "
     "transformers 5), which backend=\"moe\" rewrites."),
    ("tolist", "`.tolist()` moves routing counts to the host (a sync, and a data-dependent Python list). Loop over "
     "range(num_experts) unconditionally (an expert with no tokens is fine), or use fixed-length counts "
     "(`one_hot(ids, E).sum(0)`) instead of bincount."),
    ("item", "`.item()` syncs with the host; keep the value a tensor."),
    ("data-dependent", "a Python `if` on tensor data (e.g. skipping empty experts) cannot be traced; remove it, "
     "the rewritten experts handle empty groups."),
    ("bincount", "`bincount` has a data-dependent output length; use `one_hot(ids, E).sum(0)` or "
     "`torch.histc(ids.float(), bins=E, min=0, max=E - 1)`."),
    ("nonzero", "a dynamic-shape op broke the graph: compile with backend=\"moe\" (it captures where/nonzero) or "
     "fullgraph=True."),
)


def _fix_for(text: str) -> str:
    low = text.lower()
    for key, fix in _FIXES:
        if key in low:
            return fix
    return "see torch._dynamo.explain for the full break reason"


def _hard_break(fn, args, kwargs) -> GraphBreak | None:
    """The first frame that cannot be traced at all with capture on (e.g. ``counts.tolist()`` raising
    GuardOnDataDependentSymNode). Under the backend's ``suppress_errors`` such a frame silently runs
    eagerly and ``explain`` counts no break, so trace once with errors surfaced."""
    import torch._dynamo

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, suppress_errors=False):
        try:
            torch._dynamo.explain(fn)(*args, **kwargs)
            return None
        except Exception as exc:  # noqa: BLE001  (any trace failure is the break we report)
            stack = list(getattr(exc, "real_stack", None) or [])
            frame = stack[-1] if stack else None
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            code = (frame.line or "").strip() if frame else ""
            where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" if frame else "?"
            text = f"{type(exc).__name__} {msg} {code} {frame.filename if frame else ''}"
            if not any(w in text.lower() for w in _MOE_WORDS):
                return None
            reason = f"{type(exc).__name__}: {msg[:160]} (the whole frame runs eagerly)"
            fix = _fix_for(f"{code} {msg}")
            if "split" in code and "tolist" in code:
                fix = ("`split(x, counts.tolist())` needs the group sizes on the host. Keep them on the device: "
                       "offsets = cumsum(counts, 0, dtype=int32) and one torch._grouped_mm(x_sorted, W[E], offs=offsets) "
                       "over stacked expert weights (backend=\"moe\" rewrites that form), or loop over "
                       "range(num_experts) with fixed-length one_hot(ids, E).sum(0) counts.")
            return GraphBreak(where, reason, fix, code)


def _breaks(fn, args, kwargs) -> tuple[list[GraphBreak], int]:
    import torch._dynamo

    hard = _hard_break(fn, args, kwargs)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, suppress_errors=True):
        try:
            ex = torch._dynamo.explain(fn)(*args, **kwargs)
        except Exception as exc:  # explain itself failed: report that as one break
            return [GraphBreak("?", f"torch._dynamo.explain failed: {exc}", _fix_for(str(exc)))], 0
    out = [hard] if hard is not None else []
    for br in ex.break_reasons:
        frame = br.user_stack[-1] if br.user_stack else None
        where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" if frame else "?"
        code = (frame.line or "").strip() if frame else ""
        text = f"{br.reason} {code} {frame.name if frame else ''} {frame.filename if frame else ''}"
        if any(w in text.lower() for w in _MOE_WORDS) and not (hard and (where, code) == (hard.where, hard.code)):
            out.append(GraphBreak(where, br.reason.splitlines()[0][:200], _fix_for(br.reason + " " + code), code))
    return out, ex.graph_count


def explain(model_or_fn, *args, **kwargs) -> Report:
    """Trace ``model_or_fn(*args, **kwargs)`` with the moe backend and report every MoE region.

    Runs the forward twice (torch._dynamo.explain for graph breaks, then the moe backend with
    AOTAutograd only, no Inductor, so it is quick). Like torch._dynamo.explain it resets Dynamo's
    caches: other compiled functions recompile on their next call."""
    import torch._dynamo

    from .backend import capture_ctx, moe_backend

    def backend(gm, example_inputs):  # a fresh callable per call: a fresh trace, not a cache hit
        return moe_backend(gm, example_inputs, options={"moe.inductor": False})

    backend.moe_capture_ctx = capture_ctx
    # first: torch._dynamo.explain resets Dynamo, which also clears frames that an earlier compile
    # with capture off marked as skipped (they would otherwise never reach our backend here)
    breaks, _ = _breaks(model_or_fn, args, kwargs)
    with recording() as graphs:
        torch.compile(model_or_fn, backend=backend)(*args, **kwargs)
    records = tuple(r for g in graphs for r in g)
    return Report(records, tuple(breaks), len(graphs))
