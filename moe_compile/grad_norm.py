"""Gradient clipping for a model whose experts ``parallelize_experts`` sharded (re-exported as
``moe_compile.parallel.clip_grad_norm_``)."""
from __future__ import annotations

import torch
import torch.nn as nn


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model with experts sharded by ``parallelize_experts``
    (and FSDP2): the gradients of one mesh cannot be stacked with another's, and each rank's expert
    shards hold different experts. The total norm combines, per mesh, the norm of the dense
    gradients and of the expert shards (summed over the expert-parallel ranks); every gradient is
    then scaled by one coefficient. Returns the total norm (a plain tensor, on the device; no host
    sync)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from .ep_info import EPInfo

    if not isinstance(model, nn.Module):
        raise TypeError(f"moe_compile.parallel.clip_grad_norm_ takes the model (it finds the expert shards from the "
                        f"modules), got {type(model).__name__}: call clip_grad_norm_(model, max_norm), not "
                        "clip_grad_norm_(model.parameters(), max_norm)")
    norm_type = float(norm_type)   # "inf" too, as torch's clip_grad_norm_ takes it

    groups: dict = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        info = getattr(_owner(model, name), "_moe_ep_info", None)
        # a Parameter the container holds beside its expert shards is the same on every ep rank: counted once
        sharded = isinstance(info, EPInfo) and name.rpartition(".")[2] in info.names
        key = (getattr(p.grad, "device_mesh", None), info.group_name if sharded else None)
        groups.setdefault(key, []).append(p)
    if not groups:
        return torch.zeros(())
    parts = []
    for (mesh, ep_group), params in groups.items():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm   # over the grads' own mesh
        if ep_group is not None and not _spans(mesh, ep_group):  # ep ranks hold other experts: combine
            group = dist.distributed_c10d._resolve_process_group(ep_group)
            if norm_type == float("inf"):
                dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
            else:
                norm = norm ** norm_type
                dist.all_reduce(norm, group=group)
                norm = norm ** (1.0 / norm_type)
        parts.append(norm)
    total = torch.nn.utils.get_total_norm(parts, norm_type)
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _spans(mesh, group_name: str) -> bool:
    """Whether DTensors on ``mesh`` are sharded over the process group ``group_name`` (their norm's
    full_tensor() then already sums its ranks)."""
    return mesh is not None and group_name in {mesh.get_group(d).group_name for d in range(mesh.ndim)}


def _owner(model: nn.Module, name: str) -> nn.Module:
    path = name.rpartition(".")[0]
    return model.get_submodule(path) if path else model
