"""The training examples run end to end on the CPU, in a subprocess as a user would run them:
examples/benchmark/model_step.py --tiny (every variant's row, the MoE layers rewritten, the time
split) and examples/train.py (the compiled loss curve tracks eager's; FSDP2 + expert parallelism
under torchrun in the slow set)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_STEP = os.path.join(ROOT, "examples", "benchmark", "model_step.py")
TRAIN = os.path.join(ROOT, "examples", "train.py")
# the compiled and the eager run start from the same weights and see the same batches; the rewritten
# layers sum in another order (~1e-7 relative per op in fp32), and training amplifies it: AdamW
# normalises each update, so weights with near-zero gradients move by up to +-lr either way. Measured
# |loss_moe - loss_eager| <= 4e-4 over 20 steps of the default model; 5x margin.
CURVE_ATOL = 2e-3
# Automodel publishes TFLOP/s/GPU (3 digits) and tokens/s/GPU (5 digits): their ratio, FLOPs per token,
# is known to ~0.2% (279 +- 0.5 of 279)
TABLE_REL = 3e-3
# --amp: the attention, router and LM-head products round to bf16 under autocast in both runs, at
# other points in the rewritten layers than in eager's; measured |loss_moe - loss_eager| <= 2.2e-3 over
# 16 steps of the default model on the CPU; 5x margin
AMP_CURVE_ATOL = 1e-2
# what autocast changes in the loss against the fp32 run (bf16 logits): ~1e-3 measured; fp32 runs of
# the same weights and batches agree to ~1e-6
AMP_VS_FP32_MIN = 1e-4
# the data can be learnt: 16 steps take the loss from ln(256) = 5.55 down by more than this (~1.4 measured)
MIN_LEARNT = 0.5


def test_flops_match_automodel_published_table():
    """examples/flops.py against NeMo Automodel's docs/performance-summary.md (DGX-H100, seq 4096):
    Qwen3 MoE 30B 277 TFLOP/s at 12,040 tokens/s, GPT-OSS 20B 279 at 13,058, DeepSeek V3 671B 250 at
    1,002 (transformers' default DeepseekV3Config is DeepSeek-V3)."""
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from flops import model_flops

    qwen3 = transformers.Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                        num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, vocab_size=151936, num_hidden_layers=48)
    for cfg, tflops, tokens in ((qwen3, 277, 12040), (transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32), 279, 13058),
                                (transformers.DeepseekV3Config(), 250, 1002)):
        per_token = model_flops(cfg, 1, 4096) / 4096
        assert per_token == pytest.approx(tflops * 1e12 / tokens, rel=TABLE_REL), type(cfg).__name__


def test_memory_peak_walks_the_allocator_trace():
    """moe_layer.py --memory-peak: the blocks alive at the trace's highest point, not at its end;
    frees of blocks allocated before the trace are ignored."""
    sys.path.insert(0, os.path.join(ROOT, "examples", "benchmark"))
    from moe_layer import peak_live

    trace = [dict(action="free_requested", addr=9), dict(action="alloc", addr=1, size=10),
             dict(action="alloc", addr=2, size=20), dict(action="free_requested", addr=1),
             dict(action="free_completed", addr=1), dict(action="alloc", addr=3, size=5),
             dict(action="alloc", addr=4, size=4)]
    best, live = peak_live(trace)
    assert best == 30 and sorted(live) == [1, 2]
    best, live = peak_live(trace + [dict(action="alloc", addr=5, size=2)])
    assert best == 31 and sorted(live) == [2, 3, 4, 5]


def test_time_split_skips_gpu_annotations():
    """model_step's time split on GPU events: a record_function range the profiler draws on the GPU
    timeline (Optimizer.step#AdamW.step around the optimizer's kernels) is not a kernel; counting it
    doubled the optimizer column."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    sys.path.insert(0, os.path.join(ROOT, "examples", "benchmark"))
    from model_step import time_split

    def ev(name, start, end, annotation=False):
        return NS(name=name, device_type=DeviceType.CUDA, time_range=NS(start=start, end=end), is_async=False,
                  is_user_annotation=annotation, linked_correlation_id=0, id=-1, cpu_parent=None)

    events = [ev("Optimizer.step#AdamW.step", 0, 1000, annotation=True),
              ev("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 0, 1000), ev("nvjet_gemm", 1000, 1500)]
    kernels = {}
    split = time_split(events, 2000, 1, "cuda", kernels)
    assert split["optimizer"] == 1.0 and split["gemm"] == 0.5 and split["host gaps"] == 0.5, split
    assert kernels[("not counted (GPU annotation)", "Optimizer.step#AdamW.step")] == 1.0


def test_time_split_counts_every_moe_compile_kernel_as_moe():
    """model_step's kernel-name rule: compiled graphs call our ops' implementations directly (no
    moe_compile:: op on the launch stack), so each Triton kernel of kernels/ must be named into the
    ``moe`` part; the fp32 weight gradient's ``_wgrad_kernel`` (69 ms of an autocast Qwen3 step) and
    GPT-OSS's ``_bias_grad_kernel`` counted as ``other`` before."""
    import ast
    import glob

    sys.path.insert(0, os.path.join(ROOT, "examples", "benchmark"))
    from model_step import classify

    def jitted(path):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                yield node.name

    names = [n for path in sorted(glob.glob(os.path.join(ROOT, "kernels", "*.py"))) for n in jitted(path)]
    assert len(names) >= 15, names   # the scan found the kernels
    assert {n: classify([n]) for n in names if classify([n]) != "moe"} == {}


def test_gap_causes_charges_idle_time_to_the_next_launch():
    """model_step --gaps: GPU idle time is charged to the host op that launched the kernel ending it,
    with its parents and without the CUDA runtime call; launch-latency gaps are left out."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    sys.path.insert(0, os.path.join(ROOT, "examples", "benchmark"))
    from model_step import gap_causes

    def cpu(name, id_, parent=None):
        return NS(name=name, device_type=DeviceType.CPU, id=id_, cpu_parent=parent, is_async=False)

    def gpu(name, start, end, corr):
        return NS(name=name, device_type=DeviceType.CUDA, time_range=NS(start=start, end=end), is_async=False,
                  is_user_annotation=False, linked_correlation_id=corr, id=-1, cpu_parent=None)

    bwd = cpu("CompiledFunctionBackward", 1)
    wgrad = cpu("moe_compile::grouped_mm_wgrad", 2, bwd)
    mm = cpu("aten::mm", 3)
    events = [bwd, wgrad, mm, cpu("cuLaunchKernelEx", 10, wgrad), cpu("cudaLaunchKernel", 11, mm),
              cpu("cudaLaunchKernel", 12, mm),
              gpu("gemm_a", 100, 200, 11),    # 100 us after the window opens: charged to aten::mm
              gpu("gemm_b", 201, 300, 12),    # 1 us: launch latency, left out
              gpu("quack_c", 350, 400, 10),   # 50 us: charged to the weight-gradient op and its parent
              gpu("quack_d", 380, 390, 10)]   # inside the last run: no gap
    causes = gap_causes(events, window_start=0, steps=2)
    assert causes == {"aten::mm": (0.05, 0.5),
                      "moe_compile::grouped_mm_wgrad < CompiledFunctionBackward": (0.025, 0.5)}, causes
    # torch 2.11 has no linked_correlation_id: the kernel shares its id with its launch call instead
    for e in events:
        if e.device_type == DeviceType.CUDA:
            e.id, e.linked_correlation_id = e.linked_correlation_id, 0
    assert gap_causes(events, window_start=0, steps=2) == causes


def _run(cmd, tmp_path, timeout=600, env=None):
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), **(env or {})})
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out.stdout


def _rows(tmp_path, args):
    stdout = _run([sys.executable, MODEL_STEP, "--tiny", "--json", "out.json", *args], tmp_path)
    table = [line for line in stdout.strip().splitlines() if line.startswith("|")]
    assert stdout.strip().splitlines()[-1] == table[-1], "the table is printed last"
    return json.load(open(tmp_path / "out.json"))["results"], table


def test_model_step_tiny(tmp_path):
    rows, table = _rows(tmp_path, ["--models", "qwen3", "--forms", "loop", "--variants", "eager", "moe", "--steps", "2",
                                   "--warmup", "0", "--profile-steps", "1", "--moe-option", "moe.inductor=False"])
    assert [(r["form"], r["variant"]) for r in rows] == [("loop", "eager"), ("loop", "moe")]
    assert len(table) == 2 + len(rows)
    for r in rows:
        assert "error" not in r, r
        assert r["tokens_s"] > 0 and r["tflops"] > 0 and r["step_ms"] > 0
        assert set(r["split_ms"]) == {"optimizer", "attention", "moe", "gemm", "other", "host gaps"}
        assert r["split_ms"]["optimizer"] > 0 and r["split_ms"]["attention"] > 0, r["split_ms"]
        # every MoE layer (2) runs rewritten code under backend="moe", none in eager
        assert r["moe_layers"] == (2 if r["variant"] == "moe" else 0), r
        # same weights, same first batch: the same first loss in every variant
        assert abs(r["loss"] - rows[0]["loss"]) <= 1e-4 * rows[0]["loss"], (r["loss"], rows[0]["loss"])


def test_model_step_tiny_fsdp(tmp_path):
    """--fsdp on one rank (FSDP2 per decoder layer and on the model, per-block compile): the MoE layers
    are rewritten, and the first loss is eager's."""
    rows, _ = _rows(tmp_path, ["--models", "qwen3", "--forms", "hf", "--variants", "eager", "moe", "--per-block",
                               "--fsdp", "--steps", "2", "--warmup", "0", "--profile-steps", "0",
                               "--moe-option", "moe.inductor=False"])
    assert [r.get("error") for r in rows] == [None, None], rows
    assert [r["rewritten"] for r in rows] == [0, 1]  # per block: one graph, every layer runs it
    assert all(r["sharded_params"] > 0 for r in rows), rows  # FSDP2 holds the Parameters
    assert abs(rows[1]["loss"] - rows[0]["loss"]) <= 1e-4 * rows[0]["loss"], rows


@pytest.mark.slow
def test_model_step_tiny_every_model_and_variant(tmp_path):
    rows, _ = _rows(tmp_path, ["--steps", "2", "--warmup", "0", "--profile-steps", "1"])
    assert len(rows) == 4 * 2 * 4 - 4  # models x forms x variants, less loop_inductor (needs --slow)
    for r in rows:
        if r["variant"] == "moe_cg":
            assert r["error"].startswith("skipped"), r
            continue
        assert "error" not in r, r
        assert r["moe_layers"] == (2 if r["variant"] == "moe" else 0), r


def _curves(path, names=("moe", "eager")):
    rows = list(csv.DictReader(open(path)))
    return tuple([float(r[f"loss_{n}"]) for r in rows] for n in names)


def test_train_tracks_eager(tmp_path):
    stdout = _run([sys.executable, TRAIN, "--steps", "16", "--layers", "2", "--out", "out"], tmp_path)
    assert "backend='moe' rewrote 2 MoE region(s)" in stdout
    moe, eager = _curves(tmp_path / "out" / "loss.csv")
    assert len(moe) == len(eager) == 16
    assert max(abs(a - b) for a, b in zip(moe, eager)) <= CURVE_ATOL, list(zip(moe, eager))
    assert moe[-1] < moe[0] - MIN_LEARNT, moe


def test_train_amp_tracks_eager(tmp_path):
    """--amp (fp32 weights, the forward under torch.autocast(bf16), HF Trainer's bf16=True): the
    compiled run tracks eager's under autocast, and autocast is on (the losses are not the fp32 run's)."""
    stdout = _run([sys.executable, TRAIN, "--amp", "--steps", "16", "--layers", "2", "--out", "amp"], tmp_path)
    assert "backend='moe' rewrote 2 MoE region(s)" in stdout and "under autocast(bfloat16)" in stdout
    moe, eager = _curves(tmp_path / "amp" / "loss.csv")
    assert max(abs(a - b) for a, b in zip(moe, eager)) <= AMP_CURVE_ATOL, list(zip(moe, eager))
    assert moe[-1] < moe[0] - MIN_LEARNT, moe
    _run([sys.executable, TRAIN, "--steps", "4", "--layers", "2", "--no-eager", "--out", "fp32"], tmp_path)
    (fp32,) = _curves(tmp_path / "fp32" / "loss.csv", names=("moe",))
    assert max(abs(a - b) for a, b in zip(moe, fp32)) > AMP_VS_FP32_MIN, list(zip(moe, fp32))


def test_train_grad_checkpointing_tracks_eager(tmp_path):
    """--grad-checkpointing (transformers' activation checkpointing in every run): both layers are
    still rewritten (inside the checkpointed calls) and the curve tracks eager's."""
    stdout = _run([sys.executable, TRAIN, "--grad-checkpointing", "--steps", "8", "--layers", "2", "--out", "ac"], tmp_path)
    assert "activation checkpointing" in stdout and "backend='moe' rewrote 2 MoE region(s)" in stdout
    moe, eager = _curves(tmp_path / "ac" / "loss.csv")
    assert max(abs(a - b) for a, b in zip(moe, eager)) <= CURVE_ATOL, list(zip(moe, eager))


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--ep", "2"], ["--compile", "blocks"]])
def test_train_torchrun_fsdp2(tmp_path, args):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]  # own port
    _run(torchrun + [TRAIN, "--steps", "6", "--out", "out", *args], tmp_path, env={"OMP_NUM_THREADS": "1"})
    moe, eager = _curves(tmp_path / "out" / "loss.csv")
    assert max(abs(a - b) for a, b in zip(moe, eager)) <= CURVE_ATOL, list(zip(moe, eager))


def test_gpu_clocks_summarises_the_samples_of_a_window():
    """ab.GpuClocks: nvidia-smi's lines (local timestamps) parsed, a window keeps only its own
    samples (median clock, largest power, OR of the throttle reasons), unreadable lines skipped."""
    import datetime

    sys.path.insert(0, os.path.join(ROOT, "examples", "benchmark"))
    from ab import GpuClocks

    lines = ["2026/11/24 08:18:11.309, 1470, 253.49, 0x0000000000000004\n", "[N/A], [N/A], [N/A], [N/A]\n",
             "2026/11/24 08:18:11.409, 1620, 307.37, 0x0000000000000000\n",
             "2026/11/24 08:18:11.509, 1800, 414.41, 0x0000000000000001\n"]
    clocks = GpuClocks(period_ms=1)
    clocks.proc = type("P", (), {"stdout": iter(lines)})()
    clocks._read()
    t = datetime.datetime.strptime("2026/11/24 08:18:11.300", "%Y/%m/%d %H:%M:%S.%f").timestamp()
    assert clocks.window(t, t + 0.15) == dict(sm_mhz=1545.0, power_w=307.37, throttle="0x4", samples=2)
    assert clocks.window(t, t + 0.3)["throttle"] == "0x5"
    assert clocks.window(t + 1, t + 2)["samples"] == 0
