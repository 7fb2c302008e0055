"""What ``passes/unclaimed.py`` and ``passes/unrouted.py`` share: the record of MoE-looking code no
candidate region covers (``Unclaimed``) and the graph helpers both scans use (finds, never mutates)."""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .normalize import canon, val
from .token_paths import MATMULS

_GATHERS = {"getitem", "index_select", "embedding", "take", "gather", "F.embedding"}


@dataclasses.dataclass(frozen=True)
class Unclaimed:
    module: str
    where: str
    num_experts: int
    top_k: int
    detail: dict            # fills reasons.REASONS[code]
    code: str = "moe_unmatched"   # or "router_draws" (ids drawn without a top-k: OTHER_ROUTERS)


def _dims(n: fx.Node) -> tuple:
    v = val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _near(n: fx.Node, is_matmul, hops: int = 4) -> bool:
    """``n`` is the output of a matmul for which ``is_matmul(node)`` holds, through at most ``hops``
    single-input ops."""
    while isinstance(n, fx.Node) and hops >= 0:
        if is_matmul(n):
            return True
        ins = n.all_input_nodes
        if (canon(n) or "") in MATMULS or not ins:
            return False
        n = ins[0]
        hops -= 1
    return False


def _same_block(a: str, b: str) -> bool:
    """One dotted module path is the other or contains it."""
    if a == b:
        return True
    short, long_ = sorted((a, b), key=len)
    return short == "" or long_.startswith(short + ".")


def _claimed_by(module: str, claimed: str, evidence: str) -> bool:
    """A candidate found at ``module`` (its router and evidence; ``evidence``: the evidence's own
    module) is the layer of a region found at ``claimed``: the same block. At the compiled root ("")
    only where the evidence is in the region's block (a layer whose router sits on the root and its
    experts in a child): the root contains every module, so a region anywhere would hide a layer
    whose expert compute is on the root itself."""
    return _same_block(module, claimed) and (module != "" or _same_block(evidence, claimed)
                                             and (evidence != "" or claimed == ""))
