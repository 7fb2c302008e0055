"""Abstract values ("roles") the per-expert-loop dataflow (``loop_dataflow``) attaches to Dynamo graph nodes.

Legend: T tokens, K top-k slots, N = T*K routed (token, slot) pairs, E experts, H width.
A *row enumeration* names the order in which one expert's selected rows appear: two values of
one expert can only be combined when their enumerations agree (``enum``):

    ("tok", e)          token-ascending: where(ids == e) on [T, K], a boolean token mask, ...
    ("where", node)     any other where/nonzero order (e.g. slot-major, from one_hot(...).permute)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.fx as fx


@dataclass(frozen=True)
class Ids:
    """Expert ids [T, K] (``flat``: viewed as [N]); ``root`` is the [T, K] (or [T]) node."""
    root: fx.Node
    k: int
    flat: bool = False


@dataclass(frozen=True)
class OneHot:
    """one_hot(ids, C); ``axes`` names the dims, e.g. "tke", or "ekt" after permute(2, 1, 0)."""
    ids: Ids
    axes: str


@dataclass(frozen=True)
class Sel:
    """Boolean ids == e; layout "tk", "kt" or "n" (flat)."""
    ids: Ids
    e: int
    layout: str


@dataclass(frozen=True)
class WhereOf:
    """The tuple returned by where(Sel) / nonzero(Sel, as_tuple=True)."""
    sel: Sel
    node: fx.Node


@dataclass(frozen=True)
class Index:
    """Row indices of expert e's selected pairs: kind "tok" (token), "slot" or "pair" (t*K+j)."""
    ids: Ids
    e: int
    enum: tuple
    kind: str


@dataclass(frozen=True)
class TokMask:
    """Boolean [T]: token selected expert e (Sel.any(-1) and friends); enumerates ("tok", e)."""
    ids: Ids
    e: int


@dataclass(frozen=True)
class ScatterIndex:
    """Token indices of expert e broadcast to [n, H] (for scatter_add_)."""
    ids: Ids
    e: int
    enum: tuple


@dataclass(frozen=True)
class Weighted:
    """Routing weights [T, K] (root) times the selection of expert e: (w * Sel); ``reduced`` after
    .sum(-1) gives [T] (the weight each token gives expert e)."""
    w: fx.Node
    ids: Ids
    e: int
    reduced: bool


@dataclass(frozen=True)
class Rows:
    """x[rows of expert e] (the expert input), in enumeration ``enum``."""
    x: fx.Node
    ids: Ids
    e: int
    enum: tuple


@dataclass(frozen=True)
class RowFn:
    """A row-wise function of expert e's rows (inside the expert MLP template)."""
    rows: Rows


@dataclass(frozen=True)
class RowW:
    """Routing weight of each of expert e's rows; ``w`` is the [T, K] (or [N]) weights node."""
    w: fx.Node
    ids: Ids
    e: int
    enum: tuple


@dataclass(frozen=True)
class Contrib:
    """What expert e adds to its tokens: f_e(rows) (times its routing weight if ``w``)."""
    rows: Rows
    out: fx.Node          # last node of the expert template
    w: fx.Node | None


def expert_key(role) -> tuple | None:
    """(the router's ids node, expert e) of a role that belongs to one expert of one router, else None:
    what an op on an expert's rows is recorded under, so that it refuses that layer's loop only."""
    if isinstance(role, (RowFn, Contrib)):
        role = role.rows
    e, ids = getattr(role, "e", None), getattr(role, "ids", None)
    return None if e is None or ids is None else (ids.root, e)


@dataclass(frozen=True)
class AccRead:
    """acc[index] read as the left side of ``acc[index] += contrib``."""
    storage: "Storage"
    index: object         # Index | TokMask
    version: int


@dataclass(frozen=True)
class AccSum:
    """acc[index] + contrib, about to be written back with setitem."""
    read: AccRead
    contrib: Contrib


@dataclass(frozen=True)
class PendingScatter:
    """tok.unsqueeze(-1) of a token Index, before the expand that makes it a ScatterIndex."""
    index: Index


@dataclass
class Storage:
    """A tensor that expert contributions are accumulated into (mutable analysis state)."""
    alloc: fx.Node
    base: fx.Node | None                 # None: starts as zeros; else out = base + sum
    contribs: dict = dataclasses.field(default_factory=dict)   # e -> Contrib
    mutations: list = dataclasses.field(default_factory=list)  # nodes that wrote into it
    aliases: set = dataclasses.field(default_factory=set)      # nodes whose value is this storage
    version: int = 0
    readers: list = dataclasses.field(default_factory=list)    # (node, version) reads outside the pattern
    row_reads: list = dataclasses.field(default_factory=list)  # (node, version) the next layer's expert rows
    findings: list = dataclasses.field(default_factory=list)   # region.Finding: why it cannot be rewritten
    forked: bool = False                 # a functional index_add made a newer copy of it
    overwrite: bool = False              # top-1 `acc[idx] = c` over a base: routed rows replaced

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


STOP = object()   # a dataflow rule's answer: no role, and try no further rule


def as_contrib(node: fx.Node, role) -> Contrib | None:
    """What expert e adds, if ``node`` (with ``role``) is an expert output (weighted or not)."""
    if isinstance(role, Contrib):
        return role
    if isinstance(role, RowFn):
        return Contrib(role.rows, node, None)
    return None
