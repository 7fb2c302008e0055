"""Print moe_compile.explain() for a small Hugging Face Qwen3-MoE block on this machine's device.

    python examples/benchmark/explain_hf.py [--debug]      # --debug: also the Dynamo graph's ops

A quick check that the HF ``grouped_mm`` experts path is rewritten with this torch/transformers
(spellings differ across versions and devices: e.g. histc on float ids on CPU, int ids on CUDA).
"""
from __future__ import annotations

import sys

import torch

import moe_compile


def main():
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True, experts_implementation="grouped_mm")
    cfg._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(cfg).to(device=device, dtype=dtype)
    x = torch.randn(2, 16, 64, device=device, dtype=dtype)

    def fn(t):
        out = block(t)
        return out[0] if isinstance(out, tuple) else out

    print(moe_compile.explain(fn, x))
    if "--debug" in sys.argv:
        def dump(gm, example_inputs):
            for n in gm.graph.nodes:
                if n.op in ("call_function", "call_method"):
                    ev = n.meta.get("example_value")
                    print(f"  {n.op:13s} {str(n.target)[:60]:60s} {tuple(ev.shape) if hasattr(ev, 'shape') else ''}")
            return gm.forward
        torch._dynamo.reset()
        torch.compile(fn, backend=dump)(x)


if __name__ == "__main__":
    main()
