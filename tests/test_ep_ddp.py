"""Expert parallelism under DistributedDataParallel (2 gloo ranks on the CPU).

DDP broadcasts rank 0's Parameters when it is built and averages every gradient; the sharded experts
differ per rank. The recipe (moe_compile/ep_ddp.py): ``replicate_experts(model, mesh["dp"])`` before
``DDP(model)`` keeps them out of DDP and divides their gradients to DDP's mean; with it, training matches
the unsharded model. Without it the compile raises naming the recipe (it trained a wrong model silently:
review helper-79), also for a graph compiled before DDP and served from Dynamo's cache, a DDP of a parent
module, and DDP of the compiled module (review helper-81). Dynamo's DDPOptimizer splits graphs at DDP's buckets: inside an MoE layer that is
listed (``break_ddp_buckets``) or, under expert parallelism, an error naming ``optimize_ddp``.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from test_ep_fsdp import FSDP_REL, LR, Model, _rel, _train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _buckets_of_one_parameter():
    """DDP buckets (and the DDPOptimizer's graph splits) after every Parameter."""
    torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 1
    return dict(bucket_cap_mb=1e-6)


def _ep_ddp_case(rank, ws, mesh, how: str, optimize_ddp=True, device="cpu", inductor=False, rel=FSDP_REL):
    """Build, shard and wrap the model as ``how`` says, train two steps against the unsharded model;
    returns the error text when the compile raises. ``rel``: the bound for outputs, norms and parameters."""
    import moe_compile
    from moe_compile import parallel
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    full = Model(e=2 * ws).to(device)
    model = moe_compile.parallelize_experts(copy.deepcopy(full), mesh["ep"])
    names = [n for n, _ in model.experts.named_parameters(prefix="experts")]
    options = {"moe.inductor": inductor}
    if how in ("recipe", "recipe_small_buckets", "ddp_per_rank", "parent", "ddp_of_compiled"):
        moe_compile.replicate_experts(model, mesh["dp"])
    elif how == "ignored_by_hand":
        DDP._set_params_and_buffers_to_ignore_for_model(model, names)
    elif how == "compiled_before_ddp":   # a graph traced before DDP existed, served to DDP's calls by the cache
        torch.compile(model, backend="moe", options=options)(torch.randn(6, 8, device=device)).sum().backward()
        model.zero_grad(set_to_none=True)
    kwargs = _buckets_of_one_parameter() if how == "recipe_small_buckets" else {}
    if how == "ddp_per_rank":   # DDP over each rank alone: the ep ranks' dense Parameters would drift apart
        kwargs["process_group"] = [dist.new_group([r]) for r in range(ws)][rank]
    wrapped = torch.nn.Sequential(model) if how == "parent" else model   # DDP of a parent: its own names
    if how == "ddp_of_compiled":
        compiled = DDP(torch.compile(model, backend="moe", options=options), **kwargs)
    else:
        compiled = torch.compile(DDP(wrapped, **kwargs), backend="moe", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref = copy.deepcopy(full)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    try:
        with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):
            _train(compiled, model, opt, ref, ref_opt, rank, ws, parallel, device, rel)
    except Exception as exc:   # noqa: BLE001 - the caller checks the text
        return str(exc)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        value = p.detach()
        if name in names:   # this rank's rows
            shards = [torch.empty_like(value) for _ in range(ws)]
            dist.all_gather(shards, value.contiguous(), group=mesh["ep"].get_group())
            value = torch.cat(shards)
        assert _rel(value, ref_params[name].detach()) <= rel, f"{how}: {name} after two steps"
    return None


def body_ep_under_ddp(rank, ws, device="cpu", inductor=False, rel=FSDP_REL):
    """``device`` / ``inductor`` / ``rel``: tests/gpu/test_ep_cuda.py runs it on NCCL through Inductor."""
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (1, ws), mesh_dim_names=("dp", "ep"))
    case = functools.partial(_ep_ddp_case, rank, ws, mesh, device=device, inductor=inductor, rel=rel)
    for how, optimize_ddp in (("recipe", True), ("recipe_small_buckets", False)):
        err = case(how, optimize_ddp)
        assert err is None, f"{how}: {err}"
    err = case("plain")
    assert "DistributedDataParallel holds the expert-parallel Parameters" in err and "replicate_experts" in err, err
    err = case("ignored_by_hand")
    assert "nothing divides their gradients" in err and "replicate_experts" in err, err
    err = case("recipe_small_buckets")
    assert "DDPOptimizer" in err and "optimize_ddp = False" in err, err
    err = case("compiled_before_ddp")
    assert "DistributedDataParallel holds the expert-parallel Parameters" in err and "replicate_experts" in err, err
    err = case("parent")
    assert "give replicate_experts the module you wrap in DDP" in err, err
    err = case("ddp_of_compiled")
    assert "torch.compile(DDP(model)" in err, err
    if ws > 1:
        err = case("ddp_per_rank")
        assert f"averages gradients over ranks [{rank}]" in err and "drift apart" in err, err


def body_moe_under_ddp_buckets(rank, ws):
    """No expert parallelism: a DDP bucket boundary inside the MoE layer is listed with its fix."""
    import transformers.integrations.moe  # noqa: F401
    import moe_compile
    from moe_compile import records
    from torch.nn.parallel import DistributedDataParallel as DDP

    for small in (False, True):
        torch._dynamo.reset()
        ddp = DDP(Model(e=4), **(_buckets_of_one_parameter() if small else {}))
        compiled = torch.compile(ddp, backend="moe", options={"moe.inductor": False})
        with records.recording() as graphs:
            compiled(torch.randn(6, 8)).sum().backward()
        found = sorted({(r.status, r.code) for g in graphs for r in g})
        assert found == ([("refused", "break_ddp_buckets")] if small else [("rewritten", "")]), found
    assert moe_compile   # imported for the backend's entry point in the spawned rank


def test_expert_parallel_under_ddp():
    run_distributed(body_ep_under_ddp, 2, timeout_s=400)


def test_ddp_buckets_inside_an_moe_layer_are_listed():
    run_distributed(body_moe_under_ddp_buckets, 2, timeout_s=300)
