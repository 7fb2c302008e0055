"""Expert optimizer state in checkpoints under plain expert parallelism and the DDP recipe (``replicate_experts``):
an optimizer holding expert shards gives its state as Shard(0) DTensors of the global shape and takes them back as
this rank's rows (moe_compile/ep_optim_state.py), so a torch.distributed.checkpoint resume gives each rank its own
experts' state and the checkpoint loads into the unsharded model. Before, each rank's rows went in as a plain tensor
that torch took for one replicated on every rank: a resume at the same EP size gave the ranks each other's Adam
moments (review helper-98), a load into the unsharded model failed on the shape, and full_state_dict=True labelled
one rank's rows as the full tensor; per-optimizer hooks set at the first step missed optimizers that load before it,
make their state in the constructor (Adagrad) or get the experts later (review helper-99). Two gloo ranks on CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from test_ep_fsdp import LR, Model

OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=LR), "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=LR),
              "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=LR)}   # Adafactor: factored [E/ep, r, 1] rows


def _setup(layout, mesh, seed, optim="adamw"):
    import moe_compile

    model = moe_compile.parallelize_experts(Model(e=4, seed=seed), mesh["ep"])
    if layout == "ddp":
        moe_compile.replicate_experts(model, mesh["dp"])
    return model, OPTIMIZERS[optim](model.parameters())


def _step(model, opt, rank):
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    compiled(torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
    for n, p in model.named_parameters():   # the dense gradients as DDP makes them: the same on every rank
        if not n.startswith("experts.") and p.grad is not None:
            dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()


def _state(model, opt) -> dict:
    return {(n, k): v.clone() for n, p in model.named_parameters() for k, v in opt.state[p].items()
            if isinstance(v, torch.Tensor) and v.dim()}


def _assert_state(model, opt, want: dict, what: str) -> None:
    got = _state(model, opt)
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for key, v in got.items():
        assert type(v) is torch.Tensor and torch.equal(v, want[key]), f"{what}: {key}"


def body_expert_optimizer_state_round_trips(rank, ws, path, layout, optim):
    import transformers.integrations.moe  # noqa: F401  (registers the grouped_mm_fallback op Model runs)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (1, ws), mesh_dim_names=("dp", "ep"))
    model, opt = _setup(layout, mesh, 0, optim)
    _step(model, opt, rank)
    saved = _state(model, opt)
    seen = []   # a user's post-hook sees the state as returned (review helper-100: it saw the plain rows)
    opt.register_state_dict_post_hook(lambda o, sd: seen.extend(type(v) for e in sd["state"].values()
                                                                for v in e.values() if getattr(v, "dim", int)()))
    whole = {}
    for (n, k), v in saved.items():
        if n.startswith("experts."):
            rows = [torch.empty_like(v) for _ in range(ws)]
            dist.all_gather(rows, v)
            whole[n, k] = torch.cat(rows)
    model_sd, optim_sd = get_state_dict(model, opt)
    assert DTensor in seen, seen
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    # resume at the same EP size, into a fresh model and optimizer
    fresh, fresh_opt = _setup(layout, mesh, 1, optim)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _assert_state(fresh, fresh_opt, saved, f"rank {rank}: resumed")
    _step(fresh, fresh_opt, rank)   # the loaded state steps

    # into the unsharded model: every expert's state
    plain = Model(e=4, seed=2)
    plain_opt = OPTIMIZERS[optim](plain.parameters())
    plain_sd, plain_optim_sd = get_state_dict(plain, plain_opt)
    state = {"model": plain_sd, "optim": plain_optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(plain, plain_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _assert_state(plain, plain_opt, {**saved, **whole}, "unsharded")

    # full_state_dict: the full tensor on every rank; loaded back, each rank keeps (a copy of) its rows
    _, full_osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    for (n, k), v in whole.items():
        assert torch.equal(full_osd["state"][n][k], v), f"full state of {n} {k}"
    again, again_opt = _setup(layout, mesh, 3, optim)
    _step(again, again_opt, rank)
    set_state_dict(again, again_opt, model_state_dict={}, optim_state_dict=copy.deepcopy(full_osd),
                   options=StateDictOptions(full_state_dict=True, strict=False))
    _assert_state(again, again_opt, saved, f"rank {rank}: from a full state")

    # state_dict() / load_state_dict() in process, into an optimizer that has not stepped: it steps
    other, other_opt = _setup(layout, mesh, 4, optim)
    other_opt.load_state_dict(opt.state_dict())
    _assert_state(other, other_opt, saved, f"rank {rank}: load_state_dict before a step")
    _step(other, other_opt, rank)


@pytest.mark.parametrize("layout, optim", [("plain", "adamw"), ("ddp", "adamw"), ("plain", "adagrad"),
                                           ("plain", "adafactor")])
def test_expert_optimizer_state_round_trips(tmp_path, layout, optim):
    pytest.importorskip("transformers")
    run_distributed(body_expert_optimizer_state_round_trips, 2, str(tmp_path / "ckpt"), layout, optim)


def body_experts_added_later(rank, ws, path):
    """An optimizer that stepped dense Parameters only, then got the experts by add_param_group."""
    import transformers.integrations.moe  # noqa: F401
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, ws), mesh_dim_names=("dp", "ep"))
    model, _ = _setup("plain", mesh, 0)
    dense = [p for n, p in model.named_parameters() if not n.startswith("experts.")]
    opt = torch.optim.AdamW(dense, lr=LR)
    _step(model, opt, rank)
    opt.add_param_group({"params": list(model.experts.parameters())})
    _step(model, opt, rank)
    _, full_osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    for n, p in model.experts.named_parameters():
        assert full_osd["state"][f"experts.{n}"]["exp_avg"].shape[0] == 4, f"{n}: one rank's rows as the full tensor"


def test_expert_optimizer_state_of_experts_added_later(tmp_path):
    pytest.importorskip("transformers")
    run_distributed(body_experts_added_later, 2, str(tmp_path / "ckpt"))


def test_optimizer_state_not_one_row_per_expert_raises():
    """Adafactor's column statistic of a 2-D expert weight [E/ep, H] is [1, H], a sum over this rank's experts: no
    Shard(0) label can say which experts it covers, so state_dict() raises naming it instead of saving it."""
    from moe_compile.ep_info import EPInfo
    from moe_compile.ep_optim_state import _global

    info = EPInfo("experts", ("w",), 4, 2, 0, "group")
    with pytest.raises(ValueError, match=r"Adafactor's state 'col_var' \(1, 5\) .* not one row per expert"):
        _global(torch.zeros(1, 5), torch.zeros(2, 5), info, torch.optim.Adafactor([torch.zeros(2, 5)]), "col_var")


def test_optimizer_state_of_another_expert_count_raises_on_load():
    """A plain state tensor of E = 8 rows loaded for a Parameter of 4 experts (2 on this rank) went in as it was
    and failed at the step with torch's size error (review helper-121); a DTensor one raised ours already."""
    from moe_compile.ep_info import EPInfo
    from moe_compile.ep_optim_state import _local

    info = EPInfo("experts", ("w",), 4, 2, 0, "group")
    with pytest.raises(ValueError, match=r"optimizer state 'exp_avg' \(8, 5\) .* 4 experts .* another model"):
        _local(torch.zeros(8, 5), torch.zeros(2, 5), info, "exp_avg")
    assert _local(torch.arange(20.0).view(4, 5), torch.zeros(2, 5), info, "exp_avg").shape == (2, 5)


def test_optimizers_without_per_parameter_state_raise():
    """LBFGS keeps one flat state over every Parameter (this rank's expert rows inside, whichever Parameter comes
    first): its state_dict() raises instead of saving one rank's rows as everyone's (review helper-100)."""
    from moe_compile.ep_info import EPInfo
    from moe_compile.ep_optim_state import install

    install()
    shard = torch.nn.Parameter(torch.zeros(2, 5))
    shard._moe_ep_info = EPInfo("experts", ("w",), 4, 2, 0, "group")
    opt = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(3)), shard])
    with pytest.raises(NotImplementedError, match="LBFGS over expert-parallel shards cannot be checkpointed"):
        opt.state_dict()
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert plain.state_dict() == {"state": {}, "param_groups": plain.state_dict()["param_groups"]}
