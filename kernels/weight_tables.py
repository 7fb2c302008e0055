"""Plans for reading per-expert weights in place (``cuda.grouped_mm_list``), and when a plan's address
table may be freed.

A plan is cached on the experts' addresses (``cuda._list_plan`` makes it)::

    ("view", step)                       evenly spaced views of one buffer: one strided [E, K, N] view
    ("table", host, streams, captured)   int64 element offsets from expert 0 in pinned host memory,
                                         read by the kernels through unified addressing
    ("stack",)                           anything else: torch.stack (a copy per call)

Freeing a table is not ordered with the kernels that read it: torch's pinned-memory allocator waits
only for the copies that used a block, a kernel's read through unified addressing records nothing, so
a freed table is handed to the next ``pin_memory()`` at once and a kernel still queued reads another
list's offsets (wrong experts' weights, silently). So a table leaves the cache but is not freed while
a launch may still read it:

- a table read while a CUDA graph is being captured (``captured``) is kept for the life of the process:
  the graph reads it on every replay;
- any other table evicted from the cache is kept until an event recorded, at eviction, on every stream
  that launched a kernel reading it (``streams``) has completed; completed events are found at later
  evictions, without waiting for any.

No eviction runs while the current stream captures (no event is recorded into a graph, none queried).
"""
from __future__ import annotations

import torch

PLAN_CACHE_SIZE = 256

_PLANS: dict[tuple, tuple] = {}
_RETIRED: list[tuple[list, list]] = []        # (events, tables) evicted while kernels may read them
_READ_BY_GRAPHS: list[torch.Tensor] = []      # tables a captured CUDA graph reads: never freed


def new_table(offsets: list[int]) -> tuple:
    return ("table", torch.tensor(offsets, dtype=torch.int64).pin_memory(), set(), [])


def note_read(plan: tuple, stream, capturing: bool) -> None:
    """Before a launch that reads ``plan``'s table on ``stream`` (captured into a graph if ``capturing``)."""
    if capturing:
        if not plan[3]:
            plan[3].append(True)
            _READ_BY_GRAPHS.append(plan[1])
    else:
        plan[2].add(stream)


def _record_event(stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


def get(key: tuple) -> tuple | None:
    return _PLANS.get(key)


def put(key: tuple, plan: tuple, capturing: bool) -> None:
    if len(_PLANS) >= PLAN_CACHE_SIZE and not capturing:
        _evict()
    _PLANS[key] = plan


def _evict() -> None:
    _RETIRED[:] = [(events, tables) for events, tables in _RETIRED if not all(e.query() for e in events)]
    tables, streams = [], set()
    for plan in _PLANS.values():
        if plan[0] == "table" and not plan[3]:
            tables.append(plan[1])
            streams |= plan[2]
    if tables:
        _RETIRED.append(([_record_event(s) for s in streams], tables))
    _PLANS.clear()
