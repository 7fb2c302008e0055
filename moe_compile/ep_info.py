"""What ``parallelize_experts`` (moe_compile/parallel.py) did to each expert container: ``EPInfo``,
read back with ``ep_info`` / ``ep_infos`` (re-exported by moe_compile.parallel), and the helpers that
read that state (shared by parallel.py and ep_fsdp.py)."""
from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

_MESHES: dict[str, DeviceMesh] = {}        # group_name -> the mesh it came from (for state_dict)
_ROOTS: dict[str, "weakref.WeakSet"] = {}  # group_name -> models given to parallelize_experts with it


@dataclasses.dataclass(frozen=True)
class EPInfo:
    """What ``parallelize_experts`` did to one expert container."""
    path: str                  # module path inside the model given to parallelize_experts ("" = itself)
    names: tuple[str, ...]     # original names of the sharded parameters
    num_experts: int           # E (global)
    ep: int
    rank: int
    group_name: str            # ProcessGroup.group_name of the ep mesh dimension
    max_tokens: int | None = None  # bound on any rank's tokens per MoE layer (None: every rank holds the same T)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep

    @property
    def expert_range(self) -> range:
        """The global expert ids this rank owns."""
        return range(self.rank * self.experts_per_rank, (self.rank + 1) * self.experts_per_rank)

    @property
    def mesh(self) -> DeviceMesh:
        return _MESHES[self.group_name]


def ep_info(obj: nn.Module | torch.Tensor) -> EPInfo | None:
    """The EPInfo of a parallelized container, or of one of its local shard Parameters (the latter
    does not survive ``copy.deepcopy``: torch's Parameter copy keeps no attributes). None if neither."""
    return getattr(obj, "_moe_ep_info", None)


def ep_infos(model: nn.Module) -> dict[str, EPInfo]:
    """{module path: EPInfo} for every parallelized container in ``model``."""
    return {name: info for name, m in model.named_modules() if (info := ep_info(m)) is not None}


def _global_view(rows: torch.Tensor, info: EPInfo) -> DTensor:
    """This rank's expert rows as the Shard(0) DTensor of the global [E, ...] tensor over the ep mesh."""
    shape = torch.Size((info.num_experts, *rows.shape[1:]))
    return DTensor.from_local(rows, info.mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _viewed(module: nn.Module, name: str) -> bool:
    """Whether the Parameter of ``name`` is the DTensor view that fsdp_ignored_params makes."""
    held = module._parameters[name]
    return isinstance(held, DTensor) and held.device_mesh == module._moe_ep_info.mesh


def _local_params(module: nn.Module) -> list[nn.Parameter]:
    info = module._moe_ep_info
    return [module._parameters[name] for name in info.names]


def _ep_containers(model: nn.Module):
    for path, module in model.named_modules():
        info = getattr(module, "_moe_ep_info", None)
        if isinstance(info, EPInfo):
            yield path, module, info, info.names


def tensor_parallel_over(group_name: str) -> str | None:
    """A Parameter of a model given to ``parallelize_experts`` over ``group_name`` that tensor parallelism
    (``parallelize_module``) made a DTensor over a mesh dimension sharing more than one rank with the ep
    group, named with its placement ("attn.wq.weight: Shard(dim=0) over mesh dim 'ep'"), else None. The
    experts' own DTensors (``fsdp_ignored_params``) and FSDP2's sharding are not tensor parallelism
    (under FSDP2 a Parameter's tensor-parallel layout is its ``_tp_spec``)."""
    import torch.distributed as dist

    try:
        ep_ranks = set(dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group_name)))
    except (RuntimeError, ValueError, KeyError):
        return None
    for root in list(_ROOTS.get(group_name, ())):
        experts = {id(p) for _, m, _, _ in _ep_containers(root) for p in m._parameters.values() if p is not None}
        fsdp = _fsdp_params(root)
        for name, p in root.named_parameters():
            spec = fsdp[id(p)] if id(p) in fsdp else p if isinstance(p, DTensor) and id(p) not in experts else None
            mesh, placements = getattr(spec, "device_mesh", getattr(spec, "mesh", None)), getattr(spec, "placements", ())
            for dim, placement in enumerate(placements):
                if not placement.is_shard():   # a replicated Parameter (a SequenceParallel norm's) shards nothing
                    continue
                try:
                    ranks = set(dist.get_process_group_ranks(mesh.get_group(dim)))
                except (AttributeError, RuntimeError, ValueError):
                    continue
                if len(ranks & ep_ranks) > 1:
                    names = mesh.mesh_dim_names or ()
                    return f"{name}: {placement!r} over mesh dim {names[dim] if dim < len(names) else dim!r}"
    return None


def _fsdp_params(root: nn.Module) -> dict:
    """id(FSDP2's sharded Parameter) -> its tensor-parallel spec (``_tp_spec``) or None, for ``root``'s FSDP units."""
    out = {}
    for module in root.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if get_state else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            param = getattr(fsdp_param, "sharded_param", None)
            if param is not None:
                out[id(param)] = getattr(fsdp_param, "_tp_spec", None)
    return out
