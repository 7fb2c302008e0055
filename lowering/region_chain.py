"""The regions of one graph lowered one after another, in graph order (``lower_region`` each).

The finders describe every region of a graph before any is lowered, so a region's fields name the
nodes it reads as the graph was then. Lowering a region points the readers of what it computed (its
accumulator and the accumulator's aliases, or its output and the output's aliases) at one new node
and erases its writes: the accumulator node that is left holds what it held before them (zeros),
and an output node may be erased. A later region whose fields name one of those nodes reads the new
node instead (a whole model in one graph: ``h = a(x); b(h)`` where ``a`` accumulates into
``out = zeros_like(x)`` and ``b``'s expert input is ``out``)::

    before:   out = zeros_like(x); out.index_add_(0, tok_e, y_e * w_e) ...   b.x = out; b's rows = out[perm]
    after a:  out = zeros_like(x); y_a = unpermute_combine(...)              b.x = out: zeros, stale
    followed: b.x = y_a; b's rows = permute_rows(y_a, ...)

A later region that reads such a node before the earlier region ends (regions interleaved in the
graph) is not lowered: ``RegionChain.lower`` raises (a ``lowering_error``, listed by explain()).
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from moe_compile.passes.region import AccumulateInPlace, Region, ReplaceOutput


class RegionChain:
    """``in_order(regions)`` then ``lower(region)`` for each: the fields of a region that name a node an
    earlier region's lowering replaced are followed to its new node first."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}   # the graph as the finders saw it
        self.replaced: dict[fx.Node, tuple[fx.Node, int]] = {}   # node -> (what its readers read now, the
        #                                                           graph position where that became true)

    def in_order(self, regions) -> list[Region]:
        return sorted(regions, key=self._start)

    def _start(self, region: Region) -> int:
        return min((self.order[n] for n in region.nodes if n in self.order), default=len(self.order))

    def _end(self, region: Region) -> int:
        return max((self.order[n] for n in region.nodes if n in self.order), default=len(self.order))

    def lower(self, region: Region, ep_chunks: int = 1) -> tuple[tuple[str, ...], set[fx.Node]]:
        """``lower_region`` on ``region`` with its fields followed; records what it replaced. Returns
        lower_region's notes and the nodes it added."""
        from .region import lower_region

        start = self._start(region)
        late = [n for n in _nodes_of(region) if n in self.replaced and self.replaced[n][1] >= start]
        if late:
            raise ValueError(f"lower_region: region {region.module or '<root>'} reads {late[0].name}, which "
                             f"an earlier MoE region computes, before that region ends (the two regions "
                             f"interleave in the graph); compile the two layers apart")
        followed = _follow(region, {n: new for n, (new, _) in self.replaced.items()})
        before = set(self.gm.graph.nodes)
        notes, out = lower_region(self.gm, followed, ep_chunks, with_output=True)
        added = set(self.gm.graph.nodes) - before
        end = self._end(region)
        # what this region replaced, as the finders named it and as followed (an earlier region's new output
        # that this one accumulates into: what named that now names this region's output)
        stale = set(_replaced_by(region.combine)) | set(_replaced_by(followed.combine))
        for n, (new, _) in list(self.replaced.items()):
            if new in stale:
                self.replaced[n] = (out, end)
        for n in stale:
            self.replaced[n] = (out, end)
        return notes, added


def _replaced_by(c) -> tuple[fx.Node, ...]:
    """The nodes whose readers ``lower_region`` points at the region's output (``_rewire_output`` /
    ``_rewire_accumulator``)."""
    if isinstance(c, ReplaceOutput):
        return (c.output, *c.aliases)
    if isinstance(c, AccumulateInPlace):
        return (c.acc, *c.aliases, *c.mutations)
    raise TypeError(f"lower_region: unknown combine {type(c).__name__}")


def _nodes_of(obj) -> list[fx.Node]:
    """Every fx.Node a region's fields name (through nested dataclasses, tuples and lists)."""
    if isinstance(obj, fx.Node):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [n for o in obj for n in _nodes_of(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [n for f in dataclasses.fields(obj) for n in _nodes_of(getattr(obj, f.name))]
    return []


def _follow(obj, mapping: dict):
    """``obj`` with every node of ``mapping`` replaced by its value (frozen dataclasses rebuilt)."""
    if isinstance(obj, fx.Node):
        return mapping.get(obj, obj)
    if isinstance(obj, (tuple, list)):
        items = [_follow(o, mapping) for o in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _follow(getattr(obj, f.name), mapping) for f in dataclasses.fields(obj)}
        changed = {k: v for k, v in changes.items() if v is not getattr(obj, k)}
        return dataclasses.replace(obj, **changed) if changed else obj
    return obj
