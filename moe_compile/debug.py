"""Debug output: region tables, graphs before/after, TORCH_TRACE artifacts.

Enabled by ``options={"moe.debug": True}`` or ``MOE_COMPILE_DEBUG=1`` (logs at WARNING so it shows
without logging setup), and always available at DEBUG level through ``TORCH_LOGS="+moe_compile"``.
"""
from __future__ import annotations

import logging

log = logging.getLogger("moe_compile")


def format_records(records) -> str:
    rows = [("module", "form", "status", "experts", "top_k", "ops / reason", "where")]
    for r in records:
        detail = ", ".join(r.ops) if r.status == "rewritten" else r.reason
        rows.append((r.module or "<top>", r.form, r.status, str(r.num_experts or "-"), str(r.top_k or "-"),
                     detail, r.where))
    widths = [min(max(len(row[i]) for row in rows), 60 if i == 5 else 40) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(cell[:w].ljust(w) for cell, w in zip(row, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _trace(name: str, payload: str) -> None:
    try:
        import torch._logging

        torch._logging.trace_structured(
            "artifact", metadata_fn=lambda: {"name": name, "encoding": "string"}, payload_fn=lambda: payload)
    except Exception:  # tracing is best-effort and must never break a compile
        pass


def log_rewrite(before: str, after: str, records, seconds: float, loud: bool = True) -> None:
    """Region table and graphs; at WARNING in debug mode, else at DEBUG (TORCH_LOGS=+moe_compile)."""
    level = logging.WARNING if loud else logging.DEBUG
    table = format_records(records)
    log.log(level, "moe_compile: %d MoE region(s) in %.3fs\n%s", len(records), seconds, table)
    log.log(level, "moe_compile: graph before\n%s", before)
    log.log(level, "moe_compile: graph after\n%s", after)
    _trace("moe_compile_graph_before", before)
    _trace("moe_compile_graph_after", after)
    _trace("moe_compile_regions", table)
