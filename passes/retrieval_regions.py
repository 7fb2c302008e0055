"""find_retrieval_regions: experts that are rows of an embedding table gathered by routed ids (finds; never mutates).

Before (transformers' DogeCDMoE, product-key retrieval experts)::

    (sx, sy), (ix, iy) = router(x).view(2, T, -1).topk(n_keys)           # two halves of the keys
    ids = (ix[..., None] * n_keys + iy[..., None, :]).view(T, -1).gather(-1, topk(scores, K)[1])
    down, up = embedding(ids, W_down [E, H]), embedding(ids, W_up [E, H])  # one vector per expert
    h = act(matmul(down, x[:, :, None])) * w;  out = matmul(h[:, None], up)

Each expert is a single vector: the layer is already one gathered batched product with static shapes
and no host sync, and a grouped GEMM of width 1 per expert would only be slower. It is not rewritten,
and not silently: every such layer becomes a refused candidate with reason ``retrieval_experts``.
Rows that meet nothing of the token but the routing (``softmax(top-k scores) * values(ids)``:
a memory layer, a kNN read; ``passes/token_paths.py``) are retrieval, not experts, and not reported;
nor are the rows of a table the router's scores read (``topk(q @ K.weight.t())`` then ``K(ids)``: the
nearest memory keys), nor rows that meet only what is computed from those (``V(ids)`` weighted by attention
over the keys, Memorizing Transformers). Other tables of such a router still count (PEER-style vector
experts whose router also gathers its centroids as a bias).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .expert_ids import SORT_ROUTERS, scores_sort
from .normalize import _clean_module_path, canon, shape, val, where_in_user_code
from .region import Candidate, Finding
from .token_paths import downstream, graph_params, token_values, upstream

_INT_VIEWS = {"getitem", "gather", "view", "reshape", "add", "mul", "unsqueeze", "flatten", "to", "long", "int",
              "contiguous", "clone"}


def _from_topk(ids: fx.Node, limit: int = 32) -> fx.Node | None:
    """The topk/argmax (or sort of scores) whose indices ``ids`` is computed from through integer index
    arithmetic, else None."""
    seen, stack = set(), [ids]
    while stack and len(seen) < limit:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        op = canon(n)
        if op in ("topk", "argmax", "max") or op in SORT_ROUTERS and scores_sort(n) is not None:
            return n
        v = val(n)
        if op in _INT_VIEWS and not (isinstance(v, torch.Tensor) and v.is_floating_point()):
            stack.extend(n.all_input_nodes)
    return None


def _parent_module(n: fx.Node) -> str:
    """The module that owns the embedding table (the MoE layer), not the nn.Embedding itself."""
    stack = list((n.meta.get("nn_module_stack") or {}).values())
    return _clean_module_path(stack[-2][0]) if len(stack) >= 2 else ""


def find_retrieval_regions(gm: fx.GraphModule) -> list[Candidate]:
    found: dict[str, Candidate] = {}
    tokens = None
    gathers = [(n, _from_topk(n.args[0])) for n in gm.graph.nodes if canon(n) == "embedding" and len(n.args) >= 2
               and isinstance(n.args[0], fx.Node) and isinstance(n.args[1], fx.Node)]
    # rows of a table the router's scores read (nearest memory keys) and what is computed from them (attention
    # over the keys): not experts, and not a token the other gathered rows meet
    reads = {r: upstream(r.all_input_nodes, 64) for _, r in gathers if r is not None}   # what its scores read
    key_rows = [g for g, r in gathers if r is not None and g.args[1] in reads[r]]
    keys = downstream(key_rows)
    for n, router in gathers:
        users = [u for u in n.users if canon(u) in ("matmul", "bmm", "mul", "einsum")]
        if router is None or n in key_rows or not users:
            continue
        tokens = token_values(gm.graph, graph_params(gm, None)) if tokens is None else tokens
        if not any(a is not n and a in tokens and a not in keys for u in users for a in u.all_input_nodes):
            continue   # rows that meet only the router's scores (a memory / kNN read) or the keys: not experts
        module = _parent_module(n)
        if module in found:
            continue
        s, ts = shape(n.args[0]), shape(n.args[1])
        where = where_in_user_code(n)
        finding = Finding.of("retrieval_experts", n, node=n.name)
        found[module] = Candidate(module, "retrieval/embedding", where, None, (finding,),
                                  ts[0] if ts else 0, s[-1] if s else 0)
    return list(found.values())
