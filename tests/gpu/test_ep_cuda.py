"""Expert parallelism on 2 GPUs (NCCL): the compiled training step is sync-free, runs under Inductor's
CUDA graphs, and matches the unsharded model. On a machine with one GPU it runs one rank (a group of
one: every op, collective and schedule of the compiled path, on NCCL, with nothing to exchange).

Run on the 2 x H200 kind with multicast off (MOE_EP_RANKS=4 on the 4-GPU kind):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 python -m pytest -q tests/gpu/test_ep_cuda.py
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import os
import tempfile

import pytest
import torch

if torch.cuda.device_count() < 1:
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# bf16, sharded vs unsharded on the same GPU kernels: the grouped GEMMs see other row groupings
# (different tile splits) and the gathered expert gradients another summation order; the same bound
# as helpers.BF16_REL / BF16_GRAD_REL for compiled-vs-eager bf16.
EP_BF16_REL = 3e-2
EP_BF16_GRAD_REL = 6e-2
# fp32 training steps, sharded vs unsharded (tests/test_ep_fsdp.py's FSDP_REL is 1e-5 on the CPU): on the
# GPU the grouped GEMMs multiply fp32 as tf32x3 (three tf32 products, ~1e-6 relative per product, against
# eager's fp32 matmuls), and two AdamW steps carry that into the weights; 10x margin over ~1e-5.
EP_FSDP_FP32_REL = 1e-4


def _rel(got, ref):
    return (got.double() - ref.double()).norm().item() / max(ref.double().norm().item(), 1e-12)


@contextlib.contextmanager
def _nccl_group(rank, world, init_file):
    """This process's GPU and NCCL group for a test body; afterwards the compiled graphs (and the CUDA
    graphs that captured NCCL work) are dropped before the group: with them alive
    destroy_process_group hung on 2 x H200."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        yield
    finally:
        torch.cuda.synchronize()
        torch._dynamo.reset()
        dist.destroy_process_group()


def _body(rank, world, init_file, cudagraphs, chunks):
    with _nccl_group(rank, world, init_file):
        import test_ep_compiled as cases
        from torch.distributed.device_mesh import init_device_mesh

        import moe_compile

        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
        torch.manual_seed(0)
        full = cases.LoopMoE(h=64, i=48, e=4 * world, k=2).cuda().to(torch.bfloat16)
        model = moe_compile.parallelize_experts(copy.deepcopy(full), mesh)
        opts = {"moe.ep_overlap_chunks": chunks, **({"triton.cudagraphs": True} if cudagraphs else {})}
        compiled = torch.compile(model, backend="moe", options=opts)
        gens = [torch.Generator(device="cuda").manual_seed(r) for r in range(world)]
        xs = [torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, generator=g) for g in gens]
        bias = torch.zeros(64, 4 * world, device="cuda", dtype=torch.bfloat16)
        for step in range(3):  # warm-up / recording steps, then steady state under the sync check
            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            if step == 2:
                torch.cuda.set_sync_debug_mode("error")
            out = compiled(xs[rank], bias)
            out.float().sum().backward()
            torch.cuda.set_sync_debug_mode(0)
            if step < 2:
                model.zero_grad(set_to_none=True)
        ref = copy.deepcopy(full)
        ref_out = ref(torch.cat(xs), torch.cat([bias] * world))
        ref_out.float().sum().backward()
        assert _rel(out.detach().float(), ref_out.detach()[rank * 64:(rank + 1) * 64].float()) <= EP_BF16_REL
        for name, p in model.experts.named_parameters():
            shards = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(shards, p.grad.contiguous())
            want = dict(ref.experts.named_parameters())[name].grad
            assert _rel(torch.cat(shards).float(), want.float()) <= EP_BF16_GRAD_REL, name


def _ranks() -> int:
    """MOE_EP_RANKS (4 on the 4-GPU kind), else up to 2; skips when the machine has fewer GPUs."""
    world = int(os.environ.get("MOE_EP_RANKS", min(torch.cuda.device_count(), 2)))
    if world > torch.cuda.device_count():
        pytest.skip(f"MOE_EP_RANKS={world} but {torch.cuda.device_count()} GPUs")
    return world


@pytest.mark.parametrize("chunks", [1, 2], ids=["chunks1", "chunks2"])   # 1: the default
@pytest.mark.parametrize("cudagraphs", [False, True], ids=["inductor", "cudagraphs"])
def test_ep2_step_sync_free_and_matches_unsharded(cudagraphs, chunks):
    world = _ranks()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_body, args=(world, os.path.join(tmp, "store"), cudagraphs, chunks), nprocs=world,
                           start_method="spawn")


def _uneven_body(rank, world, init_file):
    """max_tokens: token counts that differ between the ranks and between steps (one compiled graph for
    a symbolic count after the first); the step on a count seen before is sync-free, and its outputs
    and expert gradients match the unsharded model on the concatenated batch."""
    with _nccl_group(rank, world, init_file):
        import test_ep_compiled as cases
        from torch.distributed.device_mesh import init_device_mesh

        import moe_compile

        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
        torch.manual_seed(0)
        full = cases.LoopMoE(h=64, i=48, e=4 * world, k=2).cuda().to(torch.bfloat16)
        model = moe_compile.parallelize_experts(copy.deepcopy(full), mesh, max_tokens=64)
        compiled = torch.compile(model, backend="moe")
        for step, base in enumerate((40, 64, 23, 40)):
            ts = [max(1, base - 17 * r) for r in range(world)]
            gens = [torch.Generator(device="cuda").manual_seed(10 * step + r) for r in range(world)]
            xs = [torch.randn(t, 64, device="cuda", dtype=torch.bfloat16, generator=g) for t, g in zip(ts, gens)]
            bias = [torch.zeros(t, 4 * world, device="cuda", dtype=torch.bfloat16) for t in ts]
            model.zero_grad(set_to_none=True)
            if step == 3:   # the counts of step 0 again: no compile, so no host sync allowed
                torch.cuda.set_sync_debug_mode("error")
            out = compiled(xs[rank], bias[rank])
            out.float().sum().backward()
            torch.cuda.set_sync_debug_mode(0)
            # every step's outputs (rank 0 holds exactly max_tokens at step 1): the data-dependent path
            # gave rank 0 wrong outputs there under Inductor (_masked_body)
            with torch.no_grad():
                step_ref = full(torch.cat(xs), torch.cat(bias))
            start = sum(ts[:rank])
            assert _rel(out.detach().float(), step_ref[start:start + ts[rank]].float()) <= EP_BF16_REL, \
                f"step {step} (counts {ts}): rank {rank} output"
        ref = copy.deepcopy(full)
        ref_out = ref(torch.cat(xs), torch.cat(bias))
        ref_out.float().sum().backward()
        start = sum(ts[:rank])
        assert _rel(out.detach().float(), ref_out.detach()[start:start + ts[rank]].float()) <= EP_BF16_REL
        for name, p in model.experts.named_parameters():
            shards = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(shards, p.grad.contiguous())
            want = dict(ref.experts.named_parameters())[name].grad
            assert _rel(torch.cat(shards).float(), want.float()) <= EP_BF16_GRAD_REL, name


def _masked_body(rank, world, init_file, inductor):
    """max_tokens with a data-dependent T (tokens picked by a mask inside the compiled model): without
    Inductor, outputs match the unsharded model and a count above the bound raises the named error;
    under Inductor the compile refuses it (on 2 x H200, torch 2.11, rank 0 got wrong outputs when it
    held exactly max_tokens tokens: rel 0.077 against 0.005)."""
    import pytest as _pytest
    with _nccl_group(rank, world, init_file):
        import test_ep_compiled as cases
        from torch.distributed.device_mesh import init_device_mesh

        import moe_compile

        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
        torch.manual_seed(0)
        full = cases.MaskedTokens(cases.LoopMoE(h=64, i=48, e=4 * world, k=2)).cuda().to(torch.bfloat16)
        model = moe_compile.parallelize_experts(copy.deepcopy(full), mesh, max_tokens=64)
        compiled = torch.compile(model, backend="moe", options={"moe.inductor": inductor})
        for step, count in enumerate((40, 64, 65, 23)):
            gens = [torch.Generator(device="cuda").manual_seed(10 * step + r) for r in range(world)]
            xs = [torch.randn(80, 64, device="cuda", dtype=torch.bfloat16, generator=g) for g in gens]
            bias = [torch.randn(80, 4 * world, device="cuda", dtype=torch.bfloat16, generator=g) for g in gens]
            masks = [torch.arange(80, device="cuda") < count for _ in range(world)]
            if inductor:
                with _pytest.raises(Exception, match="data-dependent inside the compiled graph"):
                    compiled(xs[rank], masks[rank], bias[rank])
                return
            if count > 64:
                with _pytest.raises(RuntimeError, match="this rank holds 65 tokens .*max_tokens=64"):
                    compiled(xs[rank], masks[rank], bias[rank])
                continue
            out = compiled(xs[rank], masks[rank], bias[rank])
            ref = full.moe(torch.cat([x[m] for x, m in zip(xs, masks)]), torch.cat([b[m] for b, m in zip(bias, masks)]))
            got = out[masks[rank]]
            assert _rel(got.float(), ref[rank * count:(rank + 1) * count].float()) <= EP_BF16_REL, f"step {step}"


@pytest.mark.parametrize("inductor", [False, True], ids=["aot_eager", "inductor_refused"])
def test_ep_max_tokens_with_data_dependent_counts(inductor):
    world = _ranks()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_masked_body, args=(world, os.path.join(tmp, "store"), inductor), nprocs=world,
                           start_method="spawn")


def test_ep_token_counts_differ_between_ranks_and_steps():
    world = _ranks()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_uneven_body, args=(world, os.path.join(tmp, "store")), nprocs=world, start_method="spawn")


def _fsdp_body(rank, world, init_file, dp, cpu_built=False, loop=False):
    with _nccl_group(rank, world, init_file):
        import test_ep_fsdp as cases

        cases.body_train(rank, world, dp=dp, device="cuda", rel=EP_FSDP_FP32_REL, cpu_built=cpu_built, loop=loop)


def _replicated_body(rank, world, init_file, dp):
    with _nccl_group(rank, world, init_file):
        import test_ep_fsdp as cases

        cases.body_replicated_over_dp(rank, world, dp, False, device="cuda", rel=EP_FSDP_FP32_REL)


def test_replicate_experts_over_dp_trains_under_checkpointing():
    """replicate_experts over dp ranks on NCCL (its gradient all-reduce is a functional collective in
    the traced backward), the MoE under activation checkpointing: every rank a dp rank (ep = 1), and
    dp = 2 x ep = 2 on four GPUs. Matches the unsharded model after two AdamW steps with clipping."""
    pytest.importorskip("transformers")
    world = _ranks()
    if world < 2:
        pytest.skip("replicate_experts needs dp >= 2: MOE_EP_RANKS=2 on the 2-GPU kind")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_replicated_body, args=(world, os.path.join(tmp, "store"), 2), nprocs=world,
                           start_method="spawn")


def test_ep_fsdp2_loop_form_trains_like_unsharded():
    """Loop-form experts (W[e] read once per expert) under FSDP2's DTensor experts, on any number of
    ranks (one included): torch 2.11 traces each read's to_local() as its own closure, which the region
    finder once took for different weights (the compile raised the ep_markers error)."""
    pytest.importorskip("transformers")
    world = _ranks()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_fsdp_body, args=(world, os.path.join(tmp, "store"), 1, False, True), nprocs=world,
                           start_method="spawn")


@pytest.mark.parametrize("dp", [1], ids=["experts_local"])
def test_ep_fsdp2_trains_like_unsharded(dp):
    """FSDP2 + expert parallelism on NCCL: dp=1 (the experts out of FSDP; over dp > 1,
    fully_shard_experts raises and replicate_experts is the layout: the next test)."""
    pytest.importorskip("transformers")
    world = _ranks()
    if world // dp < 2 or world % dp:
        pytest.skip(f"dp={dp} needs ep >= 2: {world} ranks (MOE_EP_RANKS=4 on the 4-GPU kind)")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_fsdp_body, args=(world, os.path.join(tmp, "store"), dp), nprocs=world,
                           start_method="spawn")


def test_ep_fsdp2_model_built_on_cpu_moves_to_gpu():
    """A model built (or loaded) on the CPU and moved by fully_shard, as Hugging Face users do:
    fully_shard moves the Parameters it manages, not its ignored_params; the experts kept out of FSDP
    (dp = 1) reach the GPU through fsdp_ignored_params (DTensor.from_local moves the rows to the
    mesh's device), then it trains like the unsharded model. One GPU suffices (ep = 1: the same
    recipe, nothing to exchange). H200, torch 2.11: passes with and without an explicit move."""
    pytest.importorskip("transformers")
    world = _ranks()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_fsdp_body, args=(world, os.path.join(tmp, "store"), 1, True), nprocs=world,
                           start_method="spawn")


def _ddp_body(rank, world, init_file):
    with _nccl_group(rank, world, init_file):
        import test_ep_ddp as cases

        cases.body_ep_under_ddp(rank, world, device="cuda", inductor=True, rel=EP_FSDP_FP32_REL)


def test_ep_under_ddp_trains_like_unsharded():
    """Expert parallelism under DistributedDataParallel on NCCL through Inductor: the recipe
    (replicate_experts before DDP) trains like the unsharded model; the wrong compositions raise."""
    pytest.importorskip("transformers")
    world = _ranks()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_ddp_body, args=(world, os.path.join(tmp, "store")), nprocs=world, start_method="spawn")
