"""Optimizer state of expert-parallel shards in checkpoints (torch.distributed.checkpoint's
``get_state_dict`` / ``set_state_dict``, ``optimizer.state_dict()`` / ``load_state_dict``).

``parallelize_experts`` leaves each rank's expert rows in the user's Parameter objects (plain tensors,
[E / ep, ...]), under the unsharded model's names: the model's ``state_dict`` hooks show them as
``Shard(0)`` DTensors of the global [E, ...] shape. An optimizer's state for such a Parameter is a
plain tensor of this rank's rows; torch's checkpointing takes a plain tensor for one that is the same
on every rank and keeps one rank's copy: a resume gave every rank the other rank's Adam moments, a
load into the unsharded model failed on the shape (review helper-98). So, for each optimizer that steps
such Parameters (found by a global optimizer step post-hook, installed by ``parallelize_experts``):

    state_dict()       each state tensor of this rank's rows -> the Shard(0) DTensor of the global
                       tensor over the ep mesh (a view: loading into it writes the optimizer's state)
    load_state_dict()  a DTensor -> this rank's rows (``to_local`` of Shard(0) over that mesh, else rows
                       of the full tensor); a plain tensor of the global shape -> this rank's rows

Parameters that are DTensors already (``fsdp_ignored_params``' views, FSDP's) are left alone.
"""
from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor, Shard

from .ep_info import EPInfo, _global_view

_SEEN: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_installed = False


def install() -> None:
    """Once per process: look at each optimizer after its first step (``register_optimizer_step_post_hook``)."""
    global _installed
    if not _installed:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_after_step)
        _installed = True


def _after_step(optimizer, args, kwargs) -> None:
    if optimizer in _SEEN:
        return
    _SEEN.add(optimizer)
    if any(_shard_info(p) is not None for group in optimizer.param_groups for p in group["params"]):
        optimizer.register_state_dict_post_hook(_as_global)
        optimizer.register_load_state_dict_pre_hook(_as_local)


def _shard_info(p) -> EPInfo | None:
    """The EPInfo of a Parameter holding this rank's expert rows as a plain tensor, else None."""
    info = getattr(p, "_moe_ep_info", None)
    if not isinstance(info, EPInfo) or isinstance(p, DTensor) or not p.dim() or p.shape[0] != info.experts_per_rank:
        return None
    return info


def _params_by_key(optimizer, state_dict) -> dict:
    """The Parameter of each key of ``state_dict["state"]``: its param groups list the keys (ints from
    ``state_dict()``, names from torch.distributed.checkpoint) in the optimizer's groups' order, as
    ``load_state_dict`` pairs them."""
    return {key: p for saved, group in zip(state_dict.get("param_groups", ()), optimizer.param_groups)
            for key, p in zip(saved["params"], group["params"])}


def _as_global(optimizer, state_dict):
    for key, p in _params_by_key(optimizer, state_dict).items():
        info = _shard_info(p)
        if info is not None and key in state_dict["state"]:
            state_dict["state"][key] = {k: _global_view(v, info) if _rows(v, p) else v
                                        for k, v in state_dict["state"][key].items()}
    return state_dict


def _as_local(optimizer, state_dict):
    state = dict(state_dict["state"])
    for key, p in _params_by_key(optimizer, state_dict).items():
        info = _shard_info(p)
        if info is not None and key in state:
            state[key] = {k: _local(v, p, info) for k, v in state[key].items()}
    return {**state_dict, "state": state}


def _rows(v, p) -> bool:
    return isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == p.shape


def _local(v, p, info: EPInfo):
    """This rank's rows of a global state tensor (a DTensor, or a plain one of the global shape)."""
    rows = info.expert_range
    if isinstance(v, DTensor):
        if v.device_mesh == info.mesh and tuple(v.placements) == (Shard(0),):
            return v.to_local()
        v = v.full_tensor()
    if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == info.num_experts and v.shape[1:] == p.shape[1:]:
        return v[rows.start:rows.stop]
    return v
