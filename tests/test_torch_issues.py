"""Bugs of torch itself that moe_compile's users meet, reproduced without moe_compile (README, expert
parallelism, known limits). Each is a strict xfail on the torch versions that have it: when torch
fixes it, the test passes, strict xfail fails, and the README's limit and this entry go."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


class _CheckpointedDTensorRead(nn.Module):
    """A Shard(0) DTensor Parameter (what fsdp_ignored_params makes of the experts) read with
    ``to_local()`` inside activation checkpointing, with a random op in the checkpointed body."""

    def __init__(self, mesh):
        from torch.distributed.tensor import DTensor, Shard

        super().__init__()
        self.w = nn.Parameter(DTensor.from_local(torch.randn(4, 8, 8), mesh, [Shard(0)]))
        self.lin = nn.Linear(8, 8)

    def body(self, x):
        return F.dropout(self.lin(x), 0.1, training=True) @ self.w.to_local()[0]

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)


@pytest.mark.xfail(TORCH == (2, 13), strict=True, raises=AssertionError,
                   reason="torch 2.13 AOTAutograd: a DeviceMesh saved for backward beside a checkpoint's saved RNG "
                          "state is counted as an opaque object but placed among the saved tensors")
def test_dtensor_to_local_inside_checkpoint_with_a_random_op(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = _CheckpointedDTensorRead(init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
        torch._dynamo.reset()
        torch.compile(model, backend="aot_eager")(torch.randn(5, 8, requires_grad=True)).sum().backward()
        assert model.w.grad is not None
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()
