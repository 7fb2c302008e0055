"""token_paths: which Parameters a router reads, and which values carry the tokens past it (finds only).

Graph before and after: unchanged. An expert computes on the token: its weight meets the token's
hidden state. Code that only resembles routing does not:

* retrieval (a kNN vote over a Parameter table, a memory layer, a product-key memory): values
  gathered by the top-k ids are averaged with weights from the scores, and nothing but the
  routing meets them;
* a classifier's own weight reused after its argmax (a class activation map ``fc.weight[c]``, the
  rows a prediction selects fed back through the same Linear): the "experts" are the router.

``graph_params(gm, example_inputs)``
    the placeholders and get_attrs that hold nn.Parameters (Dynamo lifts them to graph inputs).
``param_of(n, params)``
    the Parameter behind ``n`` through views, casts and indexing, else None.
``gates(router, params)``
    the matmul-class nodes the router's scores come from (one with a Parameter operand: the gate
    linear, ``q @ keys.T``), walked back from the scores through the ops between; the hidden
    state a gate reads is not walked.
``router_params(router, params)``
    the Parameter of the router's gate when it has exactly one (a router that reads several
    Linears, e.g. each expert's own, scores experts, as in autonomy-of-experts routing: none).
``token_values(graph, params)``
    the values computed from the graph's tensor inputs (activations, not Parameters or buffers)
    by a path through no router and no router's scores (nor what they are scaled, cast or detached
    from; a projection that feeds both the scores and the experts still carries the tokens): what
    carries the tokens themselves.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .expert_ids import routers
from .normalize import canon, source_name, val

MATMULS = {"linear", "matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum", "_grouped_mm", "grouped_mm",
           "transformers::grouped_mm_fallback", "moe_compile::grouped_mm", "moe_compile::grouped_mm_list",
           "moe_compile::grouped_mm_list_cat", "moe_compile::grouped_mm_cat"}
# ops that keep a parameter a parameter (views, casts, per-expert indexing)
PARAM_VIEWS = {"view", "reshape", "transpose", "permute", "t", "contiguous", "to", "float", "half", "bfloat16",
               "type_as", "getitem", "index_select", "unflatten", "flatten", "expand", "chunk", "split",
               "narrow", "squeeze", "unsqueeze", "mT", "moe_compile::ep_experts", "to_local"}
_GATE_WALK = 32   # nodes walked back from a router's scores to its gates (a softmax, a bias, a norm between)


def graph_params(gm: fx.GraphModule, example_inputs) -> set[fx.Node]:
    """Placeholders and get_attrs that hold nn.Parameters (Dynamo lifts parameters to inputs)."""
    out = set()
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(phs):
        real = example_inputs[i] if example_inputs is not None and i < len(example_inputs) else None
        if isinstance(real, torch.nn.Parameter) or "_parameters" in source_name(n):
            out.add(n)
    for n in gm.graph.find_nodes(op="get_attr"):
        try:
            if isinstance(getattr(gm, n.target), torch.nn.Parameter):
                out.add(n)
        except AttributeError:
            pass
    return out


def param_of(n, params: set, depth: int = 8) -> fx.Node | None:
    """The parameter node behind ``n`` (through views, casts and indexing, as far back as they go:
    ``W[e]`` of a ``W`` computed from parameters is ``W``; an expert-parallel marker's local shard,
    through the gradient division its property applies), else None."""
    while isinstance(n, fx.Node) and depth > 0:
        if (canon(n) or "") in PARAM_VIEWS and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        elif n.target is getattr(torch.ops.higher_order, "autograd_function_apply", None):
            ins = [a for a in n.all_input_nodes if a.op != "get_attr"]
            if len(ins) != 1:
                break
            n = ins[0]
        else:
            break
        depth -= 1
    return n if isinstance(n, fx.Node) and n in params else None


def ep_experts_of(n, depth: int = 8) -> int | None:
    """E of the expert-parallel marker on ``n``'s way back to its parameter (the parameter holds
    only this rank's E / ep experts), else None."""
    while isinstance(n, fx.Node) and depth > 0 and (canon(n) or "") in PARAM_VIEWS \
            and n.args and isinstance(n.args[0], fx.Node):
        if canon(n) == "moe_compile::ep_experts":
            return n.args[1] if len(n.args) > 1 and isinstance(n.args[1], int) else None
        n = n.args[0]
        depth -= 1
    return None


def gates(router: fx.Node, params: set) -> list[fx.Node]:
    scores = router.args[0] if router.args and isinstance(router.args[0], fx.Node) else None
    found, todo, seen = [], [scores] if scores is not None else [], set()
    while todo and len(seen) < _GATE_WALK:
        n = todo.pop()
        if n in seen or n.op != "call_function" and n.op != "call_method":
            continue
        seen.add(n)
        if (canon(n) or "") in MATMULS:
            if any(param_of(a, params) is not None for a in n.all_input_nodes):
                found.append(n)
            continue   # the hidden state a matmul reads is the token's, not the router's
        todo += n.all_input_nodes
    return found


def router_params(router: fx.Node, params: set) -> set[fx.Node]:
    found = gates(router, params)
    if len(found) != 1:
        return set()
    return {p for a in found[0].all_input_nodes if (p := param_of(a, params)) is not None}


# one tensor in, the same scores out (scaled, cast, detached, normalised): a top-k over ``sc / sqrt(d)``
# or ``sc.detach()`` routes by ``sc``
_SAME_SCORES = {"div", "truediv", "mul", "add", "sub", "rsub", "neg", "pow", "square", "abs", "relu", "clamp",
                "clamp_min", "clamp_max", "masked_fill", "where", "detach", "float", "to", "type_as", "contiguous",
                "clone", "view", "reshape", "flatten", "softmax", "log_softmax", "sigmoid", "exp", "log", "tanh",
                "normalize", "bfloat16", "half", "double"}


def _scores(router: fx.Node, params: set) -> list[fx.Node]:
    """The scores a router reads, and what they are computed from by ``_SAME_SCORES`` ops whose other
    operand carries no token (a constant, a Parameter, noise drawn like the scores: ``sc / sqrt(d)``,
    ``sc + b``, ``sc + randn_like(sc) * s``); not through indexing (``proj[:, :E]`` is routing, while
    ``proj`` may carry the tokens too)."""
    out, n = [], router.args[0] if router.args else None
    while isinstance(n, fx.Node) and len(out) < _GATE_WALK:
        out.append(n)
        if (canon(n) or "") not in _SAME_SCORES:
            break
        ins = n.all_input_nodes
        nxt = [a for a in ins if all(_no_tokens(o, a, params) for o in ins if o is not a)]
        if not nxt:
            break
        n = nxt[0]
    return out


def _no_tokens(n: fx.Node, stop: fx.Node, params: set) -> bool:
    """``n`` is computed from no activation input except through ``stop``."""
    todo, seen = [n], set()
    while todo and len(seen) < _GATE_WALK:
        m = todo.pop()
        if m in seen or m is stop:
            continue
        seen.add(m)
        if _activation(m, params):
            return False
        todo += m.all_input_nodes
    return not todo


def _activation(n: fx.Node, params: set) -> bool:
    """A graph input that carries data (not a Parameter, a buffer or a dynamic size)."""
    return n.op == "placeholder" and n not in params and "_buffers" not in source_name(n) \
        and isinstance(val(n), torch.Tensor)


def token_values(graph: fx.Graph, params: set) -> set[fx.Node]:
    blocked = set()
    for router, *_ in routers(graph):
        blocked.add(router)
        blocked.update(_scores(router, params))   # the scores: weights taken from them are routing too
    todo = [n for n in graph.nodes if _activation(n, params)]
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in seen or n in blocked:
            continue
        seen.add(n)
        todo += n.users
    return seen


def downstream(starts, limit: int = 256) -> set[fx.Node]:
    """``starts`` and what is computed from them (at most ``limit`` nodes)."""
    return _closure(starts, lambda n: n.users, limit)


def upstream(starts, limit: int = 256) -> set[fx.Node]:
    """``starts`` and what they are computed from (at most ``limit`` nodes)."""
    return _closure(starts, lambda n: n.all_input_nodes, limit)


def _closure(starts, step, limit: int) -> set[fx.Node]:
    seen, stack = set(), list(starts)
    while stack and len(seen) < limit:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(step(n))
    return seen
