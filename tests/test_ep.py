"""Expert parallelism: ep_plan / ep_dispatch / ep_combine, the ep_experts marker, parallelize_experts,
stack_experts.

Multi-rank bodies run in spawned gloo processes (dist_utils); each groups many cases to pay the
spawn once. Ops level: an expert-parallel MoE forward built by hand from the project's ops
(route_permute -> permute_rows -> ep_plan -> ep_dispatch -> grouped_mm on the local shard ->
ep_combine -> unpermute_combine) must match single-process eager on the full model, outputs and
every gradient: expert-weight gradients gathered from the shards equal the gradient of the
concatenated batch, router/dense/input gradients equal the rank's own. Movement: exactly equal to a
pure-torch reference (host loops), round trip and adjointness.

Legend: T tokens per rank, K top-k, N = T*K, E experts, ep ranks, E_local = E / ep, H width, I expert width.
"""
from __future__ import annotations

import copy
import re
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import moe_compile.kernels.ep as ep_ops
import moe_compile.parallel
import moe_compile.kernels.ops  # noqa: F401  (registers every moe_compile op)
from moe_compile.kernels.ep_transport import padded_layout
from dist_utils import run_distributed

OPS = torch.ops.moe_compile
# EP (grouped GEMM on the shard, fp32 accumulation, gather-reduce combine) vs eager per-expert
# matmuls + index_add in fp32: same products, different summation order; ~1e-7 measured.
EP_FP32_REL = 1e-5
# adjointness <dispatch(x), y> = <x, combine(y)> in fp64: two sums of the same products in
# different orders; ~1e-16 relative.
ADJOINT_REL = 1e-12
# a reference gradient whose norm is below this is zero (an expert that got no rows): then the
# EP gradient must be zero too, up to this norm.
ZERO_NORM = 1e-6


def rel_err(got, ref) -> float:
    got, ref = got.double(), ref.double()
    return (got - ref).norm().item() / max(ref.norm().item(), 1e-30)


def assert_close(got, ref, what, rel=EP_FP32_REL):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    if ref.double().norm() < ZERO_NORM:
        assert got.double().norm() < ZERO_NORM, f"{what}: reference is zero, got norm {got.norm()}"
    else:
        assert rel_err(got, ref) <= rel, f"{what}: relative error {rel_err(got, ref):.3g} > {rel:.3g}"


# ==================================================================================== models
class StackedSwiGLUExperts(nn.Module):
    """Plain-code expert container: y = (silu(x @ Wg) * (x @ Wu)) @ Wd per expert, weights [E, ...]."""

    def __init__(self, e, h, i, bias=False):
        super().__init__()
        self.i = i
        self.gate_up = nn.Parameter(torch.randn(e, h, 2 * i) / h ** 0.5)
        self.down = nn.Parameter(torch.randn(e, i, h) / i ** 0.5)
        self.gate_up_bias = nn.Parameter(0.1 * torch.randn(e, 2 * i)) if bias else None

    def forward(self, x, ids, w):  # eager reference: loop over experts, masks, index_add
        out = torch.zeros_like(x)
        for e in range(self.gate_up.shape[0]):
            tok, slot = torch.where(ids == e)
            a = x[tok] @ self.gate_up[e] + (self.gate_up_bias[e] if self.gate_up_bias is not None else 0)
            y = (F.silu(a[:, :self.i]) * a[:, self.i:]) @ self.down[e]
            out = out.index_add(0, tok, y * w[tok, slot, None])
        return out


class TinyMoE(nn.Module):
    """dense Linear -> softmax top-k router (+ a fixed logit bias that steers routing) -> experts.
    ``drop`` [T, K] marks slots whose id becomes -1 (outside [0, E): dropped)."""

    def __init__(self, h=8, i=6, e=4, k=2, bias=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.k = k
        self.dense = nn.Linear(h, h)
        self.router = nn.Linear(h, e, bias=False)
        self.experts = StackedSwiGLUExperts(e, h, i, bias)

    def route(self, x, logit_bias, drop):
        h = self.dense(x)
        w, ids = (self.router(h) + logit_bias).softmax(-1).topk(self.k, dim=-1)
        if self.k > 1:  # top-1 keeps the raw probability (renormalised it would be 1: no router gradient)
            w = w / w.sum(-1, keepdim=True)
        return h, torch.where(drop, -1, ids), w

    def forward(self, x, logit_bias, drop):
        return self.experts(*self.route(x, logit_bias, drop))


def ep_forward(model: TinyMoE, x, logit_bias, drop):
    """The hand-built expert-parallel forward of TinyMoE (what the backend's lowering emits)."""
    from moe_compile.parallel import ep_info

    h, ids, w = model.route(x, logit_bias, drop)
    ex, info = model.experts, ep_info(model.experts)
    e, g, i = info.num_experts, info.group_name, ex.i
    perm, inv, offsets = OPS.route_permute(ids, e)
    xp = OPS.permute_rows(h, perm, inv, offsets, ids.shape[1])
    plan, recv_offsets = OPS.ep_plan(offsets, e, g)
    xr = OPS.ep_dispatch(xp, plan, g)
    bias = ex._parameters.get("gate_up_bias")
    a = OPS.grouped_mm(xr, ex._parameters["gate_up"], recv_offsets, bias)
    yr = OPS.grouped_mm(F.silu(a[:, :i]) * a[:, i:], ex._parameters["down"], recv_offsets)
    return OPS.unpermute_combine(OPS.ep_combine(yr, plan, g), inv, w, offsets)


# ==================================================================================== routing cases
# name: (T, K, E per rank of ep, expert bias, routing); E = E_LOCAL * ep
CASES = {
    "random_top2": (6, 2, 2, False, "random"),
    "top1_odd_tokens": (5, 1, 2, False, "random"),
    "top3_bias": (7, 3, 3, True, "random"),
    "all_to_rank0": (5, 2, 2, False, "rank0"),      # every other rank receives nothing
    "all_to_next_rank": (4, 2, 2, False, "next"),   # no rank keeps a row
    "hot_expert": (6, 2, 2, False, "hot"),
    "uneven": (9, 2, 3, False, "uneven"),
    "dropped": (6, 2, 2, True, "dropped"),
    "all_dropped_on_rank0": (3, 2, 2, False, "rank0_drops_all"),
    "one_token": (1, 2, 2, False, "random"),
}


def case_inputs(case, ep, rank, e, t, k, h):
    """x [T, H], logit bias [T, E], drop [T, K] for ``rank`` (every rank can build every rank's)."""
    g = torch.Generator().manual_seed(1000 * rank + 7)
    routing = CASES[case][4]
    x = torch.randn(t, h, generator=g)
    bias = torch.zeros(t, e)
    drop = torch.zeros(t, k, dtype=torch.bool)
    e_local = e // ep
    if routing == "rank0":
        bias[:, :e_local] = 50.0
    elif routing == "next":
        nxt = (rank + 1) % ep
        bias[:, nxt * e_local:(nxt + 1) * e_local] = 50.0
    elif routing == "hot":
        bias[:, e - 1] = 50.0
    elif routing == "uneven":
        bias += 3.0 * torch.randn(e, generator=g)
    elif routing == "dropped":
        drop = torch.rand(t, k, generator=g) < 0.4
    elif routing == "rank0_drops_all":
        drop[:] = rank == 0
    return x, bias, drop


def _grads(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in params.items()}


def check_moe_case(case, rank, ep, mesh):
    from moe_compile.parallel import parallelize_experts

    t, k, e_local, bias, _ = CASES[case]
    e, h = e_local * ep, 8
    full = TinyMoE(h=h, e=e, k=k, bias=bias)
    model = parallelize_experts(copy.deepcopy(full), mesh)
    inputs = [case_inputs(case, ep, r, e, t, k, h) for r in range(ep)]
    cot = [torch.linspace(-1, 1, t * h).view(t, h) * (r + 1) for r in range(ep)]  # fixed, non-uniform

    x = inputs[rank][0].clone().requires_grad_()
    out = ep_forward(model, x, *inputs[rank][1:])
    (out * cot[rank]).sum().backward()

    # reference 1: the full model on the concatenated batch -> outputs and expert-weight gradients
    ref = copy.deepcopy(full)
    ref_out = ref(*[torch.cat(z) for z in zip(*inputs)])
    (ref_out * torch.cat(cot)).sum().backward()
    assert_close(out.detach(), ref_out.detach()[rank * t:(rank + 1) * t], f"{case}: rank {rank} output")
    for name, p in _grads(dict(model.experts.named_parameters())).items():
        shards = [torch.empty_like(p) for _ in range(ep)]
        dist.all_gather(shards, p.contiguous())
        orig = name
        assert_close(torch.cat(shards), _grads(dict(ref.experts.named_parameters()))[orig],
                     f"{case}: gradient of experts.{orig} (gathered)")
    # reference 2: the full model on this rank's batch only -> router / dense / input gradients
    own = copy.deepcopy(full)
    x_own = inputs[rank][0].clone().requires_grad_()
    (own(x_own, *inputs[rank][1:]) * cot[rank]).sum().backward()
    assert_close(x.grad, x_own.grad, f"{case}: rank {rank} input gradient")
    dense = {n: p for n, p in model.named_parameters() if not n.startswith("experts.")}
    own_dense = _grads({n: p for n, p in own.named_parameters() if not n.startswith("experts.")})
    for name, g in _grads(dense).items():
        assert_close(g, own_dense[name], f"{case}: rank {rank} gradient of {name}")


# ==================================================================================== movement reference
def reference_movement(xps, offsets, ep):
    """Pure torch with host loops: per rank (plan, recv_offsets, dispatched [ep*N, H])."""
    e = offsets[0].numel()
    el, n = e // ep, xps[0].shape[0]
    counts = [torch.diff(o.long(), prepend=torch.zeros(1, dtype=torch.long)) for o in offsets]
    starts = [(o.long() - c).tolist() for o, c in zip(offsets, counts)]
    result = []
    for r in range(ep):
        send = counts[r].view(ep, el)
        recv = torch.stack([counts[s][r * el:(r + 1) * el] for s in range(ep)])
        rows = [xps[s][starts[s][g]:starts[s][g] + int(counts[s][g])]
                for g in range(r * el, (r + 1) * el) for s in range(ep)]
        got = torch.cat(rows)
        disp = torch.cat([got, got.new_zeros(ep * n - got.shape[0], got.shape[1])])
        result.append((torch.stack([send, recv]), recv.sum(0).cumsum(0).to(torch.int32), disp))
    return result


def reference_combine(ys, offsets, ep, n):
    """Inverse of reference_movement: per source rank [N, H2] in its xp order, unsent rows zero."""
    e = offsets[0].numel()
    el = e // ep
    counts = [torch.diff(o.long(), prepend=torch.zeros(1, dtype=torch.long)).tolist() for o in offsets]
    outs = [ys[0].new_zeros(n, ys[0].shape[1]) for _ in range(ep)]
    for r in range(ep):
        pos = 0
        for g in range(r * el, (r + 1) * el):
            for s in range(ep):
                c, start = counts[s][g], sum(counts[s][:g])
                outs[s][start:start + c] = ys[r][pos:pos + c]
                pos += c
    return outs


def random_offsets(e, n, gen, kind):
    """int32 cumulative ends for N rows over E experts (kind: random, empty, some rows dropped)."""
    if kind == "empty":
        return torch.zeros(e, dtype=torch.int32)
    ids = torch.randint(0, e, (n - (n // 3 if kind == "dropped" else 0),), generator=gen)
    return torch.bincount(ids, minlength=e).cumsum(0).to(torch.int32)


def check_movement(rank, ep, group_name):
    n, h, h2 = 7, 3, 5
    for e_local in (1, 3):
        for kinds in (["random"] * ep, ["dropped"] * ep, ["empty"] + ["random"] * (ep - 1)):
            e = e_local * ep
            gen = torch.Generator().manual_seed(e_local)
            offsets = [random_offsets(e, n, gen, kinds[s]) for s in range(ep)]
            xps = [torch.randn(n, h, generator=gen) for _ in range(ep)]
            for s in range(ep):  # rows past offsets[-1] are never sent: poison them
                xps[s][int(offsets[s][-1]):] = float("nan")
            ys = [torch.randn(ep * n, h2, generator=gen) for _ in range(ep)]
            plan_ref, recv_ref, disp_ref = reference_movement(xps, offsets, ep)[rank]
            what = f"E_local={e_local} {kinds}"
            plan, recv_offsets = OPS.ep_plan(offsets[rank], e, group_name)
            assert torch.equal(plan, plan_ref) and torch.equal(recv_offsets, recv_ref), what
            disp = OPS.ep_dispatch(xps[rank], plan, group_name)
            assert torch.equal(disp, disp_ref), f"{what}: dispatch"
            total = int(recv_offsets[-1])
            ys[rank][total:] = float("nan")  # rows past recv_offsets[-1] are never returned
            comb = OPS.ep_combine(ys[rank], plan, group_name)
            assert torch.equal(comb, reference_combine(ys, offsets, ep, n)[rank]), f"{what}: combine"
            back = OPS.ep_combine(disp, plan, group_name)
            sent = xps[rank].clone()
            sent[int(offsets[rank][-1]):] = 0
            assert torch.equal(back, sent), f"{what}: combine(dispatch(x)) != x"
            # adjointness (what autograd relies on): sum over ranks of <D x, y> == <x, C y>
            x64, y64 = xps[rank].nan_to_num(0).double(), torch.randn(ep * n, h, generator=gen).double()
            dots = torch.stack([(OPS.ep_dispatch(x64, plan, group_name) * y64).sum(),
                                (x64 * OPS.ep_combine(y64, plan, group_name)).sum()])
            dist.all_reduce(dots)
            assert abs(dots[0] - dots[1]) <= ADJOINT_REL * dots.abs().max(), f"{what}: adjoint {dots}"


def check_errors(rank, group_name):
    plan, _ = OPS.ep_plan(torch.tensor([2, 4, 4, 4], dtype=torch.int32), 4, group_name)
    n = 4 + 2 * rank  # ranks route different row counts: must fail on every rank, not hang
    with pytest.raises(ValueError, match=r"ep_dispatch: every rank .* same number of rows"):
        OPS.ep_dispatch(torch.zeros(n, 2), plan, group_name)
    with pytest.raises(ValueError, match="ep_plan: 3 experts do not split"):
        OPS.ep_plan(torch.tensor([1, 2, 3], dtype=torch.int32), 3, group_name)


def body_ops(rank, ep):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    group_name = mesh.get_group().group_name
    check_movement(rank, ep, group_name)
    check_errors(rank, group_name)
    for case in CASES:
        check_moe_case(case, rank, ep, mesh)
    # the ops under AOTAutograd (fake impls, autograd formulas), one case, fullgraph
    xp, offsets = torch.randn(6, 4, requires_grad=True), torch.tensor([1, 1, 4, 5], dtype=torch.int32)
    for opname, args in (("ep_plan", (offsets, 4, group_name)),):
        torch.library.opcheck(getattr(OPS, opname), args)
    plan, _ = OPS.ep_plan(offsets, 4, group_name)
    torch.library.opcheck(OPS.ep_dispatch, (xp, plan, group_name))
    torch.library.opcheck(OPS.ep_combine, (torch.randn(ep * 6, 3, requires_grad=True), plan, group_name))


def test_ep2_ops_match_single_process():
    run_distributed(body_ops, 2)


@pytest.mark.slow
def test_ep4_ops_match_single_process():
    run_distributed(body_ops, 4)


# ==================================================================================== single process
def test_padded_layout_is_sync_free():
    """The index math runs under FakeTensorMode: any .item()/.tolist()/nonzero (a host sync, a
    data-dependent size) would raise here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        lay = padded_layout(torch.zeros(2, 4, 3, dtype=torch.int64), 5)
    assert lay.src.shape == (20,) and lay.unpack_src.shape == (5,)


def test_ep_experts_eager_raises_and_has_the_global_shape():
    with pytest.raises(RuntimeError, match=r'ep_experts: .*parallelize_experts.*backend="moe".*explain'):
        OPS.ep_experts(torch.zeros(2, 3, 4), 4, "any group")
    assert ep_ops.EP_EXPERTS_ERROR.startswith("moe_compile.ep_experts:")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert OPS.ep_experts(torch.empty(2, 3, 4), 8, "any group").shape == (8, 3, 4)


def test_import_stays_light():
    code = ("import sys, moe_compile; assert 'moe_compile.parallel' not in sys.modules; "
            "assert 'torch.distributed.tensor' not in sys.modules; moe_compile.parallelize_experts")
    subprocess.run([sys.executable, "-c", code], check=True)


# ==================================================================================== parallelize_experts
def body_parallel(rank, ep, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from moe_compile import parallel as parallel_mod
    from moe_compile.parallel import EPInfo, ep_infos, parallelize_experts

    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    full = TinyMoE(e=2 * ep, bias=True)
    model = parallelize_experts(copy.deepcopy(full), mesh)
    el, rows = 2, slice(2 * rank, 2 * rank + 2)
    names = ("gate_up", "down", "gate_up_bias")
    assert ep_infos(model) == {"experts": EPInfo("experts", names, 2 * ep, ep, rank, mesh.get_group().group_name)}
    for n in names:
        # the shard keeps the Parameter's name (its FQN); the attribute is the class property, which
        # Dynamo calls (checked on torch 2.11 and 2.13) and eager code cannot compute with
        assert getattr(model.experts, n) is parallel_mod.OUTSIDE_COMPILE
        assert torch.equal(model.experts._parameters[n], full.experts.get_parameter(n)[rows])
    with pytest.raises(RuntimeError, match=r'ep_experts: .*backend="moe"'):
        model(*case_inputs("random_top2", ep, rank, 2 * ep, 4, 2, 8))  # eager reads the marker property

    # state_dict: original keys, Shard(0) DTensors of the global shape; loads DTensors and full tensors
    sd = model.state_dict()
    assert sd.keys() == full.state_dict().keys()
    for n in names:
        v = sd["experts." + n]
        assert isinstance(v, DTensor) and tuple(v.placements) == (Shard(0),), n
        assert v.shape == full.experts.get_parameter(n).shape and v.to_local().shape[0] == el, n
        assert torch.equal(v.full_tensor(), full.experts.get_parameter(n)), n
    other = TinyMoE(e=2 * ep, bias=True, seed=1)
    for source in (other.state_dict(), parallelize_experts(copy.deepcopy(other), mesh).state_dict()):
        fresh = parallelize_experts(TinyMoE(e=2 * ep, bias=True, seed=2), mesh)
        fresh.load_state_dict(source)
        for n in names:
            assert torch.equal(fresh.experts._parameters[n], other.experts.get_parameter(n)[rows]), n
    bad = {k: (v[:1] if k == "experts.down" else v) for k, v in other.state_dict().items()}
    with pytest.raises(RuntimeError, match="parallelize_experts expects the global"):
        fresh.load_state_dict(bad)

    # DCP: save at EP=ep, load into an unsharded model: same weights, same logits; and back
    dcp.save(model.state_dict(), checkpoint_id=f"{tmp}/ep")
    unsharded = TinyMoE(e=2 * ep, bias=True, seed=3)
    sd1 = unsharded.state_dict()
    dcp.load(sd1, checkpoint_id=f"{tmp}/ep", no_dist=True)
    unsharded.load_state_dict(sd1)
    inputs = case_inputs("random_top2", ep, rank, 2 * ep, 5, 2, 8)
    assert_close(unsharded(*inputs).detach(), ep_forward(model, *inputs).detach(), "DCP EP -> EP1 logits")
    if rank == 0:
        dcp.save(other.state_dict(), checkpoint_id=f"{tmp}/one", no_dist=True)
    dist.barrier()
    back = parallelize_experts(TinyMoE(e=2 * ep, bias=True, seed=4), mesh)
    sd2 = back.state_dict()
    dcp.load(sd2, checkpoint_id=f"{tmp}/one")
    back.load_state_dict(sd2)
    assert torch.equal(back.experts._parameters["down"], other.experts.down[rows])
    assert torch.equal(back.dense.weight, other.dense.weight)

    with pytest.raises(ValueError, match="has 3 experts, not divisible by the ep mesh size"):
        parallelize_experts(TinyMoE(e=3), mesh)
    two = nn.ModuleDict({"a": TinyMoE(e=2 * ep), "b": TinyMoE(e=3)})   # checked before anything is sharded
    with pytest.raises(ValueError, match="not divisible by the ep mesh size .*; nothing was sharded"):
        parallelize_experts(two, mesh)
    assert not moe_compile.parallel.ep_infos(two) and two.a.experts.gate_up.shape[0] == 2 * ep
    with pytest.raises(ValueError, match="name the expert containers instead: .*ExpertParallel"):
        parallelize_experts(TinyMoE(e=3), mesh)
    with pytest.raises(ValueError, match="nothing was sharded.$"):   # named already (ExpertParallel): no such hint
        parallelize_experts(TinyMoE(e=3).experts, mesh)
    # a loss of a forward before sharding still alive (review helper-66): its graph holds the experts'
    # gradient nodes at the full shape, and the next backward failed with "invalid gradient at index 2"
    kept = TinyMoE(e=2 * ep, bias=True, seed=5)
    loss = kept(*case_inputs("random_top2", ep, rank, 2 * ep, 5, 2, 8)).square().sum()
    with pytest.raises(ValueError, match="an autograd graph of an earlier forward still holds .*del loss"):
        parallelize_experts(kept, mesh)
    assert not moe_compile.parallel.ep_infos(kept) and kept.experts.gate_up.shape[0] == 2 * ep
    del loss
    parallelize_experts(kept, mesh)
    assert kept.experts._parameters["gate_up"].shape[0] == 2
    # the marker's backward (traced if a graph keeps it): the global gradient's rows of this rank
    ctx = types.SimpleNamespace(rows=el, group_name=mesh.get_group().group_name)
    grad = torch.randn(2 * ep, 3)
    assert torch.equal(ep_ops._ep_experts_bwd(ctx, grad)[0], grad[rows])


def test_ep2_parallelize_state_dict_and_dcp(tmp_path):
    run_distributed(body_parallel, 2, str(tmp_path))


# ==================================================================================== single process, ep = 1
@pytest.fixture(scope="module")
def mesh1(tmp_path_factory):
    """A one-rank gloo group in this process (expert containers, Dynamo, ModuleList: no peer needed)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "f"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


def test_parallelize_experts_bad_calls_name_the_problem(mesh1):
    from moe_compile.parallel import parallelize_experts

    model = parallelize_experts(TinyMoE(), mesh1)
    with pytest.raises(ValueError, match="already expert-parallel .*call it once per model"):
        parallelize_experts(model, mesh1)
    with pytest.raises(TypeError, match="expected a DeviceMesh, got ProcessGroup.*init_device_mesh"):
        parallelize_experts(TinyMoE(), mesh1.get_group())
    for bad in (0, -4, 2.5, True, "64"):
        with pytest.raises(ValueError, match=f"max_tokens must be a positive int .*got {bad!r}"):
            parallelize_experts(TinyMoE(), mesh1, max_tokens=bad)


@pytest.mark.parametrize("where", ["outside", "second_name"])
def test_tied_expert_parameter_raises_before_sharding(mesh1, where):
    """parallelize_experts cuts the user's Parameter objects to the rank's rows: one also held by a module
    outside the expert containers, or under a second name in its container (that name was left full-size
    in name, rank rows in value, and saved by DCP as replicated), raises naming both, with nothing sharded."""
    from moe_compile.parallel import parallelize_experts

    model = TinyMoE()
    w = model.experts.down
    if where == "outside":
        model.other = nn.Module()
        model.other.register_parameter("tied", w)
    else:
        model.experts.register_parameter("tied", w)
    shapes = [tuple(p.shape) for p in model.parameters()]
    with pytest.raises(ValueError, match=r"parallelize_experts: the expert Parameter .* is also .*tied.*Untie it"):
        parallelize_experts(model, mesh1)
    assert [tuple(p.shape) for p in model.parameters()] == shapes


@pytest.mark.parametrize("dynamic", [False, True])
def test_more_tokens_than_max_tokens_raises_named_error(mesh1, dynamic):
    """A rank holding more tokens than parallelize_experts' max_tokens fails with the bound and the fix
    (never a truncated batch), when the graph runs (every rank checks every rank's T: see
    test_ep_compiled.test_ep2_one_rank_over_max_tokens_raises_on_every_rank); with a symbolic T
    through the guard the compile put on T. Smaller counts still run afterwards."""
    from moe_compile.parallel import parallelize_experts
    from test_ep_compiled import LoopMoE

    model = parallelize_experts(LoopMoE(), mesh1, max_tokens=6)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe", dynamic=dynamic, options={"moe.inductor": False})

    def run(t):
        return compiled(torch.randn(t, 8), torch.zeros(t, 4))

    assert run(4).shape == (4, 8)
    with pytest.raises(Exception, match=r"rank 0 of the expert-parallel group holds 7 tokens in the MoE layer, more than "
                                        r"parallelize_experts\(\.\.\., max_tokens=6\) allows; give parallelize_experts a larger"):
        run(7)
    assert run(6).shape == (6, 8) and run(3).shape == (3, 8)


def test_marker_reaches_the_graph_and_raises_when_run(mesh1):
    from moe_compile.parallel import parallelize_experts

    model = parallelize_experts(TinyMoE(), mesh1)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(m, x):
        return x @ m.experts.gate_up[1]

    torch._dynamo.reset()
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"ep_experts: .*rewrites the MoE layer"):
        torch.compile(f, backend=record, fullgraph=True)(model, x)
    (marker,) = [n for n in graphs[0].graph.nodes if n.target in (OPS.ep_experts, OPS.ep_experts.default)]
    assert marker.args[0].op == "placeholder" and marker.args[1:] == (4, mesh1.get_group().group_name, 0)
    with pytest.raises(RuntimeError, match=r"ep_experts: .*rewrites the MoE layer"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(model, x)  # fake impl + autograd trace fine


class ExpertsWithRouter(nn.Module):
    """3-D experts and, in the same module, the router weight [E, H]: parallelize_experts takes the
    router for a per-expert bias and shards it (documented). ``alpha`` != 1 makes the combine one the
    backend refuses (index_add with alpha), so the experts' markers stay in the graph too."""

    def __init__(self, h=8, i=6, e=4, k=2, router_here=True, alpha=1.0):
        super().__init__()
        torch.manual_seed(0)
        self.k, self.alpha = k, alpha
        if router_here:
            self.router = nn.Parameter(torch.randn(e, h))
        else:
            self.gate = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.randn(e, h, 2 * i) * 0.1)
        self.down = nn.Parameter(torch.randn(e, i, h) * 0.1)

    def forward(self, x):
        logits = x @ self.router.t() if hasattr(self, "router") else self.gate(x)
        w, ids = logits.softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.gate_up.shape[0]):
            tok, slot = torch.where(ids == e)
            a, b = (x[tok] @ self.gate_up[e]).chunk(2, -1)
            y = (F.silu(a) * b) @ self.down[e] * w[tok, slot, None]
            out = out.index_add(0, tok, y, alpha=self.alpha) if self.alpha != 1 else out.index_add(0, tok, y)
        return out


class PerHeadScale(nn.Module):
    """Not an expert container: a 3-D Parameter [heads, 1, d] that parallelize_experts shards all the same."""

    def __init__(self, heads=4, d=2):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(heads, 1, d))

    def forward(self, x):
        return (x.unflatten(-1, (self.scale.shape[0], -1)).transpose(0, 1) * self.scale).transpose(0, 1).flatten(1)


class MoEAndHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = ExpertsWithRouter(router_here=False)
        self.heads = PerHeadScale()

    def forward(self, x):
        return self.heads(x) + self.moe(x)


def test_sharded_non_expert_module_error_names_the_plan_fix(mesh1):
    """parallelize_experts takes any module outside torch.nn with 3-D Parameters for an expert container;
    the compile error then names the module and how to shard only the experts (a parallelize_module
    plan with ExpertParallel), not only the router-beside-experts case."""
    from moe_compile.parallel import parallelize_experts

    model = parallelize_experts(MoEAndHeads(), mesh1)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="ep_markers: ") as err:
        torch.compile(model, backend="moe")(torch.randn(5, 8))
    text = str(err.value)
    assert "`scale` of module 'heads' (E=4)" in text and "no expert container at all" in text, text
    assert "moe_compile.ExpertParallel()" in text and "`gate_up`" not in text, text


@pytest.mark.parametrize("router_here, alpha, expect", [
    (True, 1.0, r"`router` of module '' \(E=4\), read at test_ep.py:\d+\..*a module of its own"),
    (False, 0.5, r"`gate_up` of module ''.*`down` of module ''.*Not rewritten in this graph: '' at test_ep.py:\d+: "
                 r"unsupported index_add.*\(fix: write expert outputs"),
])
def test_leftover_ep_markers_raise_at_compile_time(mesh1, caplog, router_here, alpha, expect):
    """A sharded Parameter that no rewrite replaced (the router beside the experts; a refused layer)
    fails the compile with its name, line, the refusal and the fix, not the marker's generic error on
    the first call (after a "nothing rewritten ... runs as the default backend" warning); explain()
    returns a report with the same error and the graph's regions, rewritten or refused."""
    from moe_compile.parallel import parallelize_experts

    model = parallelize_experts(ExpertsWithRouter(router_here=router_here, alpha=alpha), mesh1)
    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger="moe_compile"), pytest.raises(Exception, match="ep_markers: ") as err:
        torch.compile(model, backend="moe")(torch.randn(5, 8))
    assert re.search(expect, str(err.value)), str(err.value)
    assert "rewrote no MoE region" not in caplog.text
    report = moe_compile.explain(model, torch.randn(5, 8))
    assert len(report.errors) == 1 and re.search(expect, report.errors[0]), report.errors
    assert [r.status for r in report.regions] == (["refused"] if alpha != 1 else ["rewritten"]), str(report)
    if alpha != 1:
        assert report.refused[0].code == "unsupported_write" and report.refused[0].fix, str(report)
    assert "compile error: torch.compile(backend=\"moe\") raises this" in str(report)


class DroppingExperts(ExpertsWithRouter):
    """Low-weight slots get id E (dropped, as a capacity mask would): a layer no form matches."""

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(self.k, dim=-1)
        ids = torch.where(w < 0.3, torch.full_like(ids, self.gate_up.shape[0]), ids)
        out = torch.zeros_like(x)
        for e in range(self.gate_up.shape[0]):
            tok, slot = torch.where(ids == e)
            a, b = (x[tok] @ self.gate_up[e]).chunk(2, -1)
            out.index_add_(0, tok, (F.silu(a) * b) @ self.down[e] * w[tok, slot, None])
        return out


class BreakInExpertLoop(ExpertsWithRouter):
    """A graph break inside the expert loop: Dynamo gives up on the frame, runs the loop eagerly and
    compiles each read of the expert property as a graph of its own."""

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.gate_up.shape[0]):
            torch._dynamo.graph_break()
            tok, slot = torch.where(ids == e)
            a, b = (x[tok] @ self.gate_up[e]).chunk(2, -1)
            out.index_add_(0, tok, (F.silu(a) * b) @ self.down[e] * w[tok, slot, None])
        return out


def test_ep_markers_compiled_alone_after_a_graph_break_say_so(mesh1, caplog):
    """The leftover-marker error of a property compiled on its own (no user code reads it in that
    graph) points at the graph break that split the layer, which is logged with its fix."""
    from moe_compile.parallel import parallelize_experts

    model = parallelize_experts(BreakInExpertLoop(router_here=False), mesh1)
    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger="moe_compile"), \
            pytest.raises(Exception, match=r"ep_markers: .*No code of yours reads them in this graph.*graph break"):
        torch.compile(model, backend="moe", options={"moe.inductor": False})(torch.randn(6, 8))
    assert "graph break" in caplog.text, caplog.text


class DeadReadOfExperts(ExpertsWithRouter):
    """A read of the sharded weights that nothing uses (written into a temporary never read again):
    dead code the compile removes, not a leftover marker."""

    def forward(self, x):
        tmp = torch.zeros(4)
        tmp.add_(self.gate_up.sum((1, 2)))
        return super().forward(x)


class CheckpointedUp(ExpertsWithRouter):
    """Each expert's up projection under torch.utils.checkpoint: a nested body the finders do not
    assemble into the layer (refused), whose marker inputs have no Dynamo source name."""

    def forward(self, x):
        logits = self.gate(x)
        w, ids = logits.softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.gate_up.shape[0]):
            tok, slot = torch.where(ids == e)
            h = torch.utils.checkpoint.checkpoint(lambda r: r @ self.gate_up[e], x[tok], use_reentrant=False)
            a, b = h.chunk(2, -1)
            out = out.index_add(0, tok, (F.silu(a) * b) @ self.down[e] * w[tok, slot, None])
        return out


class LiveReadOfExperts(ExpertsWithRouter):
    """The sharded weights read outside the layer into live state, through ops ``_base`` does not
    follow as aliases (``.cpu()`` of a CPU tensor, ``atleast_2d``), a list write, a temporary that the
    output reads: each would run the marker on the first call."""

    def __init__(self, how):
        super().__init__(router_here=False)
        self.how = how
        self.register_buffer("usage", torch.zeros(4))

    def forward(self, x):
        norms = self.gate_up.detach().norm(dim=(1, 2))
        if self.how == "cpu_alias":
            self.usage.cpu().add_(norms)
        elif self.how == "atleast_2d":
            torch.atleast_2d(self.usage).add_(norms)
        elif self.how == "foreach":
            torch._foreach_add_([self.usage], [norms])
        acc = torch.zeros(4)
        if self.how == "temporary":
            acc.cpu().add_(norms)
        return super().forward(x) + acc.sum()


@pytest.mark.parametrize("how", ["cpu_alias", "atleast_2d", "foreach", "temporary"])
def test_live_reads_of_sharded_weights_fail_the_compile(mesh1, how):
    """Was: the compile passed (the write was taken for dead code) and the first call raised the
    marker's generic error from inside the graph."""
    from moe_compile.parallel import parallelize_experts

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"ep_markers: .*`gate_up` of module ''"):
        torch.compile(parallelize_experts(LiveReadOfExperts(how), mesh1), backend="moe")(torch.randn(7, 8))


def test_ep_markers_dead_reads_dynamic_shapes_and_failures(mesh1, monkeypatch):
    """Review of the compile-time check: a dead read compiles (and matches eager); parameters with
    dynamic shapes are rewritten (a legality rule hashed symbolic sizes: TypeError, so the layer was
    compiled unrewritten); a checkpointed body's marker is named by its Parameter; when the rewritten
    graph fails to compile, the error says so instead of blaming a router."""
    from moe_compile.parallel import parallelize_experts
    from moe_compile.records import recording

    x = torch.randn(7, 8)
    for cls, kw in ((DeadReadOfExperts, {}), (ExpertsWithRouter, {"dynamic": True})):
        ref = cls(router_here=False)
        model = parallelize_experts(copy.deepcopy(ref), mesh1)   # ep = 1: the same weights
        torch._dynamo.reset()
        with recording() as published, torch._dynamo.config.patch(force_parameter_static_shapes=False):
            out = torch.compile(model, backend="moe", options={"moe.inductor": False}, **kw)(x)
        assert [r.status for g in published for r in g] == ["rewritten"], published
        assert_close(out.detach(), ref(x).detach(), f"{cls.__name__} {kw}")

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"`gate_up` of module ''.*Not rewritten in this graph"):
        torch.compile(parallelize_experts(CheckpointedUp(router_here=False), mesh1), backend="moe")(x)

    import moe_compile.pipeline as pipeline

    def fail(*args, **kwargs):
        raise RuntimeError("a before_compile pass failed")

    monkeypatch.setattr(pipeline, "run_before_compile", fail)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"ep_markers: .*The rewritten graph failed to compile \(RuntimeError: a "
                                        r"before_compile pass failed\)"):
        torch.compile(parallelize_experts(ExpertsWithRouter(router_here=False), mesh1), backend="moe")(x)


class SwiGLU(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(h, i), nn.Linear(h, i), nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """Mixtral-style: ModuleList of SwiGLU experts, one by index, one by iteration."""

    def __init__(self, h=8, i=6, e=4, k=2):
        super().__init__()
        torch.manual_seed(0)
        self.k = k
        self.router = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(SwiGLU(h, i) for _ in range(e))

    def forward(self, x):
        w, ids = self.router(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            y = (self.experts[e] if e % 2 else expert)(x[tok])
            out = out.index_add(0, tok, y * w[tok, slot, None])
        return out


def test_stack_experts_matches_module_list():
    from moe_compile.parallel import StackedExperts, stack_experts

    ref, model = LoopMoE(), LoopMoE()
    old_sd = ref.state_dict()
    model.experts = stack_experts(model.experts)
    assert isinstance(model.experts, StackedExperts) and len(model.experts) == 4
    assert {k: tuple(v.shape) for k, v in model.experts.state_dict().items()} == {
        "w1_weight": (4, 6, 8), "w1_bias": (4, 6), "w3_weight": (4, 6, 8), "w3_bias": (4, 6), "w2_weight": (4, 8, 6)}
    x = torch.randn(9, 8)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out = ref(x1), model(x2)
    assert torch.equal(out, out_ref)
    cot = torch.linspace(-1, 1, out.numel()).view(out.shape)
    (out_ref * cot).sum().backward()
    (out * cot).sum().backward()
    assert torch.equal(x2.grad, x1.grad) and torch.equal(model.router.weight.grad, ref.router.weight.grad)
    for n in ("w1.weight", "w1.bias", "w3.weight", "w2.weight"):
        stacked = torch.stack([ex.get_parameter(n).grad for ex in ref.experts])
        assert torch.equal(model.experts.get_parameter(n.replace(".", "_")).grad, stacked), n
    fresh = LoopMoE()
    fresh.experts = stack_experts(fresh.experts)
    with torch.no_grad():
        fresh.experts.w2_weight.zero_()
    fresh.load_state_dict(old_sd)  # a ModuleList checkpoint still loads (keys stacked)
    assert torch.equal(fresh.experts.w2_weight, model.experts.w2_weight)


def test_module_list_refused_then_stacked_and_parallelized(mesh1):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from moe_compile import ExpertParallel, parallelize_experts, stack_experts
    from moe_compile.parallel import ep_info

    model = LoopMoE()
    with pytest.raises(ValueError, match=r"'experts' holds 4 experts as an nn.ModuleList.*stack_experts"):
        parallelize_experts(model, mesh1)
    model.experts = stack_experts(model.experts)
    parallelize_module(model, mesh1, {"experts": ExpertParallel()})
    info = ep_info(model.experts)
    assert info.names == ("w1_weight", "w1_bias", "w3_weight", "w3_bias", "w2_weight") and info.num_experts == 4
    assert isinstance(model.state_dict()["experts.w1_weight"], DTensor)
    with pytest.raises(RuntimeError, match="ep_experts"):
        model.experts[0](torch.randn(2, 8))  # the expert's Linear reads a view of the marker


HF_COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64, use_cache=False, head_dim=8)
HF_SPECS = {  # config class, model class, MoE overrides, expected sharded names
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[]), ("gate_up_proj", "down_proj")),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                intermediate_size=16, sliding_window=8),
                ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")),
}


@pytest.mark.parametrize("name", sorted(HF_SPECS))
def test_hf_experts_found(name, mesh1):
    transformers = pytest.importorskip("transformers")
    from moe_compile.parallel import ep_infos, parallelize_experts

    cfg_name, lm_name, kw, names = HF_SPECS[name]
    model = getattr(transformers, lm_name)._from_config(getattr(transformers, cfg_name)(**HF_COMMON, **kw))
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    parallelize_experts(model, mesh1)
    infos = ep_infos(model)
    assert set(infos) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert all(sorted(i.names) == sorted(names) and i.num_experts == 4 for i in infos.values()), infos
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes


def test_schedule_collectives_on_hand_built_graphs():
    """lowering/overlap.py on graphs built by hand: a graph without a moe_compile op keeps its order
    (its collectives are someone else's); with one, the collective is issued before work that
    does not feed it, its wait comes after that work, and an in-place write stays where it was relative
    to every other node (a barrier)."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers _c10d_functional)
    import torch.fx as fx

    from moe_compile.kernels import ops  # noqa: F401  (registers moe_compile::*)
    from moe_compile.lowering.overlap import schedule_collectives

    c10d, aten = torch.ops._c10d_functional, torch.ops.aten

    def build(with_movement: bool):
        g = fx.Graph()
        x, y = g.placeholder("x"), g.placeholder("y")
        before = g.call_function(aten.cos.default, (y,))                        # reads y before the write
        write = g.call_function(aten.add_.Tensor, (y, 1))                       # a barrier
        gate = g.call_function(aten.sin.default, (y,))                          # reads y after it; feeds the send
        rows = (g.call_function(torch.ops.moe_compile.swiglu.default, (gate,))
                if with_movement else g.call_function(aten.neg.default, (gate,)))
        other = g.call_function(aten.exp.default, (x,))                        # feeds no collective
        sent = g.call_function(c10d.all_gather_into_tensor.default, (rows, 2, "0"))
        got = g.call_function(c10d.wait_tensor.default, (sent,))
        g.output((before, write, other, got))
        return g

    g = build(False)
    before = [n.name for n in g.nodes]
    assert schedule_collectives(g) == 0 and [n.name for n in g.nodes] == before

    g = build(True)
    assert schedule_collectives(g) > 0
    order = [str(n.target).split(".")[-2] if n.op == "call_function" else n.name for n in g.nodes]
    pos = {name: i for i, name in enumerate(order)}
    assert pos["all_gather_into_tensor"] < pos["exp"] < pos["wait_tensor"], order    # work while rows travel
    assert pos["cos"] < pos["add_"] < pos["sin"], order                               # the barrier kept its place


def test_device_assert_messages_fit_cuda_limit():
    """CUDA refuses a device-side assert whose message has 255 characters or more (the CPU takes any):
    the messages our ops assert on the device fit, and device_assert fails on the CPU too for one
    that would not (it broke every GPU EP step once, unseen by CPU tests)."""
    from moe_compile.kernels.common import DEVICE_ASSERT_MAX_CHARS, device_assert
    from moe_compile.kernels.ep import SAME_TOKENS
    from moe_compile.kernels.ep_transport import same_rows_message

    for msg in (SAME_TOKENS, same_rows_message(2 ** 62)):
        assert len(msg) <= DEVICE_ASSERT_MAX_CHARS, msg
        device_assert(torch.tensor(True), msg)
    with pytest.raises(ValueError, match="message of 255 characters, CUDA takes at most 254"):
        device_assert(torch.tensor(True), "x" * 255)


def test_transport_of_a_process_group_made_again_is_its_own(tmp_path):
    """Review helper-115: transports were cached by group name, which a process group made after
    destroy_process_group takes again: select_transport gave the new group the destroyed one's transport
    (its collectives on a dead group, its size). In-process restarts and suites running EP jobs in turn."""
    from moe_compile.kernels.ep_transport import select_transport

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    groups, transports = [], []
    for run in range(2):
        store = dist.FileStore(str(tmp_path / f"store{run}"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            groups.append(dist.new_group([0]))
            transports.append(select_transport(groups[-1], torch.device("cpu")))
            assert transports[-1].group is groups[-1]
            assert transports[-1].exchange_counts(torch.tensor([3, 4])).tolist() == [3, 4]
        finally:
            dist.destroy_process_group()
    assert groups[0].group_name == groups[1].group_name   # the case: the same name, a new group
    assert transports[1] is not transports[0]


def test_clip_grad_norm_takes_inf_as_a_string(mesh1):
    """torch's clip_grad_norm_ takes norm_type="inf"; ours raised TypeError where it combines the expert shards'
    norms over the ep group (review helper-114). The max over every gradient, as torch's."""
    from moe_compile.parallel import clip_grad_norm_, parallelize_experts
    from test_ep_compiled import LoopMoE

    model = parallelize_experts(LoopMoE(), mesh1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    compiled(torch.randn(6, 8), torch.zeros(6, 4)).sum().backward()
    largest = max(p.grad.abs().max() for p in model.parameters() if p.grad is not None)
    assert torch.allclose(clip_grad_norm_(model, 1e-3, norm_type="inf"), largest)
