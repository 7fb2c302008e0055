"""Optimizer state of expert-parallel shards in checkpoints (torch.distributed.checkpoint's
``get_state_dict`` / ``set_state_dict``, ``optimizer.state_dict()`` / ``load_state_dict``).

``parallelize_experts`` leaves each rank's expert rows in the user's Parameter objects (plain tensors,
[E / ep, ...]), under the unsharded model's names: the model's ``state_dict`` hooks show them as
``Shard(0)`` DTensors of the global [E, ...] shape. An optimizer's state for such a Parameter is a
plain tensor of this rank's rows; torch's checkpointing takes a plain tensor for one that is the same
on every rank and keeps one rank's copy: a resume gave every rank the other rank's Adam moments, a
load into the unsharded model failed on the shape (review helper-98). So ``install`` (called by
``parallelize_experts``, once per process) wraps ``torch.optim.Optimizer.state_dict`` and
``load_state_dict``; for an optimizer holding such Parameters (any other is left exactly as torch has it):

    state_dict()       each state tensor of per-expert rows ([E / ep, ...], the Parameter's number of dims:
                       Adam's moments, Adafactor's factored row / column statistics) -> the Shard(0) DTensor
                       of the global tensor over the ep mesh (a view: loading into it writes the optimizer's
                       state); any other non-scalar state (a sum over this rank's experts) raises: no
                       checkpoint can say which experts it covers
    load_state_dict()  a DTensor -> this rank's rows (``to_local`` of Shard(0) over that mesh, else rows of the
                       full tensor); a plain tensor of the global shape -> a copy of this rank's rows

A class-level wrapper, not per-optimizer hooks: an optimizer may load state before its first step, create its
state in its constructor (Adagrad) or get its experts by ``add_param_group`` later (review helper-99).
Parameters that are DTensors already (``fsdp_ignored_params``' views, FSDP's) are left alone. A per-rank
``torch.save(optimizer.state_dict())`` file holds those DTensors: load it with ``torch.distributed.tensor``
imported, or save through torch.distributed.checkpoint.
"""
from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor, Shard

from .ep_info import EPInfo, _global_view

_installed = False


def install() -> None:
    """Once per process: wrap ``Optimizer.state_dict`` / ``load_state_dict`` (subclasses inherit them)."""
    global _installed
    if _installed:
        return
    cls = torch.optim.Optimizer
    torch_state_dict, torch_load_state_dict = cls.state_dict, cls.load_state_dict

    @functools.wraps(torch_state_dict)
    def _state_dict(self):
        out = torch_state_dict(self)
        return _as_global(self, out) if _holds_shards(self) else out

    @functools.wraps(torch_load_state_dict)
    def _load_state_dict(self, state_dict):   # torch.distributed.checkpoint passes it by name
        return torch_load_state_dict(self, _as_local(self, state_dict) if _holds_shards(self) else state_dict)

    cls.state_dict = torch._disable_dynamo(_state_dict)   # as torch's own are
    cls.load_state_dict = torch._disable_dynamo(_load_state_dict)
    _installed = True


def _holds_shards(optimizer) -> bool:
    return any(_shard_info(p) is not None for group in optimizer.param_groups for p in group["params"])


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
            state_dict["state"][key] = {k: _global(v, p, info, optimizer, k) for k, v in state_dict["state"][key].items()}
    return state_dict


def _global(v, p, info: EPInfo, optimizer, name: str):
    if not isinstance(v, torch.Tensor) or isinstance(v, DTensor) or v.dim() == 0:
        return v
    if v.dim() == p.dim() and v.shape[0] == p.shape[0]:
        return _global_view(v, info)
    raise ValueError(f"moe_compile: {type(optimizer).__name__}'s state '{name}' {tuple(v.shape)} of an expert-parallel "
                     f"Parameter {tuple(p.shape)} (this rank's {info.experts_per_rank} of {info.num_experts} experts) "
                     "is not one row per expert (a statistic over this rank's experts together), so no checkpoint "
                     "can say which experts it covers; use an optimizer whose state has the Parameter's rows (Adam, "
                     "SGD, Adagrad, RMSprop), or give the expert weights 3-D shapes [E, N, K]")


def _as_local(optimizer, state_dict):
    state = dict(state_dict["state"])
    for key, p in _params_by_key(optimizer, state_dict).items():
        info = _shard_info(p)
        if info is not None and key in state:
            state[key] = {k: _local(v, p, info) for k, v in state[key].items()}
    return {**state_dict, "state": state}


def _local(v, p, info: EPInfo):
    """This rank's rows of a global state tensor (a DTensor, or a plain one of the global shape)."""
    rows = info.expert_range
    if isinstance(v, DTensor):
        if v.device_mesh == info.mesh and tuple(v.placements) == (Shard(0),):
            return v.to_local()
        v = v.full_tensor()
    if isinstance(v, torch.Tensor) and v.dim() == p.dim() and v.shape[0] == info.num_experts:
        return v[rows.start:rows.stop].clone()   # not a view: it would keep the whole [E, ...] storage
    return v
