"""What happened to each MoE region: one ``RegionRecord`` per region of every compiled graph.

The backend publishes the records of each graph it compiled (``publish``) once the compiled code
exists; ``recording()`` collects them (``explain`` and tests), and ``counters`` counts them
process-wide (like ``torch._dynamo.utils.counters``: tests assert on it).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading

REWRITTEN, REFUSED = "rewritten", "refused"

counters: collections.Counter = collections.Counter()
_local = threading.local()


@dataclasses.dataclass(frozen=True)
class RegionRecord:
    """One MoE region of one compiled graph. ``code``/``reason``/``fix`` say why it was refused
    (``passes/reasons.py``); ``ops`` are the moe_compile ops of a rewritten graph."""
    module: str
    form: str
    status: str            # REWRITTEN | REFUSED
    reason: str
    ops: tuple[str, ...]
    where: str
    num_experts: int = 0
    top_k: int = 0
    notes: tuple[str, ...] = ()
    code: str = ""
    fix: str = ""


def publish(records) -> None:
    """Count and hand out the records of one compiled graph."""
    for r in records:
        counters[r.status] += 1
    for sink in getattr(_local, "sinks", []):
        sink.append(list(records))


@contextlib.contextmanager
def recording():
    """Collect the RegionRecords of every graph compiled by the moe backend inside the block:
    a list with one list of records per graph."""
    sinks = getattr(_local, "sinks", None)
    if sinks is None:
        sinks = _local.sinks = []
    graphs: list = []
    sinks.append(graphs)
    try:
        yield graphs
    finally:
        sinks.remove(graphs)
