"""The weights_in_swiglu pass end to end: a weighted combine after a bias-free down projection of a
SwiGLU becomes weighted_swiglu + unpermute_sum; outputs and every gradient (the router's included:
its gradient now comes from the activation's backward) match eager, or the pass leaves the combine.

Each case asserts which combine the compiled graph runs, so a pass that did not fire fails.
"""
from __future__ import annotations

import pytest
import torch

from helpers import check_compiled, make_input, make_model
from moe_compile import report

FP32, BF16 = torch.float32, torch.bfloat16
MOVED = ("weighted_swiglu", "unpermute_sum")


def _compiled_ops(model, x, **kw) -> list[tuple[str, ...]]:
    """Compile ``model`` against eager (outputs, every gradient); the ops of each rewritten region."""
    with report.recording() as graphs:
        check_compiled(model, [x], expect_rewritten=1, **kw)
    return [r.ops for g in graphs for r in g if r.status == "rewritten"]


def _moved(ops: tuple[str, ...]) -> bool:
    return all(op in ops for op in MOVED) and "unpermute_combine" not in ops and "swiglu" not in ops


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("expert", ["swiglu", "stacked_chunk"])
def test_weights_move_into_the_activation(expert, dtype):
    """ModuleList SwiGLU experts and 3-D weights ([gate; up] halves)."""
    m = make_model(dtype, spelling="index_add", k=2, e=4, expert=expert)
    (ops,) = _compiled_ops(m, make_input((2, 7, 16), dtype))
    assert _moved(ops), ops


@pytest.mark.parametrize("routing", ["empty", "hot"])
@pytest.mark.parametrize("router,k", [("softmax_topk", 2), ("argmax", 1), ("sigmoid_group", 2),
                                      ("topk_softmax", 3)])
def test_routers_and_routings(router, k, routing):
    """Top-1 and top-k, DeepSeek-V3's scaled group-limited weights; experts without tokens, one hot expert."""
    m = make_model(spelling="where_setitem", k=k, e=8 if router == "sigmoid_group" else 4, router=router,
                   routing=routing)
    (ops,) = _compiled_ops(m, make_input((11, 16)))
    assert _moved(ops), ops


def test_zero_tokens_and_inductor():
    m = make_model(BF16, spelling="index_add", k=2, e=4)
    (ops,) = _compiled_ops(m, make_input((0, 16), BF16), inductor=True, fresh_inputs=0)
    assert _moved(ops), ops
    (ops,) = _compiled_ops(m, make_input((3, 5, 16), BF16), inductor=True)
    assert _moved(ops), ops


@pytest.mark.parametrize("expert", ["gelu_seq", "gptoss", "stacked_interleave"])
def test_biased_or_other_experts_keep_the_weighted_combine(expert):
    """A down projection with a bias (w * (a W + b) != (w a) W + b), another activation, or a SwiGLU
    the swiglu pass does not fuse (interleaved gate/up columns): unchanged."""
    m = make_model(spelling="index_add", k=2, e=4, expert=expert)
    (ops,) = _compiled_ops(m, make_input((9, 16)))
    assert "unpermute_combine" in ops and not any(op in ops for op in MOVED), ops


def test_down_projection_bias_keeps_the_weighted_combine():
    """SwiGLU experts whose down projection (w2) has a bias: the activation is fused (so the pass
    sees the chain) but w * (a W + b) != (w a) W + b, so the combine keeps its weights."""
    m = make_model(spelling="index_add", k=2, e=4)
    for expert in m.experts.experts:
        expert.w2 = torch.nn.Linear(expert.w2.in_features, expert.w2.out_features, bias=True)
    (ops,) = _compiled_ops(m, make_input((9, 16)))
    assert "swiglu" in ops and "unpermute_combine" in ops and not any(op in ops for op in MOVED), ops


def test_pass_can_be_disabled():
    m = make_model(spelling="index_add", k=2, e=4)
    (ops,) = _compiled_ops(m, make_input((9, 16)), options={"moe.disable": ("weights_in_swiglu",)})
    assert "unpermute_combine" in ops and "swiglu" in ops and "weighted_swiglu" not in ops, ops


def _matches_with_an_extra_reader(opname: str, operand) -> tuple[int, int]:
    """find_weights_in_swiglu on the rewritten loop layer (the pass off): matches as lowered, and
    after the ``operand(node)`` of its one ``opname`` node is also summed into a graph output."""
    from graphs import rewrite
    from moe_compile.passes.weights_in_swiglu import find_weights_in_swiglu

    new, _ = rewrite(("loop", "index_add", 2, "softmax_topk", "swiglu", None), disable=("weights_in_swiglu",))
    before = len(find_weights_in_swiglu(new))
    (node,) = [n for n in new.graph.nodes if getattr(n.target, "_opname", "") == opname]
    with new.graph.inserting_after(node):
        extra = new.graph.call_function(torch.ops.aten.sum.default, (operand(node),))
    out = next(n for n in new.graph.nodes if n.op == "output")
    out.args = (tuple(out.args[0]) + (extra,),) if isinstance(out.args[0], (tuple, list)) else ((out.args[0], extra),)
    return before, len(find_weights_in_swiglu(new))


@pytest.mark.parametrize("opname,operand", [("unpermute_combine", lambda n: n.args[0]), ("swiglu", lambda n: n)],
                         ids=["expert_outputs", "activation"])
def test_values_read_elsewhere_keep_the_weighted_combine(opname, operand):
    """The expert outputs y or the SwiGLU output also read elsewhere: their values would change, no match."""
    assert _matches_with_an_extra_reader(opname, operand) == (1, 0)


class _Fp16Experts(torch.nn.Module):
    """fp16 SwiGLU experts in a loop, fp32 routing weights scaled by ``scale``, an fp32 accumulator: eager
    multiplies each fp16 expert row by its fp32 weight in fp32."""

    def __init__(self, scale, h=16, i=32, e=8, k=2):
        super().__init__()
        from helpers import SwiGLU

        self.gate = torch.nn.Linear(h, e, bias=False).half()
        self.experts = torch.nn.ModuleList(SwiGLU(h, i) for _ in range(e)).half()
        self.scale, self.h, self.e, self.k = scale, h, e, k

    def forward(self, x):
        x = x.reshape(-1, self.h)
        w, ids = torch.topk(torch.softmax(self.gate(x), dim=-1, dtype=torch.float32), self.k, dim=-1)
        w = w * self.scale
        out = torch.zeros(x.shape[0], self.h, dtype=torch.promote_types(x.dtype, torch.float32))
        for j in range(self.e):
            tok, slot = torch.where(ids == j)
            out.index_add_(0, tok, self.experts[j](x[tok]) * w[tok, slot, None])
        return out


@pytest.mark.parametrize("scale,x_scale", [(300.0, 20.0), (1e-5, 1.0)], ids=["overflow", "underflow"])
def test_fp16_rows_keep_the_weighted_combine(scale, x_scale):
    """fp16 expert rows: the weighted activation would round w * swiglu(h) to fp16, where eager's y * w
    is an fp32 product; weights 300 on rows 20 overflowed to NaN (eager finite), weights 1e-5 lost their
    digits (7e-2 off). Found by review; fp16 keeps the weighted combine. Outputs only: eager's own fp16
    gradients overflow in the first case, and in the second sit in fp16's subnormal range (eager's input
    gradient 8e-2 from an fp64 run, ours 6e-2: no reference to compare with)."""
    torch.manual_seed(25)
    x = (make_input((32, 16), torch.float32, requires_grad=False) * x_scale).half().requires_grad_()
    (ops,) = _compiled_ops(_Fp16Experts(scale), x, grads=False)
    assert "unpermute_combine" in ops and "weighted_swiglu" not in ops, ops
