"""Debug output: region tables, the graph after each pass, TORCH_TRACE artifacts.

Enabled by ``options={"moe.debug": True}`` or ``MOE_COMPILE_DEBUG=1`` (logs at WARNING so it shows
without logging setup), and always available at DEBUG level through ``TORCH_LOGS="+moe_compile"``.
"""
from __future__ import annotations

import logging

log = logging.getLogger("moe_compile")

_WIDTHS = (48, 28, 10, 7, 5, 60, 30)


def format_records(records) -> str:
    """A table (reasons and fixes in full on the lines under a refused region)."""
    rows = [("module", "form", "status", "experts", "top_k", "ops / reason code", "where")]
    for r in records:
        detail = ", ".join(r.ops) if r.status == "rewritten" else (r.code or "refused")
        rows.append((r.module or "<top>", r.form, r.status, str(r.num_experts or "-"), str(r.top_k or "-"), detail,
                     r.where))
    widths = [min(max(len(row[i]) for row in rows), cap) for i, cap in enumerate(_WIDTHS)]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
        elif records[j - 1].status != "rewritten":
            r = records[j - 1]
            lines.append(f"    reason: {r.reason}")
            if r.fix:
                lines.append(f"    fix:    {r.fix}")
    return "\n".join(lines)


def format_warning(r, also: list | tuple = ()) -> str:
    """The WARNING logged once per compiled model for a refused record: what, where, why, the fix.
    ``also``: the modules of the same graph refused with the same code at the same source line."""
    if r.is_break:  # the reason starts with "graph break at file:line" / "skipped frame at file:line"
        head = f"moe_compile: refused [{r.code}] in MoE code"
    else:
        names = list(dict.fromkeys(m or "<top>" for m in (r.module, *also)))
        listed = ", ".join(names if len(names) <= 6 else [*names[:3], "...", names[-1]])
        many = f" ({len(names)} regions)" if len(names) > 6 else ""
        head = f"moe_compile: refused [{r.code}] MoE region{'s' * (len(names) > 1)} {listed}{many} ({r.form}, {r.where})"
    return f"{head}: {r.reason}\n    fix: {r.fix}"


def _trace(name: str, payload: str) -> None:
    try:
        import torch._logging

        torch._logging.trace_structured(
            "artifact", metadata_fn=lambda: {"name": name, "encoding": "string"}, payload_fn=lambda: payload)
    except Exception:  # tracing is best-effort and must never break a compile
        pass


def log_rewrite(graphs, records, seconds: float | None, loud: bool = True) -> None:
    """Region table and the graph before and after each pass that changed it; at WARNING in debug
    mode, else at DEBUG (TORCH_LOGS=+moe_compile). ``seconds`` None: the table after the
    before_compile stage (stacked expert weights), which the graphs that follow it are."""
    level = logging.WARNING if loud else logging.DEBUG
    table = format_records(records)
    if seconds is None:
        log.log(level, "moe_compile: %d MoE region(s), as compiled\n%s", len(records), table)
    else:
        log.log(level, "moe_compile: %d MoE region(s) in %.3fs\n%s", len(records), seconds, table)
    for title, code in graphs:
        log.log(level, "moe_compile: %s\n%s", title, code)
        _trace(f"moe_compile_{title.replace(' ', '_')}", code)
    _trace("moe_compile_regions", table)
