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
