"""Expert optimizer state in torch.distributed.checkpoint under plain expert parallelism and the DDP recipe
(``replicate_experts``): saved as Shard(0) DTensors of the global shape (moe_compile/ep_optim_state.py), so a
resume gives each rank its own experts' Adam moments and the checkpoint loads into the unsharded model. Before,
each rank's rows went in as a plain tensor that torch took for one replicated on every rank: a resume at the same
EP size gave the ranks each other's moments (review helper-98), a load into the unsharded model failed on the shape,
and full_state_dict=True labelled one rank's rows as the full tensor. Two gloo ranks on CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from test_ep_fsdp import LR, Model

EXACT = 0.0   # the state is copied, never computed: loaded values are bitwise the saved ones


def _setup(layout, mesh, seed):
    import moe_compile

    model = moe_compile.parallelize_experts(Model(e=4, seed=seed), mesh["ep"])
    if layout == "ddp":
        moe_compile.replicate_experts(model, mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _step(model, opt, rank):
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    compiled(torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
    for n, p in model.named_parameters():   # the dense gradients as DDP makes them: the same on every rank
        if not n.startswith("experts.") and p.grad is not None:
            dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()


def body_expert_optimizer_state_round_trips(rank, ws, path, layout):
    import transformers.integrations.moe  # noqa: F401  (registers the grouped_mm_fallback op Model runs)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, ws), mesh_dim_names=("dp", "ep"))
    model, opt = _setup(layout, mesh, 0)
    _step(model, opt, rank)
    names = [n for n, _ in model.named_parameters() if n.startswith("experts.")]
    saved = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    rows = {n: [torch.empty_like(saved[n]) for _ in range(ws)] for n in names}
    for n in names:
        dist.all_gather(rows[n], saved[n])
    whole = {n: torch.cat(rows[n]) for n in names}
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    # resume at the same EP size, into a fresh model and optimizer
    fresh, fresh_opt = _setup(layout, mesh, 1)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for n, p in fresh.named_parameters():
        got = fresh_opt.state[p]["exp_avg"]
        assert type(got) is torch.Tensor and torch.equal(got, saved[n]), f"rank {rank}: exp_avg of {n} after resume"
    _step(fresh, fresh_opt, rank)   # the loaded state steps

    # into the unsharded model: every expert's state
    plain = Model(e=4, seed=2)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    plain_sd, plain_optim_sd = get_state_dict(plain, plain_opt)
    state = {"model": plain_sd, "optim": plain_optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(plain, plain_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for n, p in plain.named_parameters():
        want = whole[n] if n in whole else saved[n]
        assert torch.equal(plain_opt.state[p]["exp_avg"], want), f"unsharded exp_avg of {n}"

    # full_state_dict: the full tensor on every rank; loaded back, each rank keeps its rows
    _, full_osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    for n in names:
        assert torch.equal(full_osd["state"][n]["exp_avg"], whole[n]), f"full state of {n}"
    again, again_opt = _setup(layout, mesh, 3)
    _step(again, again_opt, rank)
    set_state_dict(again, again_opt, model_state_dict={}, optim_state_dict=copy.deepcopy(full_osd),
                   options=StateDictOptions(full_state_dict=True, strict=False))
    for n, p in again.named_parameters():
        assert torch.equal(again_opt.state[p]["exp_avg"], saved[n]), f"rank {rank}: exp_avg of {n} from a full state"


@pytest.mark.parametrize("layout", ["plain", "ddp"])
def test_expert_optimizer_state_round_trips(tmp_path, layout):
    pytest.importorskip("transformers")
    run_distributed(body_expert_optimizer_state_round_trips, 2, str(tmp_path / "ckpt"), layout)
