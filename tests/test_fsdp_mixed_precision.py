"""FSDP2 with a MixedPrecisionPolicy (gloo, 2 ranks): torchtitan's mixed-precision recipe, fp32
sharded parameters gathered as bf16 for the forward and backward, gradients reduced in fp32.

A transformers Qwen3-MoE, every decoder layer and the root ``fully_shard``-ed with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, its layers compiled with
``compile_blocks`` (after ``fully_shard``, as the README says): each layer's MoE block is rewritten
on the bf16 weights FSDP2 gathers, and the loss and every fp32 gradient shard match the same model
under the same policy run eagerly, over two AdamW steps.
"""
from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import run_distributed

pytest.importorskip("transformers")

# both runs compute in bf16 with FSDP2's casts; the rewrite rounds at other points (fp32 accumulation
# of the K expert outputs, one rounding per fused op), as helpers.BF16_REL / BF16_GRAD_REL, whose bounds
# apply; the second step's weights differ by what the first step's gradients did (AdamW moves each
# weight by ~lr): the same bounds held there when measured
LR, STEPS = 1e-3, 2


def body_train(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import moe_compile
    from helpers import BF16_GRAD_REL, BF16_REL, assert_close_rel, tiny_qwen3_moe
    from moe_compile import records

    mesh = init_device_mesh("cpu", (ws,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = tiny_qwen3_moe(2)
    models = []
    for _ in range(2):
        m = copy.deepcopy(base)
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(m, mesh=mesh, mp_policy=policy)
        models.append(m)
    model, ref = models
    moe_compile.compile_blocks(model, options={"moe.inductor": False})
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    with records.recording() as graphs:
        for step in range(STEPS):
            ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
            losses = []
            for m, opt in zip(models, opts):
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(loss.detach().float())
            assert_close_rel(losses[0], losses[1], BF16_REL, f"rank {rank} step {step}: loss")
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert p.grad is not None and p.grad.dtype == torch.float32, name
                assert_close_rel(p.grad.full_tensor(), q.grad.full_tensor(), BF16_GRAD_REL,
                                 f"rank {rank} step {step}: grad of {name}")
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
    rewritten = [r for g in graphs for r in g if r.status == records.REWRITTEN]
    assert rewritten, [r for g in graphs for r in g]
    assert not [r for g in graphs for r in g if r.status != records.REWRITTEN], [r for g in graphs for r in g]


def test_fsdp2_mixed_precision_policy_trains_like_eager():
    run_distributed(body_train, 2)
