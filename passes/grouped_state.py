"""State of the all-pairs finder (``grouped_regions``): node roles and one candidate region per group.

Role kinds (``GRole.kind``), legend T tokens, K top-k, N = T*K routed pairs, E experts, H width::

    flat         expert ids [N] (ids.reshape(-1))          sort / sorted_ids / perm   sort(flat) and its parts
    tok          perm // K: the token of each sorted row   sentinel                   sorted_ids >= E (EP masks)
    counts/offs  rows per expert / their cumsum            onehot                     one_hot(ids, E)
    inv_alloc    empty_like(perm)                           inv / mut                  the inverse permutation
    rows         a row-valued tensor of the group           chunks                     chunk/split of rows
    unsq / bmm   batched: rows[:, :, None] / bmm(W[ids], .) sw                         w.reshape(-1)[perm]
    bias         b[sorted_ids] / b[flat]                    wsel                       W[flat] (per-pair weights)
    routing      zeros(T, E).scatter(1, ids, w) (+ views)   wview                      the weights multiplied in
    pair / pair3 rows back in (token, slot) order [N, H] / [T, K, H]
    out          the combined output
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .normalize import SYM_NUMBERS, arg, val
from .region import Finding

GMM_OPS = {"_grouped_mm", "grouped_mm", "transformers::grouped_mm_fallback", "moe_compile::grouped_mm"}
FLATTEN = {"reshape", "view", "flatten"}
FRESH = {"zeros_like", "zeros", "new_zeros", "empty_like", "empty", "new_empty"}
CASTS = {"to", "float", "long", "int", "type", "contiguous", "bfloat16", "half", "double"}
ROW_KINDS = ("rows", "chunks", "unsq", "bmm")
DONE = True   # a rule's answer: handled (roles set, or deliberately none); try no further rule


@dataclass(frozen=True)
class GRole:
    kind: str
    g: "Group | None" = None
    info: object = None


@dataclass(eq=False)
class Group:
    """One candidate region (mutable analysis state)."""
    family: str                # sorted | batched | dense
    key: fx.Node
    flat: fx.Node | None = None      # flat expert ids [N] (sorted, batched)
    ids: fx.Node | None = None       # [T, K] (or [T]) ids
    k: int | None = None
    e: int | None = None
    x: fx.Node | None = None
    offs: fx.Node | None = None
    steps: list = field(default_factory=list)
    slots: list = field(default_factory=list)
    step_of: dict = field(default_factory=dict)   # row node -> step index (-1: the input rows)
    nodes: set = field(default_factory=set)
    erase: list = field(default_factory=list)
    weights: fx.Node | None = None
    weighted_at: int | None = None                # step index the routing weights multiplied
    input_weights: fx.Node | None = None          # weights that scale the input rows ([T, E] dense)
    input_dtype: object = None                    # the dtype the input rows are cast to before that product
    end: int | None = None                        # step index of the rows that are combined
    output: fx.Node | None = None
    aliases: tuple = ()
    base: fx.Node | None = None                   # an out-of-place accumulation's tensor (not zeros)
    findings: list = field(default_factory=list)
    linears: int = 0
    clamps: list = field(default_factory=list)   # (node, bound) of sorted_ids.clamp(max=bound)
    clamped_counts: fx.Node | None = None        # the clamp the expert counts were taken after

    def note(self, code: str, node: fx.Node | None = None, /, **detail) -> bool:
        """Record why this group cannot be rewritten (the first finding is the reason); True."""
        if not self.findings:
            self.findings.append(Finding.of(code, node, **detail))
        return DONE


def as_int(x):
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def is_last_dim(dim, node) -> bool:
    v = val(node)
    return dim == -1 or (isinstance(v, torch.Tensor) and dim == v.dim() - 1)


def shared_ok(x) -> bool:
    """A non-row operand of a row-wise op: a constant, or a tensor that broadcasts along the last dim."""
    if not isinstance(x, fx.Node):
        return True
    v = val(x)
    if isinstance(v, SYM_NUMBERS):   # a symbolic number (dynamic=True)
        return True
    return isinstance(v, torch.Tensor) and (v.numel() == 1 or v.dim() <= 1)


def swaps_2d(n: fx.Node, op: str) -> bool:
    """``transpose(0, 1)`` / ``permute(1, 0)`` of a 2-D tensor (dims as ints, negative ones allowed)."""
    if op == "transpose":
        dims = (arg(n, 1, "dim0"), arg(n, 2, "dim1"))
    else:
        dims = tuple(n.args[1:]) if len(n.args) > 2 else arg(n, 1, "dims")
    if not isinstance(dims, (tuple, list)) or len(dims) != 2 or any(as_int(d) is None for d in dims):
        return False
    d0, d1 = dims[0] % 2, dims[1] % 2
    return d0 != d1 if op == "transpose" else (d0, d1) == (1, 0)
