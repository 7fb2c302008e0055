"""ep_markers: expert-parallel weights that no rewrite replaced (finds only).

Graph before and after: unchanged. ``parallelize_experts`` makes every sharded Parameter read as
``moe_compile.ep_experts(local, E, group)``, a marker with the global [E, ...] shape that never
computes: only the expert-parallel lowering replaces it (by the local shard, inside dispatch /
combine). A marker still read in the graph to compile means the compiled code would raise on its
first call, from inside the graph, far from the cause:

* the MoE layer that reads it was refused (its record says why), or
* the Parameter is not an expert weight: ``parallelize_experts`` shards every 2-D Parameter with E
  rows beside a container's 3-D expert weights as a per-expert bias, so a router weight [E, H] kept
  in the experts' own module is sharded too and the router reads the marker.

``leftover_markers(gm)`` lists the live ones (nested graph modules, e.g. checkpoint bodies,
included): a marker whose value reaches the graph's output or an in-place write into a tensor
computed from a graph input (conservatively: through any op).
A marker read only by dead code (``tmp.add_(W.sum())`` into a temporary never read again) is left
to the compile's dead-code elimination. The backend raises ``error_message(...)`` at compile time.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from .normalize import module_path, source_name, where_in_user_code
from .region import is_ep_marker
from .token_paths import param_of


@dataclass(frozen=True)
class LeftoverMarker:
    parameter: str      # the user's attribute name ("router"), or the graph input's name
    module: str         # qualified module path ('' for the top module)
    where: str          # file:line of the first reader in the user's code, or ''
    num_experts: int
    ids_input: str = ""  # an integer graph input compared with expert numbers (ids routed in another graph)


def leftover_markers(gm: fx.GraphModule) -> tuple[LeftoverMarker, ...]:
    found: dict[tuple, LeftoverMarker] = {}
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for n in sub.graph.nodes:
            if n.op != "call_function" or not is_ep_marker(n) or not _live(n):
                continue
            module, parameter = _owner(n)
            found.setdefault((module, parameter), LeftoverMarker(parameter, module, _reader(n), n.args[1],
                                                                 _ids_input(sub.graph)))
    return tuple(found.values())


def _live(marker: fx.Node) -> bool:
    """The marker's value reaches the output, or a write into a tensor computed from a graph input
    or attribute (any op on the way may alias it: ``x.cpu()``, ``atleast_2d``); a write into a
    temporary taints everything that temporary is computed from, and their readers."""
    from .normalize import ancestors
    from .writes import writes_in_place, written

    todo, seen = list(marker.users), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output":
            return True
        if writes_in_place(n):
            target = written(n)
            targets = [target] if target is not None else [a for a in n.all_input_nodes if a not in seen]
            for a in ancestors(targets):
                if a.op in ("placeholder", "get_attr"):
                    return True
                todo += list(a.users)
        todo += list(n.users)
    return False


def _owner(marker: fx.Node) -> tuple[str, str]:
    """(module path, attribute name) of the sharded Parameter behind the marker."""
    local = marker.args[0]
    if isinstance(local, fx.Node):   # back through the property's own steps (to_local, the gradient division)
        local = param_of(local, set(local.graph.find_nodes(op="placeholder"))) or local
    name = source_name(local) if isinstance(local, fx.Node) else ""
    hit = re.search(r"^(.*?)\.?_parameters\['([^']+)'\]$", name)
    if hit:
        from .normalize import _clean_module_path

        return _clean_module_path(hit.group(1)), hit.group(2)
    # an input of a nested body (a checkpoint) has no Dynamo source: its name spells the path,
    # l_self_modules_experts_parameters_gate_up_
    name = getattr(local, "name", str(local))
    hit = re.search(r"^l_(?:self_)?(.*?)_?parameters_(.+?)_?$", name)
    if hit:
        return ".".join(p for p in hit.group(1).split("modules_") if p).replace("_.", ".").strip("_"), hit.group(2)
    return module_path(marker), name


def _ids_input(graph: fx.Graph) -> str:
    """The name of an integer tensor input of ``graph`` compared with a number (``ids == e``): expert ids
    computed in another graph (a graph break between the router and the experts), or ''."""
    from .normalize import canon, val

    for p in graph.find_nodes(op="placeholder"):
        v = val(p)
        if getattr(v, "dtype", None) not in (torch.int64, torch.int32):
            continue
        todo, seen = [p], set()
        while todo:   # through views and casts (ids.view(-1, K) == e)
            n = todo.pop()
            if canon(n) == "eq" and any(isinstance(a, int) and not isinstance(a, bool) for a in n.args[:2]):
                return source_name(p) or p.name
            if n not in seen and (n is p or canon(n) in ("view", "reshape", "flatten", "to", "long", "int")):
                seen.add(n)
                todo += list(n.users)
    return ""


def _reader(marker: fx.Node) -> str:
    """file:line of the nearest reader of the marker in the user's code (not parallel.py's property)."""
    todo, seen = list(marker.users), set()
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        at = where_in_user_code(n)
        if at and not at.startswith("parallel.py:"):
            return at
        todo += list(n.users)
    return ""


def error_message(leftovers: tuple[LeftoverMarker, ...], refused, cause: BaseException | None = None) -> str:
    """The compile-time error for ``leftovers``; ``refused``: the graph's records of regions not
    rewritten; ``cause``: the error that made the backend compile the graph unrewritten."""
    names = "; ".join(f"`{m.parameter}` of module '{m.module}' (E={m.num_experts})" + (f", read at {m.where}"
                                                                                      if m.where else "")
                      for m in leftovers)
    text = (f"ep_markers: these Parameters were sharded over an expert-parallel mesh by "
            f"moe_compile.parallelize_experts, but no expert-parallel rewrite replaced them, so the compiled "
            f"code would fail when it runs: {names}.")
    if cause is not None:
        text += (f" The rewritten graph failed to compile ({type(cause).__name__}: {cause}), so the graph was "
                 f"compiled unrewritten.")
    if refused:
        text += " Not rewritten in this graph: " + "; ".join(
            f"'{r.module}' at {r.where}: {r.reason} (fix: {r.fix})" for r in refused) + "."
    from moe_compile.ep_ddp import ddp_split_note

    text += ddp_split_note()
    ids = next((m.ids_input for m in leftovers if m.ids_input), "")
    units = _fsdp_unit_containers()
    if ids:
        text += (f" This graph holds no router: its expert ids are an input of the graph (`{ids}`), computed in "
                 "another one, which happens when a graph break splits the MoE layer between the router and the "
                 "experts (logged above with its fix; moe_compile.explain(model, *inputs) lists it). The "
                 "expert-parallel rewrite needs the router and the expert code in one graph: fix: remove the graph "
                 "break (move the code Dynamo cannot trace out of the MoE layer).")
    if units:
        text += (f" The expert containers {', '.join(units)} are FSDP units (fully_shard on them): FSDP2 runs a unit's "
                 "hooks outside Dynamo, a graph break at each call of such a container; keep the experts out of "
                 "FSDP (moe_compile.fully_shard_experts(model, mesh['dp']) at dp = 1, or "
                 "moe_compile.replicate_experts(model, mesh['dp']) over dp > 1, before fully_shard on the blocks "
                 "and the root with ignored_params=moe_compile.fsdp_ignored_params(module)).")
    if not any(m.where for m in leftovers):
        text += (" No code of yours reads them in this graph: Dynamo compiled the expert-parallel property on its "
                 "own, which happens when a graph break splits the MoE layer between the router and the experts "
                 "(the graph break is logged above with its fix, and moe_compile.explain(model, inputs) lists it).")
    text += (" If one of them is not an expert weight (a router weight [E, H] kept beside the 3-D expert weights): "
             "parallelize_experts shards every 2-D Parameter with E rows of an expert container as a per-expert "
             "bias; keep the router in a module of its own (e.g. a child nn.Linear(H, E)), as Hugging Face "
             "models do, and call parallelize_experts on a freshly built model. If a module listed is no expert "
             "container at all (a 3-D Parameter for something else, e.g. per-head weights [heads, ...]): "
             "parallelize_experts shards every module outside torch.nn with 3-D Parameters; name the experts "
             "instead, torch.distributed.tensor.parallel.parallelize_module(model, mesh, "
             "{'layers.*.mlp.experts': moe_compile.ExpertParallel()}) with your experts' path, on a "
             "freshly built model.")
    return text


def _fsdp_unit_containers() -> list[str]:
    """Paths of the expert containers sharded by parallelize_experts that are FSDP2 units."""
    try:
        from torch.distributed.fsdp import FSDPModule

        from moe_compile.ep_info import _ROOTS, _ep_containers
    except ImportError:
        return []
    return [f"'{path or type(module).__name__}'" for roots in list(_ROOTS.values()) for root in list(roots)
            for path, module, _, _ in _ep_containers(root) if isinstance(module, FSDPModule)]
