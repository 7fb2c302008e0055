"""transformers before 5.2x (the GPU image's 5.17): ``transformers::grouped_mm_fallback`` had a Python
backward that runs ``offs.tolist()``, which AOTAutograd cannot trace. The grouped forms the backend
substitutes for Hugging Face loops (moe_compile/hf_experts.py) must not put that op into a graph: a
refused region keeps it (JetMoE's attention experts) and the whole graph then failed to compile in
training.

transformers 5.17 does not import beside the huggingface-hub that 5.23 needs, so the old op is stood
in for: an op of the same schema with the same untraceable backward, in a ``torch.ops.transformers``
without ``grouped_mm_fallback_backward`` (5.17's namespace). With the stand-in, the code before the
fix failed to compile JetMoE (and refused DBRX and LongCat: the matcher does not know the stand-in's
name); now each is rewritten (JetMoE's attention experts refused with a reason) with every gradient
equal to eager's.
"""
from __future__ import annotations

import types

import pytest
import torch

import moe_compile.hf_experts as hf_experts
from helpers import HF_FP32_REL, check_compiled
from moe_compile import report

pytest.importorskip("transformers")
from test_forms_hf_eager import _ids, build  # noqa: E402  (needs transformers)
from test_hf_models import Logits  # noqa: E402


@torch.library.custom_op("moe_compile_test::old_grouped_mm_fallback", mutates_args=())
def _old_fallback(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(input.size(0), weight.size(2), dtype=input.dtype, device=input.device)
    start = 0
    for i, end in enumerate(offs.tolist()):
        out[start:end] = input[start:end] @ weight[i]
        start = end
    return out


@_old_fallback.register_fake
def _(input, weight, offs):
    return input.new_empty(input.size(0), weight.size(2))


def _old_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


def _old_backward(ctx, grad):   # transformers 5.17's shape: Python over offs.tolist(), not an op
    x, w = ctx.saved_tensors
    dx, dw, start = torch.zeros_like(x), torch.zeros_like(w), 0
    for i, end in enumerate(ctx.offs.tolist()):
        dx[start:end] = grad[start:end] @ w[i].T
        dw[i] = x[start:end].T @ grad[start:end]
        start = end
    return dx, dw, None


_old_fallback.register_autograd(_old_backward, setup_context=_old_setup)


@pytest.fixture
def transformers_517_ops(monkeypatch):
    import transformers.integrations.moe  # noqa: F401  (registers the real ops before they are hidden)
    monkeypatch.setattr(torch.ops, "transformers",
                        types.SimpleNamespace(grouped_mm_fallback=torch.ops.moe_compile_test.old_grouped_mm_fallback))
    assert not hf_experts._traceable_fallback()


CASES = [("jetmoe", 1, 1), ("dbrx", 1, 0), ("longcat_flash", 1, 0)]


@pytest.mark.parametrize("arch,rewritten,refused", CASES, ids=[c[0] for c in CASES])
def test_old_transformers_fallback_stays_out_of_graphs(transformers_517_ops, arch, rewritten, refused):
    with report.recording() as graphs:
        check_compiled(Logits(build(arch)), [_ids()], expect_rewritten=rewritten, expect_refused=refused,
                       rel=HF_FP32_REL, grad_rel=HF_FP32_REL, fresh_inputs=0)
    records = [r for g in graphs for r in g]
    assert all(r.status == "rewritten" or (r.reason and r.fix) for r in records), records
