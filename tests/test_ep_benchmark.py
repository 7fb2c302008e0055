"""examples/benchmark/ep.py on the CPU: its pure parts, and the whole benchmark at tiny shapes on 2 gloo ranks.

* the exposed-communication rule (|union(comm) minus union(compute)|) on hand-made intervals and on a
  hand-made chrome trace (user annotations ignored, kinds split);
* the FLOPs formulas (NeMo Automodel's, re-derived) against Automodel's own published table
  (NVIDIA-NeMo/Automodel docs/performance-summary.md, commit 01926a5: Qwen3 MoE 30B 277 TFLOPs/GPU at
  12,040 tokens/s/GPU; DeepSeek V3 671B 250 at 1,002 and 216 at 865): FLOPs per token = TFLOP/s / tokens/s;
* `ep.run(["--device", "cpu", "--tiny", ...])` in 2 processes: every variant runs (DeepEP: "blocked: no
  GPU"), the backend rewrote the moe variants' layers, the EP variants moved rows, and every variant's
  first-step loss equals the unsharded single-GPU variant's (same weights, same tokens).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import sys

import pytest

from dist_utils import run_distributed

EP_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "benchmark" / "ep.py"

# fp32 on the CPU, the same weights and tokens: sharded and unsharded runs differ only in the order of
# sums (grouped GEMM row groups, FSDP's reduce order): ~1e-7 measured, 100x margin.
LOSS_REL = 1e-5
# Automodel publishes TFLOP/s and tokens/s rounded to 3-5 digits: their ratio is known to ~0.2%.
TABLE_REL = 5e-3


def load_ep():
    if "ep_benchmark" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ep_benchmark", EP_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules["ep_benchmark"] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules["ep_benchmark"]


# ---------------------------------------------------------------------------------------------- pure parts
def test_uncovered_intervals():
    ep = load_ep()
    assert ep.merge([(3, 5), (0, 2), (1, 2.5), (7, 7)]) == [(0, 2.5), (3, 5)]
    assert ep.uncovered([(0, 10)], []) == 10
    assert ep.uncovered([(0, 10)], [(2, 4), (3, 5), (8, 12)]) == 2 + 3          # 0-2 and 5-8 exposed
    assert ep.uncovered([(0, 10)], [(-5, 20)]) == 0
    assert ep.uncovered([(0, 2), (4, 6)], [(1, 5)]) == 1 + 1
    assert ep.uncovered([(0, 2), (1, 3), (10, 11)], [(2.5, 10.5)]) == 2.5 + 0.5  # comm merged first


def test_exposed_comm_from_a_trace(tmp_path):
    ep = load_ep()
    events = [  # microseconds; two profiled steps
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "ts": 0,
         "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "ts": 4, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
         "ts": 12, "dur": 8},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 30, "dur": 2},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "nccl:all_to_all", "ts": 0, "dur": 40},  # ignored
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 40},                      # ignored on GPU
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = ep.exposed_comm(str(path), cpu=False, steps=2)
    assert got["comm_ms"] == pytest.approx(18 / 1e3 / 2)       # [0, 10) + [12, 20)
    assert got["exposed_ms"] == pytest.approx(10 / 1e3 / 2)    # [0, 4) + [14, 20)
    assert got["exposed_a2a_ms"] == pytest.approx(4 / 1e3 / 2)
    assert got["exposed_gather_ms"] == pytest.approx(6 / 1e3 / 2)
    assert got["idle_ms"] == pytest.approx((32 - 22) / 1e3 / 2)  # window [0, 32), busy 20 + 2


def test_flops_match_automodel_published_table():
    ep = load_ep()
    qwen3 = dataclasses.replace(ep.MODELS["qwen3"], layers=48, batch=1)   # Qwen3-30B-A3B, all 48 layers
    per_token = ep.automodel_qwen3_flops(qwen3, 1, 4096) / 4096
    assert per_token == pytest.approx(277e12 / 12040, rel=TABLE_REL)
    v3 = ep.ModelCfg("DeepSeek-V3 671B", layers=61, hidden=7168, vocab=129280, heads=128, moe_inter=2048, experts=256,
                     top_k=8, seq=4096, batch=1, shared=1, router="sigmoid", attn="mla", q_lora=1536, kv_lora=512,
                     qk_nope=128, qk_rope=64, v_head=128)
    per_token = ep.automodel_deepseekv3_flops(v3, 1, 4096, dense_layers=3, dense_inter=18432) / 4096
    assert per_token == pytest.approx(250e12 / 1002, rel=TABLE_REL)
    assert per_token == pytest.approx(216e12 / 865, rel=TABLE_REL)


# ---------------------------------------------------------------------------------------------- 2 gloo ranks
def body_tiny(rank, ws, argv, expect):
    ep = load_ep()
    rows = ep.run(list(argv))
    assert len(rows) == expect, [r.get("status") for r in rows]
    singles = {(r["level"], r["config"]): r for r in rows if r["variant"] == "single_moe"}
    for r in rows:
        what = f"{r['level']} {r['config']} {r['variant']} (rank {rank})"
        if r["variant"] == "ep_deepep":
            assert r["status"].startswith("blocked: no GPU"), f"{what}: {r['status']}"
            continue
        assert r["status"] == "ok", f"{what}: {r['status']}"
        assert r["tokens_s_gpu"] > 0 and r["tflops_gpu"] > 0, what
        ref = singles[(r["level"], r["config"])]["loss0"]
        assert abs(r["loss0"] - ref) <= LOSS_REL * abs(ref), f"{what}: loss0 {r['loss0']} vs single_moe {ref}"
        if r["variant"].startswith(("ep_moe", "single_moe")):
            assert r["rewritten"] >= 1, f"{what}: backend='moe' rewrote no MoE layer"
        if r["variant"].startswith("ep_"):
            assert r["ep"] == ws
            assert r["comm_ms"] > 0 and 0 <= r["exposed_ms"] <= r["comm_ms"] + 1e-9, f"{what}: {r}"
        if r["variant"] == "ep_titan":
            assert r["titan_mode"] == "graph", f"{what}: torchtitan-style dispatch did not compile into the graph"


FAST = ("--device", "cpu", "--tiny", "--steps", "1", "--warmup", "0", "--profile-steps", "1")


def test_ep_benchmark_tiny_layer_two_ranks():
    """One level and config: ours and the blocked DeepEP row (~20 s on 2 shared cores; the slow test below
    runs every variant)."""
    run_distributed(body_tiny, 2, FAST + ("--levels", "layer", "--configs", "qwen3", "--variants", "single_moe",
                                          "ep_moe", "ep_deepep"), 3, timeout_s=240)


@pytest.mark.slow
def test_ep_benchmark_tiny_everything_two_ranks():
    """What `torchrun --nproc_per_node 2 examples/benchmark/ep.py --device cpu --tiny` runs (~2 min)."""
    run_distributed(body_tiny, 2, FAST, 20, timeout_s=600)
