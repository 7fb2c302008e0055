"""Which modules ``parallelize_experts`` (moe_compile/parallel.py) shards: expert containers (modules
whose 3-D Parameters are stacked per expert, [E, ...]), found before anything is sharded, and the ties
that would make sharding them wrong (re-exported by moe_compile.parallel)."""
from __future__ import annotations

import torch.nn as nn

from moe_compile.ep_info import ep_info


def _is_builtin(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.nn.")


def expert_parameters(module: nn.Module) -> tuple[int, tuple[str, ...]] | None:
    """(E, names of the per-expert Parameters) if ``module`` is an expert container, else None."""
    if _is_builtin(module) or ep_info(module) is not None:
        return None
    params = dict(module.named_parameters(recurse=False))
    stacked = {n: p for n, p in params.items() if p.dim() == 3}
    if not stacked:
        return None
    rows = {p.shape[0] for p in stacked.values()}
    if len(rows) != 1:
        shapes = {n: tuple(p.shape) for n, p in stacked.items()}
        raise ValueError(f"parallelize_experts: {type(module).__name__} has 3-D parameters with different "
                         f"dim 0 {shapes}; expert weights must be stacked [E, ...] with one E")
    (e,) = rows
    return e, tuple(n for n, p in params.items() if p.dim() in (2, 3) and p.shape[0] == e)


def _module_list_experts(name: str, module: nn.Module) -> bool:
    """An nn.ModuleList of identical expert modules that still own their parameters."""
    if not isinstance(module, nn.ModuleList) or len(module) < 2 or "expert" not in name.rsplit(".", 1)[-1].lower():
        return False
    kinds = {type(m) for m in module}
    return len(kinds) == 1 and all(any(True for _ in m.parameters()) for m in module)


def find_expert_containers(model: nn.Module) -> list[tuple[str, nn.Module, int, tuple[str, ...]]]:
    """[(path, module, E, names)] for every expert container; raises for ModuleList experts."""
    found = []
    for name, module in model.named_modules():
        if _module_list_experts(name, module):
            raise ValueError(
                f"parallelize_experts: '{name}' holds {len(module)} experts as an nn.ModuleList of "
                f"{type(module[0]).__name__}; expert parallelism shards stacked 3-D expert weights. Convert it "
                f"first: parent.{name.rsplit('.', 1)[-1]} = moe_compile.stack_experts(parent.{name.rsplit('.', 1)[-1]}) "
                f"(its state_dict keys change: see stack_experts)")
        hit = expert_parameters(module)
        if hit is not None:
            found.append((name, module, *hit))
    return found


def _check_not_tied(model: nn.Module, found) -> None:
    """Raise if a Parameter to be sharded is also held by a module other than an expert container: sharding
    cuts the Parameter object itself to this rank's rows, which that module would then read."""
    sharded = {id(m._parameters[n]): f"{path or '<root>'}.{n}" for path, m, _, names in found for n in names}
    shards = {id(m): set(names) for _, m, _, names in found}   # container -> the names it shards
    for path, m in model.named_modules(remove_duplicate=False):
        for n, p in m._parameters.items():
            if p is not None and id(p) in sharded and n not in shards.get(id(m), ()):
                raise ValueError(f"parallelize_experts: the expert Parameter {sharded[id(p)]} is also "
                                 f"{path or '<root>'}.{n}, which is not sharded with it (outside an expert container, "
                                 f"or a second name in one); sharding keeps only this rank's rows in it, which that "
                                 f"name would read. Untie it (give the other module its own copy) before "
                                 f"parallelize_experts; nothing was sharded")
