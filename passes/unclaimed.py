"""unclaimed: code that looks like MoE but that no region covers, and graph breaks in MoE code (finds only).

The backend must never be silent about an MoE layer it did not rewrite. The finders
(``loop_regions``, ``grouped_regions``) report what they recognise, rewritten or refused; this
module finds the rest, from the graph and from Dynamo's own records:

``find_unclaimed(gm, example_inputs, candidates)``
    A *router* is the index output of ``topk`` / ``max(dim)`` / ``argmax``, or expert ids drawn another way
    (``multinomial``, ``randint``, ``ids % E``: never rewritten, a token may draw one expert twice). It looks like an MoE
    router when what it selects reaches *expert compute* of the same layer (module paths share the
    MoE block, never two elements of one ModuleList):

    stacked     a matmul-class op (linear, matmul, mm, bmm, einsum, grouped_mm) on a weight of
                3 or more dims whose first dim is the router's expert count (``W[E, ...]``, ``W[e]``,
                ``W[ids]``); the weight is a parameter or computed from parameters, with buffers
                and constants beside them (``W * 1.0``, ``W * mask``, ``flip``, ``cat``, ``W + A @ B``)
    selected    a matmul-class op on a 2-D parameter applied to rows picked by a per-expert
                selection of the ids (``ids == e``, ``one_hot``, ``where``/``nonzero``)
    gathered    a parameter's rows gathered by the routed ids (``W[ids]``, ``embedding(ids, W)``) that
                feed a matmul or a product directly
    weighted    the outputs of a stacked matmul multiplied by a tensor built from the ids (a dense
                routing matrix)
    listed      a matmul-class op of an nn.ModuleList element of the block (``experts.3.w1``: a digit in
                its module path below the router's block) on rows computed from the ids
                (``x[tok[:, e]]`` of expert-choice routing: a top-k over the tokens), or its output
                multiplied by a tensor built from the ids (``r[:, e, None] * experts[e](x)``: every
                expert on every token, weighted by a top-k routing matrix)

    Experts selected without a top-k router (``passes/unrouted.py``): an expert set (nn.ModuleList elements'
    matmuls, one key per digit of the module path; ``W[e]``; a ``bmm`` / ``einsum`` on stacked ``W``) whose
    inputs or outputs two or more experts' per-expert selections gate: ``ids == e`` (integer ids compared
    with several numbers: ``router_draws``, or ``ids_outside`` when the ids are a graph input: a checkpoint
    body) or column e of the block's gate scores (a matmul with a 2-D Parameter of the block writing
    [.., E], and what follows it short of another Parameter's matmul: ``moe_unmatched`` when it picks rows,
    else ``soft_moe`` / ``routing_matrix_form``); compared ids may number the experts otherwise, a score
    column must be the expert's index; or each token's weights ``W[ids]`` gathered by such ids.

    A router is *claimed* when a candidate region uses it (its ids come from the same top-k, or it
    feeds one that does), when its evidence lies inside a candidate region, or when a candidate
    (refused before it could be assembled) names the same module. Every unclaimed router is one
    ``Unclaimed`` finding: ``moe_unmatched``, ``router_draws`` (ids drawn without a top-k), ``ids_cast_narrow``
    (ids cast to a dtype that does not hold them) or ``second_expert_set`` (a claimed router's other experts).

``nested_regions(gm)``
    ``torch.compiler.nested_compile_region`` subgraphs (``invoke_subgraph``) whose body holds a
    router whose ids reach a matmul: the finders do not enter these bodies, so each is reported
    (code ``nested_region``), once per subgraph.

``escaping_routers(gm)``
    Routers whose ids leave the graph (reach its output): the graph ends inside MoE code.

``classify_break(frames, reason)``
    The reason code and fix of a graph break or skipped frame from its user stack (file, line, name,
    source line); whether that stack is MoE code at all is ``passes/moe_source.in_moe_code``.
"""
from __future__ import annotations

import math
import re

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .expert_ids import ID_VIEWS, OTHER_ROUTERS, router_kind, router_root, routers as _routers
from .id_range import holds_ids
from .listed_experts import listed, listed_source, past_common, stacked_layers_dropped
from .moe_source import (Frame, _enclosing_function, declares_experts_implementation, enclosing_class,  # noqa: F401
                         in_moe_code, node_frames, untraceable_in_loop)
from .normalize import (canon, common_module, module_path, source_name, user_name, val, where_in_block,
                        where_in_user_code)
from .token_paths import MATMULS, downstream, ep_experts_of, graph_params, param_of, router_params, token_values
from .unclaimed_base import (_GATHERS, Unclaimed, _claimed_by, _dims, _expert_choice, _near, _past_output,
                             _routed_matmul, _same_block, disabled_note, sliced_inputs)
from .unrouted import unrouted
from .writes import basic_index, written

# frozen quantised expert weights (int4 packed into int32, as GPTQ / AWQ store them); not int64 (index tables)
_QUANTISED = {torch.int8, torch.uint8, torch.int16, torch.int32,
              *(getattr(torch, f"float8_{k}") for k in ("e4m3fn", "e5m2") if hasattr(torch, f"float8_{k}"))}
_SELECTIONS = {"eq", "one_hot", "nonzero", "argwhere"}
_COMBINES = {f"{op}{u}" for op in ("index_add", "index_put", "index_copy", "scatter_add", "scatter") for u in ("", "_")}


def _token_rows(router: fx.Node):
    """The number of tokens a router routes: its scores' rows (every dim but the last), else None."""
    d = _dims(router.args[0]) if router.args and isinstance(router.args[0], fx.Node) else ()
    return math.prod(d[:-1]) if d and d[-1] else None


def _reach(starts, stop: set = frozenset()) -> set[fx.Node]:
    """Nodes computed from ``starts``, not entering ``stop``; an in-place op also taints the tensor it
    writes into."""
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n in seen or n.op == "output" or n in stop:
            continue
        seen.add(n)
        stack.extend(n.users)
        target = written(n)
        if target is not None:
            stack.append(target)
    return seen


def _weights(gm: fx.GraphModule, params: set) -> set[fx.Node]:
    """``params`` and what is computed from them alone, with buffers and constants beside them
    (``W * 1.0``, ``W.flip(0)``, ``cat`` / ``stack``, ``W * mask``, ``W + A @ B``, ``W / W.norm()``): the
    candidates for stacked expert weights [E, ...] (3+ dims, dim 0 = the router's E). Not for 2-D
    weights (a normalised prototype table gathered by top-k ids is retrieval, not MoE), and a buffer
    alone is not a weight (a KV cache or a retrieval database laid out [N, ...] is not experts) unless
    it holds quantised values (int8 / uint8 / int16 / int32 / float8: frozen quantised experts, dequantised in
    the forward)."""
    buffers = {n for n in gm.graph.nodes if n.op == "placeholder" and "_buffers" in source_name(n)}
    quantised = {n for n in buffers if isinstance(v := val(n), torch.Tensor) and v.dtype in _QUANTISED}
    out, beside = set(params) | quantised, buffers - quantised
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        ins = n.all_input_nodes
        if not ins:
            beside.add(n)        # a constant: torch.full(...), torch.ones(...)
        elif any(a in out for a in ins) and all(a in out or a in beside for a in ins):
            out.add(n)
        elif all(a in beside for a in ins):
            beside.add(n)        # computed from buffers and constants: a mask, a dequantised table
    return out


def _local(router_mod: str, other_mod: str) -> bool:
    """``other`` belongs to the router's MoE block: their common module is the router's module or
    its parent, and they are not two elements of one ModuleList."""
    rest_r, rest_o = past_common(router_mod, other_mod)
    if len(rest_r) > 1:
        return False
    return not any(rest and rest[0].isdigit() for rest in (rest_r, rest_o))


def _stacked(n: fx.Node, weights: set, e: int) -> fx.Node | None:
    """A matmul-class ``n`` on a weight [E, ...] (3+ dims, ``_weights``): the weight, else None."""
    if (canon(n) or "") not in MATMULS:
        return None
    for a in n.all_input_nodes:
        p = param_of(a, weights)
        if p is not None and len(_dims(p)) >= 3 and (ep_experts_of(a) or _dims(p)[0]) == e:
            return p
    return None


def _evidence(router: fx.Node, reach: set, params: set, weights: set, e: int, skip: set, order: dict, tokens: list
              ) -> list[tuple[str, fx.Node]]:
    """(kind, node) of the expert compute that the router's selection reaches, in its MoE block
    (``params``: the graph's Parameters; ``weights``: ``_weights``)."""
    rmod = module_path(router)
    # up to the writes that put rows back into a tensor of one row per token: a linear after the combine
    # (attention within clusters, then its output projection) is not a linear on the rows one expert's
    # selection picks; a write into a dispatch buffer [E, C, H] read per expert is not a combine (helper-77)
    tokens_n = _token_rows(router)
    selections = [n for n in reach if (canon(n) or "") in _SELECTIONS or (canon(n) == "where" and len(n.args) == 1)]
    selected = _reach(selections, {n for n in reach if canon(n) in _COMBINES
                                   and len(d := _dims(written(n) or n)) == 2 and statically_known_true(d[0] == tokens_n)})
    own = router_params(router, params)     # a classifier's weight reused after its argmax is not an expert
    # rows of a table the scores read, gathered by the ids (topk(q @ K.t()), then K(ids)): nearest memory keys;
    # what is computed from them (attention over the keys) is not a token an expert meets
    keys = downstream([n for n in reach if canon(n) in _GATHERS and any(param_of(a, params) in own
                                                                           for a in n.all_input_nodes)])
    found = []
    for n in sorted(reach, key=order.__getitem__):
        if n in skip or not _local(rmod, module_path(n)):
            continue
        op = canon(n) or ""
        if op in MATMULS:
            if _stacked(n, weights, e) is not None:
                found.append(("stacked", n))
                continue
            if n in selected and any(len(_dims(p)) == 2 and p not in own for a in n.all_input_nodes
                                     if (p := param_of(a, params)) is not None):
                found.append(("selected", n))
                continue
        if op in _GATHERS and n.args:
            srcs = [p for a in n.all_input_nodes if a not in reach and (p := param_of(a, params)) is not None
                    and (len(_dims(p)) >= 3 or len(_dims(p)) == 2 and p not in own)]
            users = [u for u in n.users if (canon(u) or "") in MATMULS | {"mul", "einsum"}]
            if srcs and users and not tokens:
                tokens.append(token_values(n.graph, params))
            # the gathered rows meet the token itself, not only the routing (a kNN / memory read)
            if srcs and any(a is not n and a in tokens[0] and a not in keys for u in users for a in u.all_input_nodes):
                found.append(("gathered", n))
                continue
        if op in ("mul", "einsum", "bmm", "matmul"):   # by a stacked matmul's output (<= 4 single-input ops on)
            if any(a not in reach and _near(a, lambda m: _stacked(m, weights, e) is not None)
                   for a in n.all_input_nodes):
                found.append(("weighted", n))
                continue
        if op in MATMULS and listed(rmod, n, params, own) or op == "mul" and any(
                a not in reach and listed_source(rmod, a, params, own) is not None for a in n.all_input_nodes):
            found.append(("listed", n))
    return stacked_layers_dropped(rmod, found, reach, params, own)


_DESCRIBE = {
    "stacked": "matmuls over stacked expert weights [E, ...]",
    "selected": "linears on the rows each expert's selection picks",
    "gathered": "expert weight rows gathered by the routed ids",
    "weighted": "expert outputs weighted by a routing tensor built from the ids",
    "listed": "the nn.ModuleList experts' linears, on rows or weights taken from the ids",
}


def find_unclaimed(gm: fx.GraphModule, example_inputs, candidates, disabled: tuple = (), routed=frozenset()) -> list:
    """Routers that look like MoE routers but that no candidate region claims (see the module doc)."""
    routers = list(_routers(gm.graph))
    params = graph_params(gm, example_inputs)
    weights = _weights(gm, params | sliced_inputs(gm, params))   # and stacked weights passed as arguments
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    tokens: list[set] = []   # token_values(gm.graph, params), computed when first needed
    claimed_roots, claimed_nodes, claimed_modules, combined, unassembled = set(), set(), [], [], []
    for c in candidates:
        region = getattr(c, "region", None)
        if region is None:
            unassembled.append(c.module)
        else:
            root = router_root(region.router.ids)
            if root is not None:
                claimed_roots.add(root)
            claimed_nodes |= set(region.nodes)
            comb = region.combine
            combined.extend([comb.output] if hasattr(comb, "output") else comb.mutations)
        if region is None or c.module:   # a region on the root claims by its nodes and router alone: the root
            claimed_modules.append(c.module)   # path is every node's in a function (fn(x, w1, w2): one layer per call)
    out = []
    after = _reach(combined)   # what reads a region's combined output: the next layer, not a second expert set
    for router, ids, e, k in routers:
        if router in claimed_roots:
            found = _second_expert_set(router, ids, e, k, params, weights, claimed_nodes, after, order, tokens)
            out.extend(u for u in found if not any(_claimed_by(u.detail["module"], m, u.module) for m in unassembled))
            continue
        reach = _reach(ids)
        if any(r in reach for r in claimed_roots):
            continue  # a sub-selection of a claimed router (e.g. group-limited top-k)
        chosen = _expert_choice(router, params)
        found = _evidence(router, reach, params, weights, chosen[0] if chosen else e, claimed_nodes, order, tokens)
        if canon(router) in OTHER_ROUTERS:   # drawn ids: only expert compute per expert counts (not an
            found = [(kd, n) for kd, n in found if kd in ("selected", "stacked", "listed")]   # embedding of samples)
        if not found:
            continue
        module = common_module([router] + [n for _, n in found])
        evidence = common_module([n for _, n in found])
        if any(_claimed_by(module, m, evidence) for m in claimed_modules) or any(
                u.module == module and u.code != "second_expert_set" for u in out):
            continue   # claimed, or already listed (two ids tensors of one layer, e.g. two hashes stacked)
        kinds = list(dict.fromkeys(kind for kind, _ in found))
        first = found[0][1]
        at = where_in_block(first, router) or "?"
        evidence = " and ".join(f"{_DESCRIBE[kind]} (`{user_name(next(n for kd, n in found if kd == kind))}`)"
                                for kind in kinds)
        e, how = chosen or (e, router_kind(router, k))
        detail = {"k": k, "e": e, "router": how, "router_at": where_in_user_code(router) or "?",
                  "evidence": evidence,
                  "disabled": disabled_note(disabled)}
        narrow = _narrowing_cast(router, reach, e)
        if narrow is not None:
            detail.update(dtype=str(val(narrow).dtype).removeprefix("torch."), node=where_in_user_code(narrow) or "?",
                          last=e - 1)
        code = "router_draws" if canon(router) in OTHER_ROUTERS else "ids_cast_narrow" if narrow else "moe_unmatched"
        out.append(Unclaimed(module, at, e, k, detail, code))
    return out + unrouted(gm, params, weights, claimed_nodes, claimed_modules, out, disabled, routed)


def _second_expert_set(router, ids, e, k, params, weights, claimed, after, order, tokens) -> list[Unclaimed]:
    """A router that a region uses, whose ids also reach expert matmuls that no region covers (``claimed``)
    short of what reads a region's combined output (``after``, except what also reads the routing itself:
    ``_past_output``; the search stays in the layer, so a deep model costs one pass over each layer): a
    second expert set on the same routing (``ys = [experts(x[order // K]) for experts in sets]``, each
    combined on its own; or the second run on the first one's output, same sort). The region takes one set; the
    other is compiled as written and listed here (``second_expert_set``), unless a candidate refused before
    its region was assembled names its module (listed already: a loop refused as ``rows_of_next_layer``
    beside the rewritten one)."""
    inner = _reach(ids, after)   # past the output only [E, ...] weights the routing feeds (_routed_matmul)
    found = [(kd, n) for kd, n in _evidence(router, inner | _past_output(inner, after, claimed), params, weights, e,
                                            claimed, order, tokens) if kd in ("stacked", "selected", "listed")
             and (n in inner or kd == "stacked" and _routed_matmul(n, inner))]
    if not found:
        return []
    first = found[0][1]
    detail = {"k": k, "e": e, "router": router_kind(router, k), "router_at": where_in_user_code(router) or "?",
              "node": user_name(first), "at": where_in_block(first, router) or "?",
              "module": common_module([router] + [n for _, n in found])}   # router and set: for _claimed_by
    return [Unclaimed(common_module([n for _, n in found]), detail["at"], e, k, detail, "second_expert_set")]


def _narrowing_cast(router: fx.Node, reach: set, e: int) -> fx.Node | None:
    """A cast of the router's ids (or a view of them) into a dtype that does not hold ids below ``e``
    (``ids.to(torch.uint8)`` with 300 experts), else None."""
    for n in sorted(reach, key=lambda n: n.name):
        src, v = (n.args[0] if n.args else None), val(n)
        if canon(n) in _ID_CASTS and isinstance(src, fx.Node) and isinstance(v, torch.Tensor) \
                and router_root(src) is router and not holds_ids(v.dtype, e):
            return n
    return None


_ID_CASTS = {"to", "type", "byte", "char", "short", "half", "bfloat16", "float"}


def escaping_routers(gm: fx.GraphModule) -> list[fx.Node]:
    """Top-k routers whose ids reach the graph's output through views, or as per-expert masks
    (``one_hot(ids)``, ``ids[..., None] == arange(E)``): the routing leaves the graph (drawn ids,
    ``OTHER_ROUTERS``, leave graphs in sampling code too: not evidence of MoE code)."""
    out_nodes = set(gm.graph.find_nodes(op="output"))
    found = []
    for router, ids, _e, _k in _routers(gm.graph):
        if canon(router) in OTHER_ROUTERS:
            continue
        stack, seen = list(ids), set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if any(u in out_nodes for u in n.users):
                found.append(router)
                break
            stack.extend(u for u in n.users if (canon(u) or "") in ID_VIEWS | {"bool"} or _unsqueezed(u)
                         or _expert_mask(u, n))
    return found


def _unsqueezed(n: fx.Node) -> bool:
    """``ids[..., None]``, ``ids[:, :, None]``, ``masks[:, e]``: a view (basic indexing of a tensor, no
    index tensor; not the items of a tuple such as topk's)."""
    return canon(n) == "getitem" and len(n.args) > 1 and isinstance(val(n.args[0]), torch.Tensor) and basic_index(n)


def _expert_mask(n: fx.Node, ids: fx.Node) -> bool:
    """``one_hot(ids)``, or ids compared with every expert number (``== arange(E)``, through views of it)
    or with several (``[ids == e for e in range(E)]``). Not one number (``pred == 1`` in a binary
    classifier, ``top == eos``), not another tensor of the data (labels): a metric or a decode step.
    A classifier's per-class masks of its argmax (``pred[:, None] == arange(C)``) are the same graph as
    Switch's per-expert masks, and count (never silent first)."""
    op = canon(n) or ""
    if op == "one_hot":
        return True
    if op != "eq":
        return False
    other = [a for a in n.args[:2] if a is not ids]
    if not other:
        return False
    if isinstance(other[0], int):
        numbers = {a for u in ids.users if canon(u) == "eq" for a in u.args[:2] if isinstance(a, int)}
        return len(numbers) >= 2
    m, hops = other[0], 0
    while isinstance(m, fx.Node) and hops < 4 and (canon(m) in ID_VIEWS | {"expand"} or _unsqueezed(m)):
        m, hops = m.args[0], hops + 1
    return isinstance(m, fx.Node) and canon(m) == "arange"


# ------------------------------------------------------------------------------------ graph breaks
_DISTRIBUTED_HOOKS = re.compile(r"torch[/\\]distributed[/\\]")
_PARAMETRIZE = re.compile(r"torch[/\\]nn[/\\]utils[/\\]parametrize\.py$")
_RANDOM_DRAW = re.compile(r"\b(rand|rand_like|bernoulli|random)\b\s*\(|\brandom\.random\b")


def classify_break(frames, reason: str) -> tuple[str, dict]:
    """(reason code, message detail) for a graph break whose innermost user frame is ``frames[-1]``."""
    f = list(frames)[-1] if frames else Frame("?", 0, "?")
    src = f.source
    low = f"{src} {reason}".lower()
    cls, _ = enclosing_class(f.filename, f.lineno)
    detail = {"at": f.at, "source": src or "?", "reason": " ".join(reason.split()) or "?", "cls": cls or "this class"}
    if "ddpoptimizer" in low:
        code = "break_ddp_buckets"
    elif any(_PARAMETRIZE.search(fr.filename) for fr in frames):
        code = "break_parametrization"
    elif "recompile limit exceeded" in low:
        code = "recompile_limit"
        limit = re.search(r"limit type: (\w+)", low)
        detail["limit"] = limit.group(1) if limit else "recompile_limit"
        detail["value"] = getattr(torch._dynamo.config, detail["limit"], "?")
    elif "module-level backwards hooks" in low:
        code = "break_module_backward_hook"
        user = [fr for fr in frames if not fr.filename.replace("\\", "/").endswith("torch/nn/modules/module.py")]
        if user:   # the call of the hooked module, not torch's hook set-up
            detail.update(at=user[-1].at, source=user[-1].source or "?")
    elif "unsupported functorch tracing attempt" in low:
        code = "break_func_transform"
    elif "expert_hit" in src:
        code = "break_expert_hit_hf" if declares_experts_implementation(f.filename, f.lineno) else "break_expert_hit"
    elif "split" in src and "tolist" in src:
        code = "break_split_sizes"
    elif "tolist" in src:
        code = "break_tolist"
    elif ".item()" in src and not src.startswith(("if ", "elif ", "while ")):   # a branch: the branch goes
        code = "break_item"
    elif "bincount" in src:
        code = "break_bincount"
    elif "step_unsupported" in low and src.startswith(("for ", "while ")):
        code = "break_in_expert_loop"
        inner = untraceable_in_loop(f.filename, f.lineno)
        detail["cause"] = (f"the body calls {inner}, which Dynamo cannot trace" if inner else
                           "e.g. a slice with tensor bounds `x[start[e]:end[e]]` reads the bounds on the host, as "
                           "`.item()` does")
    elif "data-dependent branching" in low or src.startswith(("if ", "elif ", "while ")) and (
            "data-dependent" in low or "generic_jump" in low or ".item()" in src):
        code = "break_random_branch" if _RANDOM_DRAW.search(src) else "break_data_dependent"
    elif "data-dependent" in low and any(map(_counts_by_bincount, frames)):   # not a branch: a size
        code = "break_bincount"
    elif "dynamic shape operator" in low or "dynamic_output_shape" in low or "nonzero" in low:
        code = "break_dynamic_shape"
    elif "data-dependent" in low or "guardondatadependentsymnode" in low:
        code = "break_data_dependent"
    else:
        code = "break_other"
    return code, detail


def _counts_by_bincount(f) -> bool:
    """The function holding the frame's line (one of a break's user frames) takes counts with
    ``bincount``: a guard on a data-dependent size below it is most likely on bincount's length
    (max(minlength, largest id + 1)), which reached an op that needs it static (an offsets length
    checked against E)."""
    whole = _enclosing_function(f.filename, f.lineno) if f.filename and f.lineno else None
    return whole is not None and "bincount(" in whole


def break_fix(code: str, detail: dict) -> str:
    """The fix of a ``break_*`` code, its template filled from the break's detail."""
    from . import reasons

    class _Missing(dict):
        def __missing__(self, key):
            return "?"

    return reasons.fix(code).format_map(_Missing(detail))


def graph_break(gm: fx.GraphModule, candidates) -> tuple[str, str, str, dict] | None:
    """(module, where, code, detail) of the graph break that ended ``gm`` (Dynamo's
    ``compile_subgraph_reason``) when it is in MoE code: its user stack is MoE code, or a router
    that no candidate claims sends its ids out of the graph. Else None."""
    why = getattr(gm, "compile_subgraph_reason", None)
    if why is None or not getattr(why, "graph_break", False):
        return None
    frames = [Frame(f.filename, f.lineno or 0, f.name, getattr(f, "line", "") or "")
              for f in (getattr(why, "user_stack", None) or [])]
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    if "DDPOptimizer" in str(getattr(why, "reason", "")):   # a cut after this graph's last op, at DDP's buckets
        frames = node_frames(calls[-1]) if calls and not candidates else []
    elif frames and _DISTRIBUTED_HOOKS.search(frames[-1].filename):
        return None  # FSDP2 / DTensor hooks split graphs at module boundaries by design; the next frame compiles
    claimed = {router_root(c.region.router.ids) for c in candidates if getattr(c, "region", None) is not None}
    escaping = [r for r in escaping_routers(gm) if r not in claimed]
    if not escaping and not in_moe_code(frames):
        return None
    code, detail = classify_break(frames, str(getattr(why, "reason", "") or ""))
    detail.update(what="graph break", effect="; Dynamo splits the graph there, so no MoE region can span it")
    module = module_path(escaping[0]) if escaping else (module_path(calls[-1]) if calls else "")
    return module, detail["at"], code, detail


def nested_regions(gm: fx.GraphModule) -> list[tuple[str, str, int, int]]:
    """(subgraph name, where it is called, E, top_k) per nested_compile_region subgraph holding MoE-like code."""
    out, seen = [], set()
    for n in gm.graph.nodes:
        sub_node = n.args[0] if canon(n) == "invoke_subgraph" and n.args else None
        if not isinstance(sub_node, fx.Node) or sub_node.op != "get_attr" or sub_node.target in seen:
            continue
        seen.add(sub_node.target)
        sub = getattr(gm, sub_node.target, None)
        if not isinstance(sub, fx.GraphModule):
            continue
        for router, ids, e, k in _routers(sub.graph):
            if any((canon(r) or "") in MATMULS for r in _reach(ids)):
                out.append((sub_node.target, where_in_user_code(n) or "?", e, k))
                break
    return out


def unclaimed_records(gm: fx.GraphModule, example_inputs, candidates, disabled: tuple = (), routed=frozenset()) -> list:
    """The refused ``RegionRecord``s of one graph for what no candidate covers: MoE-like routers
    (``moe_unmatched``) and the graph break that ended the graph in MoE code (``break_*``)."""
    from moe_compile.records import REFUSED, RegionRecord

    from . import reasons

    out = [RegionRecord(u.module, "unmatched", REFUSED, reasons.message(u.code, u.detail), (), u.where,
                        u.num_experts, u.top_k, code=u.code, fix=reasons.fix(u.code))
           for u in find_unclaimed(gm, example_inputs, candidates, disabled, routed)]
    for name, where, e, k in nested_regions(gm):
        detail = {"k": k, "e": e, "subgraph": name, "at": where}
        out.append(RegionRecord(name, "nested region", REFUSED, reasons.message("nested_region", detail), (), where,
                                e, k, code="nested_region", fix=reasons.fix("nested_region")))
    brk = graph_break(gm, candidates)
    if brk is not None:
        module, where, code, detail = brk
        out.append(RegionRecord(module, "graph break", REFUSED, reasons.message(code, detail), (), where, code=code,
                                fix=break_fix(code, detail), source=detail["source"]))
    return out
