"""What ``parallelize_experts`` (moe_compile/parallel.py) did to each expert container: ``EPInfo``,
read back with ``ep_info`` / ``ep_infos`` (re-exported by moe_compile.parallel)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

LOCAL_PREFIX = "_ep_local_"
_MESHES: dict[str, DeviceMesh] = {}        # group_name -> the mesh it came from (for state_dict)


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

    @staticmethod
    def local_name(name: str) -> str:
        return LOCAL_PREFIX + name

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
