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

The class-level wrapper only registers the conversion as the optimizer's own hooks at its first state_dict /
load_state_dict call (the user's hooks then see the DTensor form on both sides: review helper-100), not at its
first step: an optimizer may load state before it, create its state in its constructor (Adagrad) or get its
experts by ``add_param_group`` later (review helper-99). ZeroRedundancyOptimizer and LBFGS over shards raise. A
deep copy of an optimizer loses the shards' marking (``Parameter.__deepcopy__`` drops it): checkpoint the original.
Parameters that are DTensors already (``fsdp_ignored_params``' views, FSDP's) are left alone. A per-rank
``torch.save(optimizer.state_dict())`` file holds those DTensors: load it with ``torch.distributed.tensor``
imported, or save through torch.distributed.checkpoint.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch.distributed.tensor import DTensor, Shard

from .ep_info import EPInfo, _global_view, ep_info

_installed = False


def install() -> None:
    """Once per process: wrap ``Optimizer.state_dict`` / ``load_state_dict`` (subclasses inherit them) so that
    each optimizer holding expert shards gets the conversion as hooks of its own, at its first call of either:
    torch then runs them in order with the user's (``_ensure_hooks``)."""
    global _installed
    if _installed:
        return
    cls = torch.optim.Optimizer
    torch_state_dict, torch_load_state_dict = cls.state_dict, cls.load_state_dict

    @functools.wraps(torch_state_dict)
    def _state_dict(self):
        _ensure_hooks(self)
        return torch_state_dict(self)

    @functools.wraps(torch_load_state_dict)
    def _load_state_dict(self, state_dict):   # torch.distributed.checkpoint passes it by name
        _ensure_hooks(self)
        return torch_load_state_dict(self, state_dict)

    cls.state_dict = torch._disable_dynamo(_state_dict)   # as torch's own are
    cls.load_state_dict = torch._disable_dynamo(_load_state_dict)
    _installed = True


_HOOKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def _ensure_hooks(optimizer) -> None:
    """The conversion as the optimizer's own hooks, once it holds expert shards: the state_dict post-hook first
    (the user's post-hooks see the DTensors it returns), the load_state_dict pre-hook last (the user's pre-hooks
    see what the caller passed). Optimizers whose state is not per Parameter raise."""
    if optimizer in _HOOKED or not _holds_shards(optimizer):
        return
    name = type(optimizer).__name__
    if name in ("ZeroRedundancyOptimizer", "LBFGS"):
        raise NotImplementedError(
            f"moe_compile: {name} over expert-parallel shards cannot be checkpointed: "
            + ("it keeps its state in an inner optimizer it fills before the conversion could run"
               if name == "ZeroRedundancyOptimizer" else "it keeps one flat state over every Parameter, this rank's "
               "expert rows inside") + "; use a per-Parameter optimizer (AdamW, SGD, Adagrad, Adafactor, ...)")
    optimizer.register_state_dict_post_hook(_as_global, prepend=True)
    optimizer.register_load_state_dict_pre_hook(_as_local)
    _HOOKED.add(optimizer)


def _holds_shards(optimizer) -> bool:
    return any(_shard_info(p) is not None for group in optimizer.param_groups for p in group["params"])


def _shard_info(p) -> EPInfo | None:
    """The EPInfo of a Parameter holding this rank's expert rows as a plain tensor, else None."""
    info = ep_info(p)
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
            entry = state_dict["state"][key]
            if isinstance(entry, dict):
                state_dict["state"][key] = {k: _global(v, p, info, optimizer, k) for k, v in entry.items()}
    return state_dict


def _global(v, p, info: EPInfo, optimizer, name: str):
    if isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.dim() for t in v) or \
            isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() and not (
                v.dim() == p.dim() and v.shape[0] == p.shape[0]):
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else f"(a list of {len(v)})"
        raise ValueError(f"moe_compile: {type(optimizer).__name__}'s state '{name}' {shape} of an expert-parallel "
                         f"Parameter {tuple(p.shape)} (this rank's {info.experts_per_rank} of {info.num_experts} "
                         "experts) is not one row per expert (a statistic over this rank's experts together), so no "
                         "checkpoint can say which experts it covers; use an optimizer whose state has the "
                         "Parameter's rows (AdamW, SGD, Adagrad, RMSprop), or 3-D expert weights for Adafactor")
    if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim():
        return _global_view(v, info)
    return v


def _as_local(optimizer, state_dict):
    state = dict(state_dict["state"])
    for key, p in _params_by_key(optimizer, state_dict).items():
        info = _shard_info(p)
        if info is not None and isinstance(state.get(key), dict):
            state[key] = {k: _local(v, p, info, k) for k, v in state[key].items()}
    return {**state_dict, "state": state}


def _local(v, p, info: EPInfo, name: str):
    """This rank's rows of a global state tensor (a DTensor, or a plain one of the global shape)."""
    rows = info.expert_range
    if isinstance(v, DTensor):
        if v.shape[0] != info.num_experts:
            raise ValueError(f"moe_compile: optimizer state '{name}' {tuple(v.shape)} loaded for an expert-parallel "
                             f"Parameter of {info.num_experts} experts: a checkpoint of another model")
        if v.device_mesh == info.mesh and tuple(v.placements) == (Shard(0),):
            return v.to_local()
        v = v.full_tensor()
    if isinstance(v, torch.Tensor) and v.dim() == p.dim() and v.shape[0] == info.num_experts:
        return v[rows.start:rows.stop].clone()   # not a view: it would keep the whole [E, ...] storage
    # neither every expert's rows nor this rank's: another model's (was a raw size error at the step: review
    # helper-121); one of exactly this rank's row count stays ambiguous and is taken as this rank's rows
    if isinstance(v, torch.Tensor) and v.dim() == p.dim() and v.shape[0] != p.shape[0]:
        raise ValueError(f"moe_compile: optimizer state '{name}' {tuple(v.shape)} loaded for an expert-parallel "
                         f"Parameter of {info.num_experts} experts ({tuple(p.shape)} on this rank): a checkpoint "
                         "of another model")
    return v
