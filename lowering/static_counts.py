"""use_static_counts: each ``passes.static_counts.StaticBincount`` -> a static-length count on the device.

Before: ``c = torch.bincount(ids, minlength=E)`` (length max(E, largest id + 1): unbacked under
        data-dependent capture, a host read on CUDA).
After:  ``c = torch.zeros(E, dtype=int64, device=ids.device).scatter_add(0, ids.long(), ones)``: the same
        values (every id is in [0, E), the finder proved it), length E; the unbacked length is recorded
        as E in the shape environment (``torch._check``), so the recorded values of its readers hold.

And each ``passes.static_counts.StaticRowCounts``:
Before: ``c = torch.tensor([sym_size(where(m0)[0], 0), ...], dtype=D, device=dev)`` (each size a nonzero's
        data-dependent length: the nonzero stays for it, a host sync).
After:  ``c = torch.stack([count_nonzero(m0), ...]).to(D)`` (0-dim for ``torch.tensor(size)``): the same
        values, no nonzero read; the selections go with the dead code when nothing else reads them.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from moe_compile.passes.normalize import val
from moe_compile.passes.static_counts import StaticBincount, StaticRowCounts

from .graph_edit import GraphBuilder, finish


def use_static_counts(gm: fx.GraphModule, found: tuple[StaticBincount | StaticRowCounts, ...]) -> list[fx.Node]:
    """Rewrite every ``found`` call; returns the new count node of each, in order."""
    g = gm.graph
    added = []
    for s in found:
        if isinstance(s, StaticRowCounts):
            added.append(_row_counts(g, s))
            continue
        b = GraphBuilder(g, s.node, GraphBuilder.fake_mode_of(s.ids, "use_static_counts"), s.node)
        ids = s.ids if val(s.ids).dtype == torch.int64 else b.method("long", s.ids)
        ones = b.fn(torch.ones_like, ids)
        zeros = b.fn(torch.zeros, s.length, dtype=torch.int64, device=val(s.ids).device)
        new = b.method("scatter_add", zeros, 0, ids, ones)
        old = val(s.node).shape[0]
        if isinstance(old, torch.SymInt):
            with b.mode:
                torch._check(old == s.length)
        s.node.replace_all_uses_with(new)
        g.erase_node(s.node)
        added.append(new)
    if any(isinstance(s, StaticRowCounts) for s in found):
        finish(gm)   # the selections' size asserts, then the selections, go when nothing else reads them
    return added


def _row_counts(g: fx.Graph, s: StaticRowCounts) -> fx.Node:
    b = GraphBuilder(g, s.node, GraphBuilder.fake_mode_of(s.masks[0], "use_static_counts"), s.node)
    counts = [b.fn(torch.count_nonzero, m) for m in s.masks]
    new = counts[0] if s.scalar else b.fn(torch.stack, counts)
    if s.dtype != torch.int64:
        new = b.method("to", new, s.dtype)
    s.node.replace_all_uses_with(new)
    g.erase_node(s.node)
    return new
