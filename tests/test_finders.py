"""Finders and legality on Dynamo graphs (tests/graphs.py): what is found, accepted or refused, and why.

No AOTAutograd or Inductor: each test reads the candidates and verdicts of one captured graph (the
spelling this torch's Dynamo really produces), so the whole matrix of spellings x routers x expert
kinds runs in seconds. The numeric contract (outputs and every gradient against eager) is tested
end to end in test_loop_forms.py / test_grouped_forms.py on a subset of the same models.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

from graphs import check_all, dynamo_graph, ops_in, rewrite
from moe_compile.passes.legality import Accepted, Refusal, check
from moe_compile.passes.normalize import canon
from moe_compile.passes.region import AccumulateInPlace, Candidate, ReplaceOutput

TOPK_SPELLINGS = ("where_setitem", "index_add", "one_hot", "bool_mask", "nonzero", "scatter_add", "index_put")
EXPERTS = ("swiglu", "gelu_seq", "stacked_chunk", "stacked_interleave", "gptoss")


def _one(spec) -> Accepted | Refusal:
    verdicts = check_all(dynamo_graph(spec)[0])
    assert len(verdicts) == 1, f"{spec}: {verdicts}"
    return verdicts[0]


def _accepted(spec, k=2, e=4):
    v = _one(spec)
    assert isinstance(v, Accepted), f"{spec}: refused: {v}"
    r = v.region
    assert (r.router.top_k, r.router.num_experts) == (k, e)
    assert r.router.weights is not None and r.router.weights.graph is r.x.graph
    assert sum(1 for st in r.experts.steps if st.linear) >= 2
    return r


def _multiplies_rows(region) -> bool:
    """The weights node is what the graph multiplies into the expert output (through views/gathers)."""
    seen, stack = set(), [region.router.weights]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if canon(n) == "mul" and any(m in region.nodes for m in n.all_input_nodes):
            return True
        stack.extend(n.users)
    return False


@pytest.mark.parametrize("spelling", TOPK_SPELLINGS)
def test_loop_topk_spellings_found(spelling):
    r = _accepted(("loop", spelling, 2, "softmax_topk", "swiglu", None))
    assert isinstance(r.combine, AccumulateInPlace) and r.form.startswith("loop/")
    assert len(r.experts.slots[r.experts.steps[0].linear[0]]) == 4  # one weight per expert
    assert _multiplies_rows(r)


@pytest.mark.parametrize("spelling", TOPK_SPELLINGS + ("assign", "assign_mask"))
def test_loop_top1_spellings_found(spelling):
    _accepted(("loop", spelling, 1, "argmax", "swiglu", None), k=1)


@pytest.mark.parametrize("expert", EXPERTS)
@pytest.mark.parametrize("spelling", ["where_setitem", "index_add", "bool_mask"])
def test_loop_expert_kinds_found(expert, spelling):
    r = _accepted(("loop", spelling, 2, "softmax_topk", expert, None))
    biases = [st.linear[1] for st in r.experts.steps if st.linear]
    assert (None not in biases) == (expert in ("gelu_seq", "gptoss"))


@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax", "sigmoid_group"])
@pytest.mark.parametrize("spelling", ["where_setitem", "index_add"])
def test_loop_routers_found(router, spelling):
    _accepted(("loop", spelling, 2, router, "swiglu", None))


@pytest.mark.parametrize("shared", ["add", "base"])
@pytest.mark.parametrize("spelling", ["where_setitem", "index_add", "bool_mask"])
def test_loop_shared_expert_found(spelling, shared):
    r = _accepted(("loop", spelling, 2, "softmax_topk", "swiglu", shared))
    assert (r.combine.base is not None) == (shared == "base")


@pytest.mark.parametrize("spelling", ["assign", "assign_mask"])
def test_loop_overwrite_with_topk_refused(spelling):
    v = _one(("loop", spelling, 2, "softmax_topk", "swiglu", None))
    assert isinstance(v, Refusal) and v.code == "overwrite_topk" and "overwrites" in v.message and v.fix


GROUPED = [("sorted", {}), ("sorted", {"counts": "one_hot", "combine": "argsort", "weigh": "view", "sort": "argsort"}),
           ("sorted", {"combine": "index_add"}), ("sorted", {"combine": "scatter_add", "bias": True}),
           ("sorted", {"sentinel": True, "bias": True}), ("sorted", {"k": 1, "router": "argmax_flat"}),
           ("batched", {}), ("batched", {"bias": True}), ("dense", {})]


@pytest.mark.parametrize("kind,kw", GROUPED, ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x.items())))
def test_grouped_forms_found(kind, kw):
    r = _accepted((kind, frozenset(kw.items())), k=kw.get("k", 2))
    assert isinstance(r.combine, ReplaceOutput) and r.form.startswith(kind)
    assert _multiplies_rows(r)


@pytest.mark.parametrize("kw,code", [({"soft": True}, "soft_moe"), ({"sampled": True}, "ids_may_repeat")])
def test_dense_refusals(kw, code):
    v = _one(("dense", frozenset(kw.items())))
    assert isinstance(v, Refusal) and v.code == code, v


def test_dense_entry_without_unsqueeze_found():
    """x.expand(E, T, H) on a 2-D x (an implicit new leading dim) enters the dense form like
    x.unsqueeze(0).expand(E, T, H)."""
    import math

    class Dense(torch.nn.Module):
        def __init__(self, h=8, i=6, e=4):
            super().__init__()
            self.e = e
            self.router = torch.nn.Linear(h, e, bias=False)
            self.w1 = torch.nn.Parameter(torch.randn(e, h, i) / math.sqrt(h))
            self.w2 = torch.nn.Parameter(torch.randn(e, i, h) / math.sqrt(i))

        def forward(self, x):
            w, ids = self.router(x).softmax(-1).topk(2, dim=-1)
            dense = x.new_zeros(x.shape[0], self.e).scatter(1, ids, w)
            y = torch.bmm(torch.relu(torch.bmm(x.expand(self.e, *x.shape), self.w1)), self.w2)
            return (y * dense.t().unsqueeze(-1)).sum(0)

    torch.manual_seed(0)
    gm, _ = dynamo_graph(("fn", Dense(), (torch.randn(5, 8),)))
    (v,) = check_all(gm)
    assert isinstance(v, Accepted) and v.region.form.startswith("dense"), v


def test_not_moe_is_not_found():
    def topk_gather(x):
        w, ids = torch.topk(x.softmax(-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for e in range(4):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, x[tok] * w[tok, slot, None])  # no expert function
        return out

    gm, _ = dynamo_graph(("fn", topk_gather, (torch.randn(6, 4),)))
    assert check_all(gm) == []


# ------------------------------------------------------------------------------------- legality rules
def _candidate(spec):
    from graphs import candidates

    (c,) = candidates(dynamo_graph(spec)[0])
    return c


def test_weights_path_refuses_a_forward_equal_tensor():
    """A region whose routing weights would be taken upstream of a detach: the same forward value, no
    gradient in the graph. No finder builds this today; the legality rule refuses it if one ever does."""
    c = _candidate(("loop", "index_add", 2, "softmax_topk", "swiglu", None))
    region = c.region
    w = region.router.weights
    g = w.graph
    with g.inserting_after(w):
        detached = g.call_method("detach", (w,))
    detached.meta["example_value"] = w.meta["example_value"]
    for u in list(w.users):
        if u is not detached:
            u.replace_input_with(w, detached)
    assert isinstance(check(c), Refusal) and check(c).code == "weights_not_transparent"
    moved = dataclasses.replace(region, router=dataclasses.replace(region.router, weights=detached))
    assert isinstance(check(dataclasses.replace(c, region=moved)), Accepted)


def test_accumulator_that_is_a_graph_input_refused():
    c = _candidate(("loop", "index_add", 2, "softmax_topk", "swiglu", "base"))
    placeholder = next(n for n in c.region.x.graph.nodes if n.op == "placeholder")
    bad = dataclasses.replace(c.region, combine=dataclasses.replace(c.region.combine, base=placeholder))
    v = check(dataclasses.replace(c, region=bad))
    assert isinstance(v, Refusal) and v.code == "acc_is_input"


def test_finding_becomes_the_refusal():
    from moe_compile.passes.region import Finding

    c = _candidate(("loop", "index_add", 2, "softmax_topk", "swiglu", None))
    v = check(dataclasses.replace(c, findings=(Finding.of("expert_set", None, experts=[0, 2], last=1),)))
    assert isinstance(v, Refusal) and v.code == "expert_set" and "[0, 2]" in v.message and "range" in v.fix


def test_every_reason_has_a_message_and_a_fix():
    from moe_compile.passes.reasons import REASONS, message

    for code, reason in REASONS.items():
        assert reason.message and reason.fix, code
        assert "?" not in message(code, {}) or "{" in reason.message, code


# ------------------------------------------------------------------------------------- the dynamo stage
def test_swiglu_fused_on_rewritten_experts_only():
    """The shared expert's SwiGLU (user code outside the region) stays as written."""
    new, records = rewrite(("loop", "index_add", 2, "softmax_topk", "swiglu", "add"))
    assert [r.status for r in records] == ["rewritten"]
    assert ops_in(new).count("weighted_swiglu") == 1   # the routing weights moved into it (weights_in_swiglu)
    assert sum(1 for n in new.graph.nodes if canon(n) == "silu") == 1  # the shared expert's


def test_swiglu_pass_can_be_disabled():
    new, _ = rewrite(("loop", "index_add", 2, "softmax_topk", "swiglu", None), disable=("swiglu",))
    assert "swiglu" not in ops_in(new) and "grouped_mm_list_cat" in ops_in(new)


def test_rewritten_graph_has_no_region_left():
    new, _ = rewrite(("loop", "where_setitem", 2, "softmax_topk", "swiglu", None))
    names = {canon(n) for n in new.graph.nodes}
    assert not names & {"where", "nonzero", "index_add_", "setitem", "_assert_scalar"}, names
    assert isinstance(new, fx.GraphModule) and ops_in(new)[:3] == ["router_topk", "route_permute", "permute_rows"]


def test_host_syncs_found_in_aten_graphs():
    """find_host_syncs on an ATen graph names the data-dependent ops (nonzero, .item()) and nothing else."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from moe_compile.passes.host_syncs import find_host_syncs

    def syncing(x):
        return x[x > 0].sum() + x.sum().item()

    def static(x):
        return torch.where(x > 0, x, 0).sum()

    x = torch.randn(8)
    found = find_host_syncs(make_fx(syncing, tracing_mode="symbolic")(x).graph)
    assert found.get("nonzero", 0) + found.get("masked_select", 0) + found.get("index", 0) >= 1, found
    assert "_local_scalar_dense" in found, found
    assert find_host_syncs(make_fx(static, tracing_mode="symbolic")(x).graph) == {}


def test_host_syncs_name_copies_to_the_host():
    """A CUDA tensor copied to the host (``.cpu()``, ``.to("cpu")``) is a sync, in Dynamo-level
    (call_method) and ATen graphs alike; the same code on host tensors is none. Fake CUDA tensors:
    runs without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from moe_compile.passes.host_syncs import find_host_syncs

    def copies(x):   # two blocking copies; a non-blocking one and a host factory are no wait
        return (x.cpu().sum() + x.to("cpu").sum() + x.sum() + x.to("cpu", non_blocking=True).sum()
                + x.new_zeros(2, device="cpu").sum())

    def on(device):
        mode = FakeTensorMode()
        with mode:
            x = torch.empty(8, device=device)
        gm = fx.symbolic_trace(copies)
        FakeTensorProp(gm, mode).propagate(x)
        return find_host_syncs(gm.graph), find_host_syncs(make_fx(copies, tracing_mode="fake")(x).graph)

    assert on("cuda") == ({"cpu (to the host)": 1, "to (to the host)": 1}, {"_to_copy (to the host)": 2})
    assert on("cpu") == ({}, {})


@pytest.mark.parametrize("source, path", [
    ("L['self'].layers[0].mlp", "layers.0.mlp"),
    ("L['self'].experts._modules['0']", "experts.0"),
    ("G['model']._modules['moe']", "model.moe"),
    # a module class with __getattr__ (peft's PeftModel / LoraModel) is read through its instance dict;
    # the warnings named the region `__dict__.'_modules.'base_model.__dict__.'_modules.'model.moe`
    ("L['self'].__dict__['_modules']['base_model'].__dict__['_modules']['model'].moe", "base_model.model.moe"),
])
def test_module_paths_read_as_the_user_names_them(source, path):
    from moe_compile.passes.normalize import _clean_module_path

    assert _clean_module_path(source) == path
