"""Expert parallelism beside tensor parallelism (torch.distributed.tensor.parallel), 2 gloo ranks on CPU.

Tensor parallelism over the ep ranks hands each of them the same tokens; expert parallelism then sends
every token to its experts once per rank, and the expert gradients counted it twice (review helper-118:
2.000x, silently, router and dense gradients right). That setup is refused (``ep_replicated_tokens``; with
the tensor-parallel layers in another graph, ``ep_tokens_unproven``);
a sequence split of the MoE layer's tokens over the same ranks (sequence parallel) is what works, and
still compiles and trains like the unsharded model.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import run_distributed
from helpers import rel_err

H, I, E, K = 16, 8, 4, 2
# fp32 on CPU: the sharded run adds the same products in another order (per-rank partial sums, gathers)
TP_EP_REL = 1e-5


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wo = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        return x + self.wo(F.gelu(self.wq(x)))


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * I) / H ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(E, I, H) / I ** 0.5)

    def forward(self, x, ids, w):
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            h = x[tok] @ self.gate_up_proj[e]
            h = F.silu(h[:, :I]) * h[:, I:]
            out = out.index_add(0, tok, (h @ self.down_proj[e]) * w[tok, slot, None])
        return out


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.experts = nn.Linear(H, E, bias=False), Experts()

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        w, ids = self.router(x).softmax(-1).topk(K, dim=-1)
        return self.experts(x, ids, w / w.sum(-1, keepdim=True)).reshape(shape)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn, self.norm, self.moe, self.head = Attention(), nn.LayerNorm(H), MoE(), nn.Linear(H, H)
        self.graph_break = False

    def forward(self, x):
        h = self.attn(x)
        if self.graph_break:   # the tensor-parallel attention in another graph than the MoE layer
            torch._dynamo.graph_break()
        return self.head(h + self.moe(self.norm(h)))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False), nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """ModuleList experts: what a tensor-parallel plan can reach expert by expert."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router, self.experts = nn.Linear(H, E, bias=False), nn.ModuleList(SwiGLU() for _ in range(E))

    def forward(self, x):
        w, ids = self.router(x).softmax(-1).topk(K, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            out = out.index_add(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


def _full_grad(p, ref_shape):
    """The gradient of the whole Parameter: a DTensor's full tensor, an expert shard's rows gathered
    over the ranks, a replicated plain Parameter's per-rank parts summed."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    g = p.grad
    if isinstance(g, DTensor):
        return g.full_tensor()
    if g.shape != ref_shape:   # this rank's experts
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, g.contiguous())
        return torch.cat(parts)
    g = g.clone()
    dist.all_reduce(g)
    return g


def body_tensor_and_expert_parallel(rank, ws):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    import moe_compile

    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("ep",))
    options = {"moe.inductor": False}

    # first (a model sharded earlier over this group, still alive, would show its tensor-parallel Parameters):
    # tensor parallelism and moe_compile.ExpertParallel() in one plan, the attention in another graph: the style
    # sees only the experts, the model's tensor-parallel Parameters were out of reach (review helper-122: 2x)
    model = Model()
    model.graph_break = True
    parallelize_module(model, mesh, {"attn.wq": ColwiseParallel(), "attn.wo": RowwiseParallel(),
                                     "moe.experts": moe_compile.ExpertParallel()})
    torch._dynamo.reset()
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    with pytest.raises(Exception, match=r"tensor parallelism runs over the expert-parallel ranks \[0, 1\]"):
        torch.compile(model, backend="moe", options=options)(x)

    # tensor parallelism on the attention, the same ranks for the experts: every rank holds the same tokens
    model = Model()
    parallelize_module(model, mesh, {"attn.wq": ColwiseParallel(), "attn.wo": RowwiseParallel()})
    moe_compile.parallelize_experts(model, mesh)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    with pytest.raises(Exception, match=r"ep_markers(.|\n)*tensor parallelism gives the expert-parallel ranks \[0, 1\] "
                                        r"the same tokens(.|\n)*module 'attn\.wo'(.|\n)*count it 2 times(.|\n)*"
                                        r"sequence parallel"):
        torch.compile(model, backend="moe", options=options)(x)
    report = moe_compile.explain(model, x)
    assert [r.code for r in report.refused] == ["ep_replicated_tokens"], str(report)
    # the same with the attention in another graph (review helper-119: rewritten, 2x again): the graph cannot
    # tell, the model's tensor-parallel Parameters over the ep ranks can
    model.graph_break = True
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"tensor parallelism runs over the expert-parallel ranks \[0, 1\] \(attn\.wq\."
                                        r"weight: Shard\(dim=0\) over mesh dim 'ep'\)(.|\n)*in one graph"):
        torch.compile(model, backend="moe", options=options)(x)

    # tensor-parallel experts (their weights DTensors split over the columns): refused, saying so (the error
    # proposed only the FSDP recipe: review helper-118)
    from torch.distributed.tensor import distribute_tensor

    model = Model()
    for name in ("gate_up_proj", "down_proj"):
        held = getattr(model.moe.experts, name)
        setattr(model.moe.experts, name, nn.Parameter(distribute_tensor(held.detach(), mesh, [Shard(2)])))
    with pytest.raises(ValueError, match="DTensors already.*tensor-parallel experts are not supported: leave the "
                                         "experts out of parallelize_module's plan"):
        moe_compile.parallelize_experts(model, mesh)

    # tensor-parallel experts without expert parallelism: refused (run as written), the reason named torch's
    # style.py only (review helper-118); now it says the experts are tensor-parallel and what to do
    model = LoopMoE()
    parallelize_module(model, mesh, {f"experts.{e}.{n}": (RowwiseParallel() if n == "w2" else ColwiseParallel())
                                     for e in range(E) for n in ("w1", "w3", "w2")})
    report = moe_compile.explain(model, torch.randn(6, H))
    assert [r.code for r in report.refused] == ["unsupported_row_op"], str(report)
    assert "the expert's module `experts.0.w1` is tensor-parallel" in report.refused[0].reason, str(report)

    # sequence parallel: each rank's MoE layer gets its own half of the sequence (torchtitan's layout when ep
    # takes the tp ranks); rewritten, and trains like the unsharded model
    ref, model = Model(), Model()
    parallelize_module(model, mesh, {
        "": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=False),
        "attn.wq": ColwiseParallel(input_layouts=Shard(1)),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "moe": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                  use_local_output=True)})
    parallelize_module(model.moe, mesh, PrepareModuleOutput(output_layouts=(Shard(1),),
                                                            desired_output_layouts=(Shard(1),), use_local_output=False))
    moe_compile.parallelize_experts(model, mesh)
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(2))
    local = x[:, rank * 3:(rank + 1) * 3].contiguous()
    report = moe_compile.explain(model, local)
    assert len(report.rewritten) == 1 and not report.refused, str(report)
    out = torch.compile(model, backend="moe", options=options)(local)
    out = out.full_tensor() if isinstance(out, DTensor) else out
    out_ref = ref(x)
    assert rel_err(out, out_ref) <= TP_EP_REL, rel_err(out, out_ref)
    cotangent = torch.linspace(-1, 1, out_ref.numel()).view(out_ref.shape)
    (out * cotangent).sum().backward()
    (out_ref * cotangent).sum().backward()
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        got, want = _full_grad(p, refs[name].shape), refs[name].grad
        assert rel_err(got, want) <= TP_EP_REL, (name, rel_err(got, want), (got.norm() / want.norm()).item())
    dist.barrier()


def test_tensor_parallel_tokens_on_the_ep_ranks_are_refused_sequence_parallel_trains():
    """Was: 2x expert gradients, no word. The refusal names the module, the times and the fix, and the
    sequence-parallel layout it points to compiles and matches the unsharded model's every gradient."""
    run_distributed(body_tensor_and_expert_parallel, 2)


def body_replicated_parameter_is_not_tensor_parallelism(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import moe_compile

    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("ep",))
    model = Model()
    model.extra = nn.Parameter(distribute_tensor(torch.zeros(3), mesh, [Replicate()]))   # shards nothing
    moe_compile.parallelize_experts(model, mesh)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(rank))   # each rank its own tokens
    report = moe_compile.explain(model, x)
    assert len(report.rewritten) == 1 and not report.refused, str(report)


def test_a_replicated_dtensor_parameter_is_not_taken_for_tensor_parallelism():
    """Data-parallel expert parallelism beside a Replicate DTensor Parameter (no tensor parallelism) was refused
    as ep_tokens_unproven (review helper-122): only a Shard placement over the ep ranks is tensor parallelism."""
    run_distributed(body_replicated_parameter_is_not_tensor_parallelism, 2)
