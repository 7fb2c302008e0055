"""Expert parallelism composed with FSDP2 (gloo, 2 ranks): training steps match the unsharded model.

Layout (torchtitan's): experts sharded over "ep" by parallelize_experts, each expert container
fully_shard-ed over the ranks that hold the same experts (fully_shard_experts, mesh "dp"; with one
rank there it stays out of FSDP, its gradient divided in the traced graph), the dense parameters fully_shard-ed
over every rank with ignored_params=fsdp_ignored_params(...). The reference trains the unsharded model on the
concatenated batch with the mean of the ranks' losses (FSDP's mean-reduced gradients): after two
AdamW steps with gradient clipping (moe_compile.clip_grad_norm_ across both meshes) every parameter,
the clipped norm and the outputs agree. A root fully_shard without fully_shard_experts would shard
each rank's different experts across the ep ranks: compiling it raises instead of mixing them.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from dist_utils import run_distributed

# two optimizer steps of sharded vs unsharded fp32 training: FSDP's reduce-scatter and the gathered
# expert gradients sum in another order (~1e-7), and AdamW's first steps move each weight by ~lr
# regardless of the gradient's size, so a relative 1e-5 on gradients stays ~1e-6 on weights; 10x margin.
FSDP_REL = 1e-5
LR, CLIP, STEPS = 1e-2, 0.5, 2


class Experts(nn.Module):
    """The transformers 5 layout and grouped_mm form: the container's forward is called (FSDP2
    unshards a module's parameters in its own forward)."""

    def __init__(self, e, h, i):
        super().__init__()
        self.e, self.i = e, i
        self.gate_up_proj = nn.Parameter(torch.randn(e, h, 2 * i) / math.sqrt(h))
        self.down_proj = nn.Parameter(torch.randn(e, i, h) / math.sqrt(i))

    def forward(self, x, ids, w):
        t, k = ids.shape
        ids_g, perm = torch.sort(ids.reshape(-1))
        offs = torch.cumsum(torch.histc(ids_g.float(), bins=self.e, min=0, max=self.e - 1), 0, dtype=torch.int32)
        h = torch.ops.transformers.grouped_mm_fallback(x[perm // k], self.gate_up_proj, offs=offs)
        h = torch.ops.transformers.grouped_mm_fallback(F.silu(h[:, :self.i]) * h[:, self.i:], self.down_proj,
                                                       offs=offs)
        h = h * w.reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        return h[inv].view(t, k, -1).sum(1)


class LoopExperts(Experts):
    """The same weights read once per expert in a loop (``W[e]``): each read traces the expert-parallel
    property again (its ``to_local`` and gradient division too), as ModuleList experts converted by
    ``stack_experts`` do."""

    def forward(self, x, ids, w):
        out = torch.zeros_like(x)
        for e in range(self.e):
            tok, slot = torch.where(ids == e)
            h = x[tok] @ self.gate_up_proj[e]
            h = F.silu(h[:, :self.i]) * h[:, self.i:]
            out.index_add_(0, tok, (h @ self.down_proj[e]) * w[tok, slot, None])
        return out


class Model(nn.Module):
    def __init__(self, h=8, i=6, e=4, k=2, seed=0, loop=False):
        super().__init__()
        torch.manual_seed(seed)
        self.k = k
        self.inp = nn.Linear(h, h)
        self.router = nn.Linear(h, e, bias=False)
        self.experts = (LoopExperts if loop else Experts)(e, h, i)
        self.out = nn.Linear(h, h)

    def forward(self, x):
        h = self.inp(x)
        w, ids = self.router(h).softmax(-1).topk(self.k, dim=-1)
        return self.out(h + self.experts(h, ids, w))


def _rel(got, ref):
    return (got.double() - ref.double()).norm().item() / max(ref.double().norm().item(), 1e-12)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _sharded(model, mesh, every_rank):
    """The documented recipe: experts over "ep", fully_shard_experts over "dp", the dense parts over
    every rank with ignored_params=fsdp_ignored_params(...)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import moe_compile

    moe_compile.parallelize_experts(model, mesh["ep"])
    moe_compile.fully_shard_experts(model, mesh["dp"])
    moe_compile.fully_shard_experts(model, mesh["dp"])  # a second call does not divide twice
    ignored = moe_compile.fsdp_ignored_params(model)
    # one dp rank: nothing to shard, so no FSDP unit (its copies and graph-breaking hooks) on the experts
    assert not isinstance(model.experts, FSDPModule)
    assert ignored == set(model.experts.parameters())
    for module in (model.inp, model.router, model.out):
        fully_shard(module, mesh=every_rank)
    fully_shard(model, mesh=every_rank, ignored_params=ignored)
    return model


def body_train(rank, ws, dp=1, device="cpu", rel=FSDP_REL, meta=False, cpu_built=False, loop=False):
    """dp=1 (fully_shard_experts raises over dp > 1: body_fsdp_unit_on_experts_raises; replicate_experts
    is the layout there, body_replicated_over_dp). ``cpu_built``: the model to shard is on the CPU and the recipe moves it
    to ``device`` (fully_shard what it manages, fsdp_ignored_params' DTensors the experts it ignores)."""
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)
    from torch.distributed.device_mesh import init_device_mesh

    from moe_compile import parallel

    ep = ws // dp
    mesh = init_device_mesh(device, (dp, ep), mesh_dim_names=("dp", "ep"))
    every_rank = init_device_mesh(device, (ws,), mesh_dim_names=("all",))
    full = Model(e=2 * ep, loop=loop).to(device)
    if meta:   # torchtitan's order: build on meta, shard, to_empty (replaces every Parameter), load
        with torch.device("meta"):
            model = _sharded(Model(e=2 * ep, loop=loop), mesh, every_rank)
        model.to_empty(device=device)
        model.load_state_dict(_sharded(copy.deepcopy(full), mesh, every_rank).state_dict())
    else:
        model = _sharded(copy.deepcopy(full).to("cpu" if cpu_built else device), mesh, every_rank)
    off = [n for n, p in model.named_parameters() if _full(p).device.type != torch.device(device).type]
    assert not off, f"left off {device}: {off}"
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)   # one list: DTensors on two meshes
    from moe_compile import records

    ref = copy.deepcopy(full)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    with records.recording() as graphs:
        _train(compiled, model, opt, ref, ref_opt, rank, ws, parallel, device, rel)
        with torch.no_grad():   # evaluation: no gradient division traced, one graph per grad mode
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(7 + rank)).to(device)
            assert _rel(compiled(x), ref(x)) <= rel, "output under torch.no_grad()"
    found = [r for g in graphs for r in g]
    assert any(r.status == "rewritten" for r in found), found
    assert not [r for r in found if r.status != "rewritten"], f"FSDP2's hook graph breaks reported: {found}"
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        value = _full(p.detach())
        if value.shape != ref_params[name].shape:   # this rank's expert rows (dp > 1: FSDP's DTensor over dp)
            shards = [torch.empty_like(value) for _ in range(ep)]
            dist.all_gather(shards, value.contiguous(), group=mesh["ep"].get_group())
            value = torch.cat(shards)
        # kept out of FSDP, the experts are DTensors too: one optimizer list with FSDP's (foreach, fused)
        assert isinstance(p, DTensor), name
        assert _rel(value, ref_params[name].detach()) <= rel, f"{name} after {STEPS} steps"
    # the state_dict (what torch.distributed.checkpoint saves) has every parameter at its global shape
    state = model.state_dict()
    assert state.keys() == ref.state_dict().keys()
    for name, value in state.items():
        assert _rel(_full(value), ref_params[name].detach()) <= rel, f"state_dict()['{name}']"


def _train(compiled, model, opt, ref, ref_opt, rank, ws, parallel, device, rel):
    for step in range(STEPS):
        xs = [torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + r)).to(device) for r in range(ws)]
        out = compiled(xs[rank])
        out.square().mean().backward()
        norm = parallel.clip_grad_norm_(model, CLIP)
        opt.step()
        opt.zero_grad()

        ref_out = ref(torch.cat(xs))
        (sum(o.square().mean() for o in ref_out.split(6)) / ws).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
        assert _rel(out.detach(), ref_out.detach()[rank * 6:(rank + 1) * 6]) <= rel, f"step {step}: output"
        assert _rel(norm, ref_norm) <= rel, f"step {step}: clipped norm {norm} vs {ref_norm}"


def body_fsdp_unit_on_experts_raises(rank, ws, how):
    """An FSDP unit on the experts (fully_shard_experts over dp > 1 or with an mp_policy; fully_shard
    on the container by hand): FSDP2 runs its hooks outside Dynamo, a graph break between the router
    and the experts. fully_shard_experts raises before it changes anything, naming replicate_experts;
    a hand-made unit fails the compile with an error naming the FSDP unit and the fix."""
    import transformers.integrations.moe  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import moe_compile

    dp = 2 if how == "dp2" else 1
    mesh = init_device_mesh("cpu", (dp, ws // dp), mesh_dim_names=("dp", "ep"))
    model = moe_compile.parallelize_experts(Model(e=4), mesh["ep"])
    if how == "by_hand":
        fully_shard(model.experts, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh._flatten(), ignored_params=set(model.experts.parameters()))
        with pytest.raises(Exception, match="are FSDP units .*replicate_experts"):
            torch.compile(model, backend="moe", options={"moe.inductor": False})(torch.randn(6, 8))
        return
    if how == "ep_mesh":   # the ep mesh given for dp (review helper-114): was blamed on dp > 1
        with pytest.raises(ValueError, match=r"hold different experts.*fully_shard_experts the ranks.*mesh\['dp'\]"):
            moe_compile.fully_shard_experts(model, mesh["ep"])
        return
    if how == "typo":      # a misspelt keyword was accepted and dropped
        with pytest.raises(TypeError, match="unknown keyword.*reshard_after_forwrd"):
            moe_compile.fully_shard_experts(model, mesh["dp"], reshard_after_forwrd=True)
        return
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if how == "mp_policy" else {}
    with pytest.raises(ValueError, match="FSDP unit.*replicate_experts.*torch.autocast"):
        moe_compile.fully_shard_experts(model, mesh["dp"], **kwargs)
    assert model.experts._moe_grad_divisor is None
    with pytest.raises(ValueError, match="fsdp_ignored_params: the experts of 'experts' were not given to "
                                         "fully_shard_experts or replicate_experts"):   # was an empty set
        moe_compile.fsdp_ignored_params(model)


def body_root_only(rank, ws, strict, experts_call):
    import transformers.integrations.moe  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import moe_compile

    mesh = init_device_mesh("cpu", (1, ws), mesh_dim_names=("dp", "ep"))
    model = moe_compile.parallelize_experts(Model(), mesh["ep"])
    if experts_call == "own_ignored_params":   # left out of FSDP by hand: nothing divides their gradients
        fully_shard(model, mesh=mesh._flatten(), ignored_params=set(model.experts.parameters()))
        expected = "ep times too large"
    else:
        if experts_call:                       # kept local at dp = 1 ...
            moe_compile.fully_shard_experts(model, mesh["dp"])
        fully_shard(model, mesh=mesh._flatten())  # ... but no ignored_params: sharded across ranks with other experts
        expected = "sharded"
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False, "moe.strict": strict})
    with pytest.raises(Exception, match="fsdp_ignored_params" if strict else expected):
        compiled(torch.randn(6, 8))
    report = moe_compile.explain(model, torch.randn(6, 8))   # the same error, and the layer it stopped
    assert len(report.errors) == 1 and "fsdp_ignored_params" in report.errors[0], str(report)
    assert [r.code for r in report.refused] == ["invalid_setup"], str(report)


@pytest.mark.parametrize("meta, loop", [(False, False), (True, False), (False, True)],
                         ids=["built", "meta_init", "loop_form"])
def test_fsdp2_and_expert_parallel_train_like_unsharded(meta, loop):
    pytest.importorskip("transformers")
    run_distributed(body_train, 2, 1, "cpu", FSDP_REL, meta, False, loop)


@pytest.mark.parametrize("how", ["dp2", "mp_policy", "by_hand", "ep_mesh", "typo"])
def test_fsdp_unit_on_the_experts_raises_naming_the_fix(how):
    pytest.importorskip("transformers")
    run_distributed(body_fsdp_unit_on_experts_raises, 2, how)


@pytest.mark.parametrize("experts_call", [False, True, "own_ignored_params"],
                         ids=["no_fully_shard_experts", "no_ignored_params", "own_ignored_params"])
@pytest.mark.parametrize("strict", [True, False])
def test_root_fully_shard_over_sharded_experts_raises(strict, experts_call):
    pytest.importorskip("transformers")
    run_distributed(body_root_only, 2, strict, experts_call)


class ExpertsWithScale(Experts):
    """An expert container that also holds a Parameter that is not per expert (replicated on every ep rank)."""

    def __init__(self, e, h, i):
        super().__init__(e, h, i)
        self.scale = nn.Parameter(torch.ones(h))


def body_clip_counts_replicated_once(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    import moe_compile
    from moe_compile import parallel

    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("ep",))
    model = moe_compile.parallelize_experts(ExpertsWithScale(4, 8, 6), mesh)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    # every expert row once (ws ranks' shards) and the replicated scale once
    want = math.sqrt(sum(model._parameters[n].numel() for n in parallel.ep_info(model).names) * ws + 8)
    norm = parallel.clip_grad_norm_(model, 1e9)
    assert abs(float(norm) - want) <= 1e-5 * want, (float(norm), want)


def test_clip_grad_norm_counts_a_replicated_parameter_of_an_expert_container_once():
    run_distributed(body_clip_counts_replicated_once, 2)


class CheckpointedModel(Model):
    """Model with its MoE part under activation checkpointing (as gradient_checkpointing_enable puts a
    decoder layer): a graph break inside it makes Dynamo run the whole checkpointed call eagerly."""

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + torch.utils.checkpoint.checkpoint(self.moe, h, use_reentrant=False))

    def moe(self, h):
        w, ids = self.router(h).softmax(-1).topk(self.k, dim=-1)
        return self.experts(h, ids, w)


def body_replicated_over_dp(rank, ws, dp, loop, device="cpu", rel=FSDP_REL):
    """replicate_experts over dp ranks (dp x ep = ws), the dense parameters fully_shard-ed over every rank,
    the MoE part under activation checkpointing: the layer is rewritten (no FSDP hook inside the
    checkpoint), and two AdamW steps with clipping match the unsharded model on the global batch
    (every parameter, outputs, clipped norms). The replicas start equal though built from different
    seeds (broadcast from the first dp rank). With fully_shard_experts over the same dp ranks instead,
    the checkpointed layer runs eagerly and the sharded experts raise (the known limit this avoids).
    tests/gpu/test_ep_cuda.py runs it on NCCL (``device="cuda"``)."""
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import moe_compile
    from moe_compile import parallel, records

    ep = ws // dp
    mesh = init_device_mesh(device, (dp, ep), mesh_dim_names=("dp", "ep"))
    every_rank = mesh._flatten()
    full = CheckpointedModel(e=2 * ep, loop=loop).to(device)
    model = copy.deepcopy(full)
    with torch.no_grad():   # replicas that differ before replicate_experts (another seed per dp rank)
        model.experts.down_proj.add_(float(mesh.get_coordinate()[0]))
    moe_compile.parallelize_experts(model, mesh["ep"])
    moe_compile.replicate_experts(model, mesh["dp"])
    fully_shard(model, mesh=every_rank, ignored_params=moe_compile.fsdp_ignored_params(model))
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    ref = copy.deepcopy(full)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    with records.recording() as graphs:
        _train(compiled, model, opt, ref, ref_opt, rank, ws, parallel, device, rel)
    found = [r for g in graphs for r in g]
    assert any(r.status == "rewritten" for r in found) and all(r.status == "rewritten" for r in found), found
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert _rel(_full(p.detach()), ref_params[name].detach()) <= rel, f"{name} after {STEPS} steps"

    misused = moe_compile.parallelize_experts(copy.deepcopy(full), mesh["ep"])
    if ep > 1:   # the ep mesh given for dp: it would average different experts
        with pytest.raises(ValueError, match=r"replicate_experts: 'experts': the ranks of the given mesh .*hold different experts"):
            moe_compile.replicate_experts(misused, mesh["ep"])
    with pytest.raises(ValueError, match="FSDP unit.*replicate_experts"):   # over dp > 1: never an FSDP unit
        moe_compile.fully_shard_experts(misused, mesh["dp"])
    fully_shard(misused.experts, mesh=mesh["dp"])           # one made by hand, then replicate as well
    with pytest.raises(ValueError, match="already an FSDP unit .*not an addition"):
        moe_compile.replicate_experts(misused, mesh["dp"])

    other = moe_compile.parallelize_experts(copy.deepcopy(full), mesh["ep"])
    fully_shard(other.experts, mesh=mesh["dp"])             # an FSDP unit on the experts, by hand
    fully_shard(other, mesh=every_rank, ignored_params=set(other.experts.parameters()))
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="ep_experts: .*activation checkpointing"):
        torch.compile(other, backend="moe", options={"moe.inductor": False})(torch.randn(6, 8, device=device))
    report = moe_compile.explain(other, torch.randn(6, 8, device=device))   # the same error, and what ran eagerly
    assert [(r.module, r.code) for r in report.refused] == [("experts", "ran_eagerly")], str(report)
    assert len(report.errors) == 1 and "replicate_experts" in report.errors[0], str(report)


@pytest.mark.parametrize("loop", [False, True], ids=["grouped", "loop_form"])
def test_experts_replicated_over_dp_train_under_checkpointing(loop):
    run_distributed(body_replicated_over_dp, 2, 2, loop)


def test_experts_replicated_over_dp_with_ep2_train_under_checkpointing():
    """dp = 2 x ep = 2: replicas of each rank's half of the experts."""
    run_distributed(body_replicated_over_dp, 4, 2, False, timeout_s=400)


def _prim_to_local(grad_placements):
    """What torch 2.11's Dynamo puts in the graph for ``dtensor.to_local(...)``: a fresh function named
    ``prim_to_local`` per call, closing over the call's arguments."""
    def prim_to_local(x):
        return x.to_local(grad_placements=grad_placements)
    return prim_to_local


def test_to_local_of_torch_2_11_is_one_trace_per_argument_set():
    """Loop-form experts read the sharded weight once per expert; under FSDP2 each read traces the
    DTensor's to_local again. torch 2.13 spells it ``x.to_local()``; torch 2.11 a call of a new
    ``prim_to_local`` closure, which the region finder took for different values (ep_markers then
    raised on the GPU image's torch for EP + FSDP2 loop forms). Equal closures are one value,
    different arguments are not, and the walk back to the Parameter goes through both spellings."""
    from moe_compile.passes.normalize import annotate, canon
    from moe_compile.passes.region import _same_trace
    from moe_compile.passes.token_paths import param_of

    g = torch.fx.Graph()
    p = g.placeholder("l_self_experts_parameters_gate_up_proj_")
    a, b = (g.call_function(_prim_to_local(None), (p,)) for _ in range(2))
    c = g.call_function(_prim_to_local(("replicate",)), (p,))
    m1, m2 = (g.call_method("to_local", (p,)) for _ in range(2))
    g.output((a, b, c, m1, m2))
    annotate(g)
    assert a.target is not b.target and canon(a) == "to_local"
    assert _same_trace(a, b) and _same_trace(m1, m2)
    assert not _same_trace(a, c) and not _same_trace(a, m1)
    assert param_of(a, {p}) is p and param_of(m1, {p}) is p


def body_parallelize_after_fully_shard(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import moe_compile

    mesh = init_device_mesh("cpu", (1, ws), mesh_dim_names=("dp", "ep"))
    model = Model()
    fully_shard(model, mesh=mesh._flatten())
    with pytest.raises(ValueError, match="DTensors already .* call parallelize_experts on the plain model"):
        moe_compile.parallelize_experts(model, mesh["ep"])
    assert not moe_compile.parallel.ep_infos(model)     # nothing sharded


def test_parallelize_experts_after_fully_shard_raises():
    """In the other order parallelize_experts would cut FSDP's DTensor Parameters, and the compile
    failed later with errors that named neither."""
    run_distributed(body_parallelize_after_fully_shard, 2)


def body_checkpoint_keys_match_the_unsharded_model(rank, ws, path):
    """Sharded Parameters keep their names: the optimizer state torch.distributed.checkpoint's
    ``get_state_dict`` returns is keyed as the unsharded model's, so a checkpoint saved under expert
    parallelism loads into the unsharded model, optimizer included (it was keyed ``_ep_local_<name>``
    and failed: "Missing key in checkpoint state_dict: optim.state.experts.gate_up_proj.step"); and
    ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` loads (ranks other than
    0 raised on the names while rank 0 went on, into a hang)."""
    import transformers.integrations.moe  # noqa: F401
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                         set_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    from moe_compile import parallel

    mesh = init_device_mesh("cpu", (1, ws), mesh_dim_names=("dp", "ep"))
    every_rank = init_device_mesh("cpu", (ws,), mesh_dim_names=("all",))
    full = Model(e=4)
    model = _sharded(copy.deepcopy(full), mesh, every_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref = copy.deepcopy(full)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    _train(torch.compile(model, backend="moe", options={"moe.inductor": False}), model, opt, ref, ref_opt, rank, ws,
           parallel, "cpu", FSDP_REL)
    model_sd, optim_sd = get_state_dict(model, opt)
    assert set(optim_sd["state"]) == set(dict(ref.named_parameters())), sorted(optim_sd["state"])
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    plain = Model(e=4, seed=1)                                # unsharded, on every rank
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    plain_sd, plain_optim_sd = get_state_dict(plain, plain_opt)
    state = {"model": plain_sd, "optim": plain_optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(plain, plain_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for (name, p), q in zip(plain.named_parameters(), ref.parameters()):
        assert _rel(p.detach(), q.detach()) <= FSDP_REL, f"{name} loaded from the expert-parallel checkpoint"
        assert _rel(plain_opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"]) <= FSDP_REL, f"exp_avg of {name}"

    fresh = _sharded(Model(e=4, seed=2), mesh, every_rank)
    set_model_state_dict(fresh, ref.state_dict() if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, value in fresh.state_dict().items():
        assert _rel(_full(value), ref.state_dict()[name]) <= FSDP_REL, f"{name} broadcast from rank 0"


def test_checkpoint_keys_match_the_unsharded_model(tmp_path):
    pytest.importorskip("transformers")
    run_distributed(body_checkpoint_keys_match_the_unsharded_model, 2, str(tmp_path / "ckpt"))
