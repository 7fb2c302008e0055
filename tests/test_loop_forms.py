"""Per-expert loops end to end: backend="moe" output and every gradient match eager, or the region is
refused and the model runs as written.

Which spellings, routers and expert kinds are found is tested on Dynamo graphs in test_finders.py
(the whole matrix); here each spelling, expert kind, router and routing runs once through the
compiled pipeline against eager. Models come from ``helpers.LoopMoE``; routing is forced through the
router bias ("empty": experts 1 and E-1 get no token, "hot": every token picks experts 0..K-1).
"""
from __future__ import annotations

import pytest
import torch

import moe_compile
from helpers import check_compiled, make_input, make_model

FP32, BF16 = torch.float32, torch.bfloat16

# spellings that accept top-k > 1 (with the softmax -> topk -> renormalise router)
TOPK_SPELLINGS = ("where_setitem", "index_add", "one_hot", "bool_mask", "nonzero", "scatter_add", "index_put")


@pytest.mark.parametrize("spelling", TOPK_SPELLINGS)
def test_topk_spellings(spelling):
    m = make_model(spelling=spelling, k=2, e=4)
    check_compiled(m, [make_input((2, 5, 16))], expect_rewritten=1)


@pytest.mark.parametrize("spelling", ["where_setitem", "scatter_add"])
def test_topk_spellings_bf16(spelling):
    m = make_model(BF16, spelling=spelling, k=2, e=4)
    check_compiled(m, [make_input((2, 5, 16), BF16)], expect_rewritten=1)


@pytest.mark.parametrize("spelling", ["where_setitem", "bool_mask"])
def test_top1_spellings_argmax_router(spelling):
    """top-1 through an argmax router (ids [T, 1], weights gathered from the softmax)."""
    m = make_model(spelling=spelling, k=1, e=4, router="argmax")
    check_compiled(m, [make_input((9, 16))], expect_rewritten=1)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_top1_flat_ids(dtype):
    """argmax without keepdim: ids [T], weights [T], `torch.where(ids == i)[0]`."""
    m = make_model(dtype, spelling="where_flat", k=1, e=4, router="argmax_flat")
    check_compiled(m, [make_input((2, 5, 16), dtype)], expect_rewritten=1)


class _Top1Flat(torch.nn.Module):
    """Switch-style top-1 with ids [T] and weights [T] from ``max`` / ``argmax``, written back by index_add_ /
    index_select / scatter_add_ / index_put_ (helper-102: ``max`` and every write but ``out[tok] +=`` were
    refused as unsupported_write). A squeezed ``topk(1)`` stays unmatched: its ids are also a clustering's
    (Routing-Transformer attention, test_never_silent), which the finders would then report as refused MoE."""

    def __init__(self, router: str, write: str, e: int = 4, h: int = 16, f: int = 24, first: int = 0):
        super().__init__()
        self.router, self.write, self.first = router, write, first
        self.gate = torch.nn.Linear(h, e)
        self.experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(h, f), torch.nn.GELU(),
                                                               torch.nn.Linear(f, h)) for _ in range(e))

    def forward(self, x):
        p = self.gate(x).softmax(-1)
        if self.router == "max":
            w, ids = p.max(-1)
        else:   # argmax
            ids = p.argmax(-1)
            w = p.gather(-1, ids[:, None]).squeeze(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            if e < self.first:
                continue
            tok = torch.where(ids == e)[0]
            if self.write == "index_add":
                out.index_add_(0, tok, expert(x[tok]) * w[tok, None])
            elif self.write == "index_select":
                out.index_add_(0, tok, w[tok, None] * expert(x.index_select(0, tok)))
            elif self.write == "scatter_add":
                out.scatter_add_(0, tok[:, None].expand(-1, x.shape[-1]), expert(x[tok]) * w[tok, None])
            else:
                out.index_put_((tok,), expert(x[tok]) * w[tok, None], accumulate=True)
        return out


@pytest.mark.parametrize("router, write", [("max", "index_add"), ("argmax", "index_add"), ("max", "index_select"),
                                           ("argmax", "scatter_add"), ("max", "index_put")])
def test_top1_flat_ids_any_write(router, write):
    check_compiled(_Top1Flat(router, write), [make_input((13, 16))], expect_rewritten=1)


@pytest.mark.parametrize("routing", ["hot", "zero_tokens"])
def test_top1_flat_ids_hot_expert_and_zero_tokens(routing):
    m = _Top1Flat("max", "index_add")
    if routing == "hot":   # every token picks expert 2: the others get none
        with torch.no_grad():
            m.gate.bias.copy_(torch.tensor([0.0, 0.0, 100.0, 0.0]))
    check_compiled(m, [make_input((0 if routing == "zero_tokens" else 11, 16))], expect_rewritten=1,
                   fresh_inputs=0 if routing == "zero_tokens" else 1)


def test_a_loop_that_skips_expert_0_is_refused_naming_every_expert():
    """The refusal said "covers experts [1, 2, 3], not 0..2" (helper-102): 0..3 is the set it needs."""
    report = moe_compile.explain(_Top1Flat("max", "index_add", first=1), make_input((9, 16)))
    assert [(r.status, r.code) for r in report.regions] == [("refused", "expert_set")], str(report)
    assert "[1, 2, 3], not 0..3 " in report.regions[0].reason, report.regions[0].reason

class _NarrowScatter(torch.nn.Module):
    """scatter_add_ whose index covers ``cols`` columns of the [T, H] accumulator: eager adds only those (the
    rewrite added whole rows, or returned the experts' narrower rows as the output; review helper-105)."""

    def __init__(self, out_width: int, cols: int, h: int = 16, e: int = 4):
        super().__init__()
        self.cols = cols
        self.gate = torch.nn.Linear(h, e)
        self.experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(h, 24), torch.nn.GELU(),
                                                               torch.nn.Linear(24, out_width)) for _ in range(e))

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok = torch.where(ids == e)[0]
            out.scatter_add_(0, tok[:, None].expand(-1, self.cols), expert(x[tok]) * w[tok, None])
        return out


def test_scatter_add_of_narrower_expert_rows_is_refused():
    check_compiled(_NarrowScatter(8, 8), [make_input((9, 16))], expect_rewritten=0, expect_refused=1)


class _BroadcastRows(torch.nn.Module):
    """Experts of output width 1 added into a [T, H] accumulator: eager broadcasts each row over H columns
    (the rewrite returned [T, 1])."""

    def __init__(self, write: str, h: int = 16, e: int = 4):
        super().__init__()
        self.write = write
        self.gate = torch.nn.Linear(h, e)
        self.experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(h, 24), torch.nn.GELU(),
                                                               torch.nn.Linear(24, 1)) for _ in range(e))

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(2, -1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            y = expert(x[tok]) * w[tok, slot, None]
            if self.write == "iadd":
                out[tok] += y
            else:
                out.index_put_((tok,), y, accumulate=True)
        return out


@pytest.mark.parametrize("write", ["iadd", "index_put"])
def test_expert_rows_that_broadcast_into_the_output_are_refused(write):
    check_compiled(_BroadcastRows(write), [make_input((10, 16))], expect_rewritten=0, expect_refused=1)


class _FlatWeightsOnRows(torch.nn.Module):
    """``expert(x[tok]) * w[tok]``: [n, H] times [n] broadcasts over the columns in eager (it runs where n == H:
    column j times w[tok[j]]); the rewrite weighted rows (review helper-106)."""

    def __init__(self, h: int = 8):
        super().__init__()
        self.gate = torch.nn.Linear(h, 2)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(h, h) for _ in range(2))
        with torch.no_grad():   # the sign of x[:, 0] routes: 8 tokens each, n == H
            self.gate.weight.zero_()
            self.gate.bias.zero_()
            self.gate.weight[:, 0] = torch.tensor([10.0, -10.0])

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok = torch.where(ids == e)[0]
            out.index_add_(0, tok, expert(x[tok]) * w[tok])
        return out


def test_weights_without_a_column_dim_are_refused():
    x = make_input((16, 8))
    with torch.no_grad():
        x[:, 0] = torch.cat([torch.rand(8) * 0.2 + 0.01, -(torch.rand(8) * 0.2 + 0.01)])
    check_compiled(_FlatWeightsOnRows(), [x], expect_rewritten=0, expect_refused=1, fresh_inputs=0)


def test_scatter_add_of_some_columns_is_refused():
    """Full-width rows, an index of 4 columns (eager's backward raises on it: inference only)."""
    torch._dynamo.reset()
    model = _NarrowScatter(16, 4)
    before = dict(moe_compile.counters)
    compiled = torch.compile(model, backend="moe", options={"moe.inductor": False})
    with torch.no_grad():
        x = make_input((9, 16))
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)   # refused: run as written, no Inductor
    assert moe_compile.counters["rewritten"] == before.get("rewritten", 0), moe_compile.counters

def test_top1_flat_ids_bf16_inductor():
    m = _Top1Flat("max", "index_add").to(BF16)
    check_compiled(m, [make_input((2, 7, 16), BF16).view(14, 16)], expect_rewritten=1, inductor=True)


@pytest.mark.parametrize("spelling", ["assign", "assign_mask"])
def test_assign_top1_accepted(spelling):
    """`out[tok] = expert(x[tok]) * w` / `out[mask] = ...`: each token is written by one expert
    only, so the overwrite is a sum."""
    m = make_model(spelling=spelling, k=1, e=4, router="argmax")
    check_compiled(m, [make_input((11, 16))], expect_rewritten=1)


@pytest.mark.parametrize("spelling", ["assign_mask"])
def test_assign_top2_refused(spelling):
    """With top-2 the second expert overwrites the first: rewriting it as a sum would change the
    numbers, so the region is refused (with a reason) and the model still runs as written."""
    m = make_model(spelling=spelling, k=2, e=4)
    check_compiled(m, [make_input((11, 16))], expect_rewritten=0, expect_refused=1)
    rep = moe_compile.explain(make_model(spelling=spelling, k=2, e=4), make_input((11, 16)))
    assert [r.status for r in rep.regions] == ["refused"]
    assert "overwrites" in rep.regions[0].reason


@pytest.mark.parametrize("routing", ["empty", "hot"])
@pytest.mark.parametrize("spelling", ["where_setitem", "one_hot"])
def test_forced_routings(spelling, routing):
    """Experts with no tokens, and every token on the same K experts."""
    m = make_model(spelling=spelling, k=2, e=4, routing=routing)
    check_compiled(m, [make_input((7, 16))], expect_rewritten=1)


@pytest.mark.parametrize("routing", ["hot"])
def test_forced_routings_top1_bf16(routing):
    m = make_model(BF16, spelling="where_setitem", k=1, e=4, router="argmax", routing=routing)
    check_compiled(m, [make_input((3, 3, 16), BF16)], expect_rewritten=1)


@pytest.mark.parametrize("expert,dtype", [("gelu_seq", FP32), ("stacked_chunk", FP32), ("stacked_interleave", FP32),
                                          ("gptoss", FP32), ("gptoss", BF16)])
def test_expert_kinds(expert, dtype):
    """ModuleList of Linear-GELU-Linear with biases; 3-D stacked weights indexed per expert
    (F.linear + chunk, x @ W[e] + interleaved [..., ::2]); GPT-OSS clamped SwiGLU with biases (also
    in bf16: its biases and clamps round differently from the plain SwiGLU)."""
    m = make_model(dtype, spelling="index_add", expert=expert, k=2, e=4)
    check_compiled(m, [make_input((2, 5, 16), dtype)], expect_rewritten=1)


@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax", "sigmoid_group", "sort_slice", "topk_plus1"])
def test_routers(router):
    """sort_slice: the top-k as ``probs.sort(descending=True)`` and its first K (was unmatched, silent with
    the experts two modules down); topk_plus1: ``topk(K + 1)`` then ``ids[:, :K]`` (Shazeer's noisy top-k:
    was unmatched)."""
    m = make_model(spelling="index_add", router=router, k=2, e=4)
    check_compiled(m, [make_input((2, 5, 16))], expect_rewritten=1)


@pytest.mark.parametrize("dtype,shared,spelling", [(FP32, "add", "where_setitem"), (FP32, "base", "index_add"),
                                                   (FP32, "base", "bool_mask"), (BF16, "base", "where_setitem")])
def test_shared_expert(spelling, shared, dtype):
    """`out + shared(x)` after the loop, and an accumulator that starts from shared(x)."""
    m = make_model(dtype, spelling=spelling, shared=shared, k=2, e=4)
    check_compiled(m, [make_input((2, 5, 16), dtype)], expect_rewritten=1)


@pytest.mark.parametrize("t,e,k,h,i", [(1, 3, 2, 8, 5), (13, 5, 3, 24, 7), (17, 7, 1, 12, 9)])
def test_odd_sizes(t, e, k, h, i):
    """Sizes that are multiples of nothing; a single token; top-3."""
    router = "argmax" if k == 1 else "softmax_topk"
    m = make_model(spelling="where_setitem", e=e, k=k, h=h, i=i, router=router)
    check_compiled(m, [make_input((t, h))], expect_rewritten=1)


@pytest.mark.parametrize("expert", ["swiglu", "stacked_chunk"])
def test_zero_tokens(expert):
    """An MoE block called on zero tokens works compiled as in eager, forward and backward."""
    m = make_model(spelling="index_add", expert=expert, k=2, e=4)
    check_compiled(m, [make_input((0, 16))], expect_rewritten=1, fresh_inputs=0)


class VmapThenMoE(torch.nn.Module):
    """torch.vmap in the same graph as an MoE layer (as Jamba's associative_scan): Dynamo records the
    vmap nesting as calls without users or values, which the rewrite's dead-code removal must keep."""

    def __init__(self):
        super().__init__()
        self.moe = make_model(spelling="index_add", k=2, e=4)

    def forward(self, x):
        return self.moe(torch.vmap(lambda row: row * torch.sigmoid(row))(x))


def test_effect_only_calls_survive_the_rewrite():
    torch.manual_seed(0)
    check_compiled(VmapThenMoE(), [make_input((7, 16))], expect_rewritten=1)


class _ClampedExpert(torch.nn.Module):
    """GPT-OSS's clamped SwiGLU with its numbers as Python floats of each expert module."""

    def __init__(self, h: int, i: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(h, 2 * i, bias=False), torch.nn.Linear(i, h, bias=False)
        self.alpha, self.limit = 1.702, 7.0

    def forward(self, x):
        g, u = self.up(x).chunk(2, -1)
        u, g = u.clamp(-self.limit, self.limit), g.clamp(max=self.limit)   # -limit first: a number op (helper-80)
        return self.down((u + 1) * g * torch.sigmoid(g * (self.alpha * 1.0)))


class _ClampedLoop(torch.nn.Module):
    def __init__(self, h=16, i=24, e=4, k=2):
        super().__init__()
        torch.manual_seed(0)
        self.gate, self.k = torch.nn.Linear(h, e, bias=False), k
        self.experts = torch.nn.ModuleList(_ClampedExpert(h, i) for _ in range(e))

    def forward(self, x):
        x = x.reshape(-1, x.shape[-1])
        w, ids = torch.topk(self.gate(x).softmax(-1), self.k, -1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


@pytest.mark.parametrize("specialize_float", [False, True])
def test_dynamic_shapes_expert_floats(specialize_float, caplog):
    """dynamic=True passes each expert's Python floats as graph inputs of their own (symbolic floats whose values
    may differ per expert): refused with a reason naming dynamic=True (it said "expert-specific operand `item`,
    keep per-expert tensors to linear layers", a fix that does not apply). With floats specialized: rewritten."""
    x = make_input((3, 5, 16)) * 4   # past the clamp limit
    with torch._dynamo.config.patch(specialize_float=specialize_float), caplog.at_level("WARNING"):
        check_compiled(_ClampedLoop(), [x], expect_rewritten=int(specialize_float),
                       expect_refused=int(not specialize_float), dynamic=True)
    assert ("[expert_numbers_dynamic]" in caplog.text) != specialize_float, caplog.text


class _SwappedExpert(_ClampedExpert):
    def forward(self, x):
        g, u = self.up(x).chunk(2, -1)
        u, g = u.clamp(-self.limit, self.limit), g.clamp(max=self.limit)
        return self.down((g + 1) * u * torch.sigmoid(u * (self.alpha * 1.0)))


@pytest.mark.parametrize("where", ["scale", "clamp"])
def test_experts_differing_in_a_number_are_named_so(where, caplog):
    """ModuleList experts whose layers are the same but a Python number differs per expert (an output scale, a
    clamp bound) are refused (one grouped op applies one function); the reason said "differs in structure" and
    the fix "give every expert the same layers", which they have (review helper-90). Now expert_numbers_differ,
    naming the op and both numbers, with the fold-into-the-weight fix; a structural difference keeps
    experts_differ. Values and gradients as eager's."""
    model = _ClampedLoop()
    for j, expert in enumerate(model.experts):
        expert.limit = 0.5 + j if where == "clamp" else expert.limit
        expert.alpha = 1.702 * (1 + j) if where == "scale" else expert.alpha
    x = make_input((3, 5, 16)) * 4
    with caplog.at_level("WARNING"):
        check_compiled(model, [x], expect_rewritten=0, expect_refused=1)
    (line,) = [ln for ln in caplog.text.splitlines() if "[expert_numbers_differ]" in ln]
    want = "`clamp` (-1.5 where expert 0 has -0.5)" if where == "clamp" else "`mul` (3.404 where expert 0 has 1.702)"
    assert want in line and "experts_differ]" not in caplog.text, caplog.text

    model = _ClampedLoop()   # the same ops on swapped operands: their positions are no numbers (helper-91)
    swapped = _SwappedExpert(16, 24)
    swapped.load_state_dict(model.experts[1].state_dict())
    model.experts[1] = swapped
    with caplog.at_level("WARNING"):
        check_compiled(model, [x], expect_rewritten=0, expect_refused=1)
    assert "[experts_differ] " in caplog.text and "expert 1's" in caplog.text, caplog.text
    caplog.clear()

    model = _ClampedLoop()
    model.experts[2] = torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.GELU(), torch.nn.Linear(24, 16, bias=False))
    with caplog.at_level("WARNING"):
        check_compiled(model, [x], expect_rewritten=0, expect_refused=1)
    assert "[experts_differ] " in caplog.text, caplog.text
