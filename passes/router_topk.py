"""find_router_topks: the ``torch.topk`` calls that route the tokens of rewritten MoE regions.

Contract (finds and checks, never mutates)::

    logits = linear(x, W_router)                         (the walk stops at GEMMs and graph inputs;
                                                          it follows in-place writes: mask.scatter_)
    ... = topk(f(logits), k[, dim=-1])                   any number of them (DeepSeek-V3's group
    ids = ...                                            limit has three), float scores, last dim
    perm, inv, offs = moe_compile.route_permute(ids, E)  <- seed: the lowering emitted it
  -> TopkMatch(node=topk, scores, k, seed=route_permute) for each sorted topk (the default) whose
     outputs are only read by index (``[0]``, ``[1]``, ``.values``, ``.indices``);
     ``lowering/router_topk.py`` makes it ``moe_compile.router_topk(scores, k)``.

The walk stops at GEMMs, at the tokens a region gathers (``permute_rows``' input: the router is
computed from them) and at moe_compile ops (an earlier layer), so a topk of the user's before the
router is never reached. ``sorted=False`` calls stay torch.topk: their order is torch's own
(device-dependent, unspecified), and code that reads a position of it would see another order.

Why: torch.topk's CUDA kernel (a radix select per row, then a sort) took 61 us per Qwen3-30B-A3B
router call (8192 x 128 scores) on an H200, ~1.7% of the MoE block's GPU time; the op's Triton
kernel reads each row once. Only routers of rewritten regions are considered, so user code
outside MoE regions is never touched; a topk that does not qualify stays as it is (it is correct,
only slower), so nothing here is a refusal.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .normalize import arg, canon, is_inplace_method, val

# ops that end the walk back from the expert ids: the router's own GEMM, and anything before it
_STOP = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "einsum", "baddbmm"})
_WALK_LIMIT = 200   # nodes visited per region; a router is a few dozen ops


@dataclasses.dataclass(frozen=True)
class TopkMatch:
    node: fx.Node     # the topk call
    scores: fx.Node   # its input [..., E]
    k: int
    seed: fx.Node     # the route_permute whose expert ids it computes (which region it routes)


def _mutated_by(n: fx.Node) -> list[fx.Node]:
    """In-place method calls on n (``mask.scatter_(1, idx, 1)``): what they read flows into n."""
    return [u for u in n.users if is_inplace_method(u) and u.args and u.args[0] is n]


def _routers_of(ids: fx.Node, stops: set):
    """topk nodes among ids' ancestors (through in-place writes), back to the router GEMM, the
    tokens a region gathers, or an earlier moe_compile op: never into the code before the router."""
    seen, stack, found = set(), [ids], []
    while stack and len(seen) < _WALK_LIMIT:
        n = stack.pop()
        if n in seen or n in stops or n.op != "call_function" and n.op != "call_method":
            continue
        seen.add(n)
        op = canon(n) or ""
        if op in _STOP or op.startswith("moe_compile::"):
            continue
        if op == "topk":
            found.append(n)
        stack.extend(n.all_input_nodes)
        stack.extend(_mutated_by(n))
    return found


def _read_by_index(node: fx.Node) -> bool:
    """Every user takes one output: [0] / [1] / .values / .indices."""
    for u in node.users:
        if canon(u) == "getitem" and u.args[0] is node and u.args[1] in (0, 1):
            continue
        if canon(u) == "getattr" and u.args[0] is node and u.args[1] in ("values", "indices"):
            continue
        return False
    return True


def _match(n: fx.Node, seed: fx.Node) -> TopkMatch | None:
    scores, k = arg(n, 0, "input"), arg(n, 1, "k")
    s = val(scores)
    if not isinstance(scores, fx.Node) or not isinstance(s, torch.Tensor) or not s.is_floating_point() or s.dim() < 1:
        return None
    dim = arg(n, 2, "dim", -1)
    if not isinstance(k, int) or dim not in (-1, s.dim() - 1) or arg(n, 3, "largest", True) is not True:
        return None
    if n.kwargs.get("out") is not None or not isinstance(s.shape[-1], int) or not 1 <= k <= s.shape[-1]:
        return None
    if arg(n, 4, "sorted", True) is not True:  # its order is torch's own, unspecified: kept as written
        return None
    return TopkMatch(n, scores, k, seed) if _read_by_index(n) else None


def find_router_topks(gm: fx.GraphModule) -> list[TopkMatch]:
    found: dict[fx.Node, TopkMatch] = {}
    # the token rows each region gathers: the router is computed from them, what made them is not router
    stops = {n.args[0] for n in gm.graph.nodes if canon(n) == "moe_compile::permute_rows"}
    for node in gm.graph.nodes:
        if canon(node) != "moe_compile::route_permute" or not isinstance(node.args[0], fx.Node):
            continue
        for t in _routers_of(node.args[0], stops):
            m = t not in found and _match(t, node)
            if m:
                found[t] = m
    return list(found.values())
