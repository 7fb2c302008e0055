"""moe_compile.compile_blocks: per-block compilation rewrites every MoE layer, compiles one graph
for all blocks of a class, and trains like eager (outputs, every gradient, AdamW steps); ModuleList
experts of every block get the first block's one-buffer layout without new Parameter objects."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters as dynamo_counters

import moe_compile
from moe_compile import records
from moe_compile.blocks import find_blocks
from moe_compile.kernels.runtime_ops import count_calls
from helpers import FP32_REL, HF_FP32_REL, assert_close_rel, make_model, tiny_qwen3_moe

OPTS = {"moe.inductor": False}
# three AdamW steps of fp32 training, compiled vs eager: each step's gradients differ by ~1e-7
# (FP32_REL's summation order), and AdamW moves every weight by ~lr whatever the gradient's size,
# so the weights stay within ~1e-6 relative; 10x margin.
TRAIN_REL = 10 * FP32_REL


def _route_permute_calls(fn) -> int:
    """MoE layers running rewritten code in one call of ``fn``: calls of moe_compile::route_permute."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return count_calls(prof.events(), "route_permute")


# ----------------------------------------------------------------------------- plain-loop model
class Expert(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False), nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, h=16, i=12, e=4, k=2, dense=False):
        super().__init__()
        self.k, self.dense = k, dense
        self.norm = nn.RMSNorm(h)
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(Expert(h, i) for _ in range(e))

    def forward(self, h):
        x = self.norm(h)
        if self.dense:   # a dense layer of the same class (DeepSeek's first layers)
            return h + self.experts[0](x)
        w, ids = F.softmax(self.gate(x), dim=-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return h + out


class LoopLM(nn.Module):
    def __init__(self, layers=3, h=16, dense=()):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(h, h)
        self.layers = nn.ModuleList(Block(h, dense=i in dense) for i in range(layers))
        self.out = nn.Linear(h, h)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def _shares_one_storage(block) -> bool:
    ptrs = {p.untyped_storage().data_ptr() for ex in block.experts for p in (ex.w1.weight, ex.w3.weight)}
    return len(ptrs) == 1


def test_loop_blocks_train_like_eager_and_share_the_first_layout(caplog):
    eager = LoopLM()
    model = copy.deepcopy(eager)
    params_before = [id(p) for p in model.parameters()]
    graphs0 = dynamo_counters["stats"]["unique_graphs"]
    blocks = moe_compile.compile_blocks(model, options=OPTS)
    assert blocks == list(model.layers)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    caplog.set_level(logging.WARNING, logger="moe_compile")
    for step in range(3):
        x = torch.randn(10, 16, generator=torch.Generator().manual_seed(step))
        outs = []
        for m, opt in zip((eager, model), opts):
            out = m(x)
            out.square().mean().backward()
            outs.append(out.detach())
            if step == 0:
                grads = {n: p.grad.clone() for n, p in m.named_parameters()}
                if m is eager:
                    ref_grads = grads
            opt.step()
            opt.zero_grad()
        assert_close_rel(outs[1], outs[0], TRAIN_REL, f"step {step}: output")
        if step == 0:
            for n, g in grads.items():
                assert_close_rel(g, ref_grads[n], FP32_REL, f"gradient of {n}")
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close_rel(p.detach(), q.detach(), TRAIN_REL, f"{n} after 3 AdamW steps")
    assert [id(p) for p in model.parameters()] == params_before, "Parameter objects were replaced"
    assert dynamo_counters["stats"]["unique_graphs"] - graphs0 == 1, "each block compiled its own graph"
    assert _route_permute_calls(lambda: model(torch.randn(10, 16))) == len(model.layers)
    # the backend re-homed the first block's experts while compiling it; the others got the same layout
    assert all(_shares_one_storage(b) for b in model.layers)
    # ... in time for their stacked inputs (lowering/expert_stack.py) to read the buffer in place: the
    # first call stacks the other blocks' copies, quietly; a persistent copy would warn
    assert "stacking a copy" not in caplog.text, caplog.text


# ----------------------------------------------------------------------------- Hugging Face model
transformers = pytest.importorskip("transformers")


def _warnings(caplog) -> list[str]:
    """What moe_compile and torch logged: another package's import-time warnings (torchao's, when
    installed, through transformers) are not this test's subject."""
    return [r.getMessage() for r in caplog.records if r.name.split(".")[0] in ("moe_compile", "torch")]


@pytest.mark.parametrize("loss", [True, False])
def test_hf_blocks_match_eager_every_layer_rewritten(loss, caplog):
    """One graph for the 4 blocks, one for the loss function (loss=True: the default); the loss and
    every gradient as eager's; the loss graph (no MoE in it by construction) warns nothing."""
    torch._dynamo.reset()   # the other parametrization's graphs would serve these blocks
    eager = tiny_qwen3_moe(4)
    model = copy.deepcopy(eager)
    graphs0 = dynamo_counters["stats"]["unique_graphs"]
    caplog.set_level(logging.WARNING, logger="moe_compile")
    moe_compile.compile_blocks(model, options=OPTS, loss=loss)
    assert (model.loss_function is not eager.loss_function) == loss
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (eager, model):
        out = m(input_ids=ids, labels=ids).loss
        out.backward()
        losses.append(out.detach())
    assert dynamo_counters["stats"]["unique_graphs"] - graphs0 == 1 + loss
    assert not _warnings(caplog), _warnings(caplog)
    assert_close_rel(losses[1], losses[0], HF_FP32_REL, "loss")
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close_rel(p.grad, q.grad, HF_FP32_REL, f"gradient of {n}")
    with torch.no_grad():
        assert_close_rel(model(input_ids=ids).logits, eager(input_ids=ids).logits, HF_FP32_REL, "logits")
        assert _route_permute_calls(lambda: model(input_ids=ids)) == 4


def test_compile_loss_only_where_there_is_a_settable_loss_function(caplog):
    """Left alone: a plain module (no loss_function), a model without a head (no loss_type: reading
    the property would make transformers warn), a loss already compiled."""
    from moe_compile.blocks import compile_loss

    caplog.set_level(logging.WARNING)
    assert not compile_loss(LoopLM(), options=OPTS)
    assert not compile_loss(tiny_qwen3_moe(1).model, options=OPTS)
    assert not _warnings(caplog), _warnings(caplog)
    model = tiny_qwen3_moe(1)
    assert compile_loss(model, options=OPTS)
    first = model.loss_function
    assert not compile_loss(model, options=OPTS) and model.loss_function is first


def test_compiled_loss_pickles_as_the_eager_loss_and_ignores_dynamic(caplog):
    """torch.save(model) still works (the compiled loss pickles, and deep-copies, as the eager
    function); ``dynamic=False`` meant for the blocks does not make the loss recompile for every
    int ``num_items_in_batch`` (torch.compile's default: dynamic after the first change)."""
    import io
    import pickle

    eager = tiny_qwen3_moe(1)
    model = copy.deepcopy(eager)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    moe_compile.compile_blocks(model, backend=moe_compile.moe_backend, options=OPTS, dynamic=False)
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    graphs0 = dynamo_counters["stats"]["unique_graphs"]
    for n in range(10, 16):
        got = model(input_ids=ids, labels=ids, num_items_in_batch=n).loss
        assert_close_rel(got, eager(input_ids=ids, labels=ids, num_items_in_batch=n).loss, HF_FP32_REL, f"loss / {n}")
    assert dynamo_counters["stats"]["unique_graphs"] - graphs0 <= 3   # the blocks, the loss: static, then dynamic
    assert pickle.loads(pickle.dumps(model.loss_function)) is eager.loss_function
    assert copy.deepcopy(model).loss_function is eager.loss_function
    torch.save(model, io.BytesIO())
    assert not _warnings(caplog), _warnings(caplog)   # the backend passed as a function: the loss is quiet too


def test_find_blocks_needs_a_module_list():
    with pytest.raises(ValueError, match="compile_blocks: Linear has no nn.ModuleList"):
        moe_compile.compile_blocks(nn.Linear(2, 2))


# ----------------------------------------------------------------------------- layouts, modes
def _train_like_eager(eager, model, steps=2, **kw):
    """``steps`` SGD steps of both: outputs and every gradient as eager's."""
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (eager, model)]
    for step in range(steps):
        x = torch.randn(10, 16, generator=torch.Generator().manual_seed(step))
        outs = [m(x) for m in (eager, model)]
        for o in outs:
            o.square().mean().backward()
        assert_close_rel(outs[1].detach(), outs[0].detach(), TRAIN_REL, f"step {step}: output", **kw)
        for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
            assert (p.grad is None) == (q.grad is None), n
            if q.grad is not None:
                assert_close_rel(p.grad, q.grad, TRAIN_REL, f"step {step}: gradient of {n}", **kw)
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_second_call_under_inference_mode_then_training():
    """The model's second call (where compile_blocks lays out the other blocks' experts) is an eval
    under torch.inference_mode(): the new buffers must not be inference tensors (the next training
    step raised "Setting requires_grad=True on inference tensor outside InferenceMode")."""
    torch._dynamo.reset()   # Block.forward's cache entries of other tests' compiles
    eager = LoopLM()
    model = copy.deepcopy(eager)
    moe_compile.compile_blocks(model, options=OPTS)
    _train_like_eager(eager, model, steps=1)
    x = torch.randn(10, 16)
    with torch.inference_mode():
        assert_close_rel(model(x), eager(x), FP32_REL, "output under inference_mode")
    assert not any(p.is_inference() for p in model.parameters())
    assert all(_shares_one_storage(b) for b in model.layers)
    _train_like_eager(eager, model, steps=2)


class Dense(nn.Module):
    def __init__(self, h=16):
        super().__init__()
        self.lin = nn.Linear(h, h)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


class LayoutLM(nn.Module):
    """Decoder layers in an nn.ModuleDict (torchtitan), an nn.Sequential, or a ModuleList of two
    classes (dense and MoE); each Block's experts are a ModuleList inside it."""

    def __init__(self, layout, h=16):
        super().__init__()
        torch.manual_seed(0)
        if layout == "dict":
            self.layers = nn.ModuleDict({str(i): Block(h) for i in range(3)})
        elif layout == "seq":
            self.layers = nn.Sequential(*[Block(h) for _ in range(3)])
        else:
            self.layers = nn.ModuleList([Dense(h), Block(h), Dense(h), Block(h)])

    def forward(self, x):
        for layer in (self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers):
            x = layer(x)
        return x


@pytest.mark.parametrize("layout", ["dict", "seq", "mixed"])
def test_find_blocks_takes_the_decoder_layers_of_every_layout(layout):
    """Not one layer's experts (every MoE layer then ran eagerly): the layers, every MoE one rewritten,
    outputs and gradients as eager's; explain() says the model was compiled block by block."""
    torch._dynamo.reset()   # Block.forward's cache entries of other tests' compiles
    eager = LayoutLM(layout)
    model = copy.deepcopy(eager)
    layers = list(model.layers.values()) if layout == "dict" else list(model.layers)
    assert moe_compile.compile_blocks(model, options=OPTS) == layers
    _train_like_eager(eager, model)
    moe_layers = sum(isinstance(b, Block) for b in layers)
    assert _route_permute_calls(lambda: model(torch.randn(10, 16))) == moe_layers
    report = moe_compile.explain(model, torch.randn(10, 16))
    assert len(report.rewritten) == moe_layers and "compiled with compile_blocks" in str(report)
    assert "outside every block" not in str(report)
    other = copy.deepcopy(eager)   # blocks given as a dotted path: a ModuleDict gives its values
    assert moe_compile.compile_blocks(other, blocks="layers", options=OPTS) == \
        (list(other.layers.values()) if layout == "dict" else list(other.layers))


def test_find_blocks_takes_repeated_owners_not_one_layers_experts_and_explain_names_eager_layers():
    """Decoder layers as plain attributes: the largest container is one layer's experts (compiling its
    items left every MoE layer eager); it lies in a module whose class repeats, so the blocks are the
    instances of that class. Blocks passed that miss a MoE layer: explain() names it as running eagerly."""
    torch._dynamo.reset()   # Block.forward's cache entries of other tests' compiles
    class Attrs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Block(), Block()

        def forward(self, x):
            return self.b(self.a(x))

    model = Attrs()
    assert find_blocks(model) == [model.a, model.b]
    seq = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), Block()) for _ in range(3))   # Sequential blocks
    assert find_blocks(nn.ModuleDict({"emb": nn.Embedding(4, 16), "h": seq})) == list(seq)
    top = nn.Sequential(nn.Linear(16, 16), *(Block() for _ in range(3)), nn.Linear(16, 16))   # emb, layers, head
    assert find_blocks(top) == list(top)[1:4]
    with records.recording() as graphs:
        moe_compile.compile_blocks(model, options=OPTS)
        model(torch.randn(10, 16))
    assert sum(r.status == records.REWRITTEN for g in graphs for r in g) == 2, graphs
    model = Attrs()
    moe_compile.compile_blocks(model, blocks=[model.a], options=OPTS)
    assert "b: outside every block compile_blocks compiled" in str(moe_compile.explain(model, torch.randn(10, 16)))


def test_dense_first_block_of_a_class_mirrors_from_a_rehomed_one(caplog):
    """The first block of the class is dense (its graph re-homes nothing): the MoE blocks still get
    the re-homed block's layout, so no block stacks a copy every step (a warning said so). And no
    nothing-rewritten warning: it was decided when the dense first block's call ended, before any MoE
    block had compiled (DeepSeek-V3's first_k_dense_replace, Qwen3-MoE's mlp_only_layers; review
    helper-90); a deep copy of the model (its root carries the hook that decides it now) trains alike."""
    torch._dynamo.reset()   # Block.forward's cache entries of other tests' compiles
    eager = LoopLM(4, dense=(0,))
    model = copy.deepcopy(eager)
    moe_compile.compile_blocks(model, options=OPTS)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    _train_like_eager(eager, model, steps=3)
    assert all(_shares_one_storage(b) for b in model.layers[1:])
    assert "stacking a copy" not in caplog.text and ".data was replaced" not in caplog.text, caplog.text
    assert "rewrote no MoE region" not in caplog.text, caplog.text
    _train_like_eager(copy.deepcopy(eager), copy.deepcopy(model), steps=1)


def test_nothing_rewritten_verdict_of_blocks_called_without_the_root(caplog):
    """The verdict waits for the end of a call of the root only while one runs: blocks called by user code
    (a loop over ``model.layers``) decide at once, as before (review helper-91: with the verdict always
    deferred to the root's hook, a model whose blocks are only called directly never warned); a module above
    the blocks called directly (``lm.model(...)``) waits for the end of its call (review helper-93).
    And explain() between the first and the second call traces the root's hooks as no-ops (it traced the
    layout mirror into the weights' re-homing: past Dynamo's recompile limit, 16 graphs)."""
    torch._dynamo.reset()
    model = LoopLM(3, dense=(0, 1, 2))
    moe_compile.compile_blocks(model, options=OPTS)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    h = torch.randn(10, 16)
    for layer in model.layers:
        h = layer(h)
    assert caplog.text.count("rewrote no MoE region") == 1, caplog.text
    caplog.clear()
    torch._dynamo.reset()   # the inner model called directly (lm.model(...)): it waits for that call (helper-93)
    outer = nn.ModuleDict({"model": LoopLM(3, dense=(0,))})
    moe_compile.compile_blocks(outer, blocks="model.layers", options=OPTS)
    outer["model"](torch.randn(10, 16))
    assert "rewrote no MoE region" not in caplog.text, caplog.text
    torch._dynamo.reset()
    model = LoopLM(3, dense=(0,))
    moe_compile.compile_blocks(model, options=OPTS)
    x = torch.randn(10, 16)
    model(x)
    assert moe_compile.explain(model, x).graphs == 1
    _train_like_eager(LoopLM(3, dense=(0,)), model, steps=1)


@pytest.mark.parametrize("tie", ["alias", "shared_memory"])
def test_mirror_keeps_weights_held_by_another_tensor_where_they_are(tie, caplog):
    """A later block's expert weight that another tensor also holds (a user's ``p.detach()`` alias
    updated in place, or a block in shared memory that Hogwild workers update): the backend's own
    re-homing never moves such weights, and compile_blocks' mirror of the first block's layout must
    not either. It did: from the model's second call the alias was no longer the weight (and the
    block left shared memory), so its in-place updates stopped reaching the model (output 8e-3 off
    at the next step, the weight 3x off after 3 steps)."""
    torch._dynamo.reset()
    eager = LoopLM()
    model = copy.deepcopy(eager)
    if tie == "shared_memory":
        for m in (eager, model):
            m.layers[1].share_memory()
    w, w_ref = model.layers[1].experts[0].w1.weight, eager.layers[1].experts[0].w1.weight
    alias, alias_ref = w.detach(), w_ref.detach()
    moe_compile.compile_blocks(model, options=OPTS)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    for step in range(3):
        _train_like_eager(eager, model, steps=1)
        with torch.no_grad():   # the other holder writes in place
            alias.mul_(0.5)
            alias_ref.mul_(0.5)
        assert alias.data_ptr() == w.data_ptr(), f"step {step}: the alias is no longer the weight"
        assert w.is_shared() == w_ref.is_shared()
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close_rel(p.detach(), q.detach(), TRAIN_REL, f"{n} after 3 steps")
    assert "a weight shares its storage" in caplog.text, caplog.text   # the slower path is named


def test_mirror_does_not_copy_a_tie_of_the_first_block(caplog):
    """The first block ties two experts' weights (``w.data = other.data``, a tie re-homing leaves in
    place): its storage groups hold that tie, and the mirror copied it as a layout onto every other block
    of the class: their experts 0 and 1 then shared one weight (expert 0's values overwritten with
    expert 1's, output 8e-2 off from the second call; review helper-60). Only disjoint groups are a
    layout; the other blocks keep their own weights and train like eager."""
    torch._dynamo.reset()
    eager = LoopLM()
    model = copy.deepcopy(eager)
    for m in (eager, model):
        ex = m.layers[0].experts
        ex[1].w1.weight.data = ex[0].w1.weight.data
    moe_compile.compile_blocks(model, options=OPTS)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    _train_like_eager(eager, model, steps=3)
    for b in model.layers[1:]:
        assert b.experts[0].w1.weight.data_ptr() != b.experts[1].w1.weight.data_ptr()
        # the first block's other linears, re-homed by the backend, are still mirrored
        assert len({ex.w2.weight.untyped_storage().data_ptr() for ex in b.experts}) == 1
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close_rel(p.detach(), q.detach(), TRAIN_REL, f"{n} after 3 steps")


# ----------------------------------------------------------------------------- refused regions
class _RefusedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = make_model(spelling="assign", e=4, k=2)   # `out[idx] = ...` with top-2: refused overwrite_topk

    def forward(self, x):
        return x + self.mlp(x)


class _RefusedStack(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.layers = nn.ModuleList(_RefusedBlock() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_refused_region_of_identical_blocks_is_warned_once_with_their_paths(caplog):
    """Was: each block's compile reported to a session of its own and a graph one block compiled serves
    every block of its class, so four identical blocks holding a refused region warned it twice (block
    0's graph, and block 1's recompile: its input requires grad), both as ``mlp``, with the
    nothing-rewritten warning twice. Now, as a whole-model compile: once, naming every block by its path
    from the model's root (once per block before review helper-110: 48 warnings for 48 blocks), then
    nothing-rewritten once; a second step warns nothing."""
    model = _RefusedStack()
    moe_compile.compile_blocks(model, options=OPTS)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    x = torch.randn(8, 16)
    model(x)
    first = caplog.text
    model(x)
    assert caplog.text == first, caplog.text
    refused = [line for line in first.splitlines() if "[overwrite_topk]" in line]
    assert len(refused) == 1 and "MoE regions layers.0.mlp, layers.1.mlp, layers.2.mlp, layers.3.mlp (" in refused[0], first
    assert first.count("rewrote no MoE region") == 1, first
    assert first.index("[overwrite_topk]") < first.index("rewrote no MoE region"), first


def test_generate_with_a_kv_cache_names_the_per_layer_guard(caplog):
    """compile_blocks then generate() with a DynamicCache (a review of inference paths): the cache's layer
    slot is guarded per layer, so every layer compiles graphs of its own on the one block frame, and past
    Dynamo's recompile limit the layers run eagerly. The warning named mark_dynamic and compile_blocks
    (neither helps); it now names the per-layer guard and the whole-model compile. Tokens stay eager's."""
    torch._dynamo.reset()
    model = tiny_qwen3_moe(3).eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 64, (1, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=3, do_sample=False, use_cache=True)
    moe_compile.compile_blocks(model, options={"moe.inductor": False})
    with torch._dynamo.config.patch(recompile_limit=4), caplog.at_level(logging.WARNING, logger="moe_compile"), \
            torch.no_grad():
        got = model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=True)
    assert torch.equal(got, want)
    warned = [r.getMessage() for r in caplog.records if "[recompile_limit" in r.getMessage()]
    assert len(warned) == 1 and "[recompile_limit_per_layer]" in warned[0], caplog.text
    assert "past_key_values" in warned[0] and 'model.compile(backend="moe")' in warned[0], warned[0]
    # training batches of a new shape run the frame eagerly too; explain() of the model lists the frame (it said
    # every region "rewritten": the frame is transformers' GradientCheckpointingLayer wrapper, a base class's
    # code; review helper-78)
    assert "training batches of a new shape" in warned[0], warned[0]
    with torch._dynamo.config.patch(recompile_limit=4):
        rep = moe_compile.explain(model, torch.randint(3, 64, (3, 9)))
    assert [r.code for r in rep.refused] == ["recompile_limit_per_layer"], str(rep)



def test_generate_of_a_whole_model_compile_is_not_called_per_layer(caplog):
    """A whole-model compile (model.compile) whose generate() calls hit the recompile limit on the cache's
    first layer (new batch sizes): the warning said "a per-block compile" and advised the whole-model compile
    it was (review helper-103: any guard naming the cache counted as per-layer)."""
    import transformers

    torch._dynamo.reset()
    cfg = transformers.GptOssConfig(vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    model.compile(backend="moe", options={"moe.inductor": False})
    with caplog.at_level(logging.WARNING, logger="moe_compile"), torch.no_grad():
        for b, s in ((2, 5), (2, 7), (1, 3)):   # sequences that cross the sliding window
            model.generate(torch.randint(1, 100, (b, s), generator=torch.Generator().manual_seed(s)),
                           max_new_tokens=5, do_sample=False, pad_token_id=0)
    warned = [r.getMessage() for r in caplog.records if "[recompile_limit" in r.getMessage()]
    assert warned and all("[recompile_limit]" in w for w in warned), caplog.text

def _with_router_logits(layers: int = 2, asked: str = "output_router_logits"):
    """``tiny_qwen3_moe`` after one eager call that asked for ``asked``: transformers installed all its
    output recorders (forward hooks on each router too, ``moe_compile/hf_recorders.py``); its eager twin."""
    model = tiny_qwen3_moe(layers)
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids, **{asked: True})
    return model, copy.deepcopy(model), ids


@pytest.mark.parametrize("checkpointing", [False, True])
def test_router_logits_recorders_whole_model_rewritten_like_eager(checkpointing):
    """The fix the router_logits_recorder reason gives: a whole-model compile with output_router_logits=True
    rewrites every layer and trains like eager (loss with the load-balancing term, router logits, every
    gradient): the recorders' ContextVar is set inside the trace. With gradient_checkpointing_enable, with
    torch's skip_fwd_side_effects_in_bwd_under_checkpoint (the recorders' append kept in the forward, not
    replayed in the backward's recomputation, where eager's recorder appends nothing: no collector then)."""
    torch._dynamo.reset()
    model, eager, ids = _with_router_logits()
    if checkpointing:
        for m in (model, eager):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = torch.compile(model, backend="moe", options=OPTS)
    before = dict(records.counters)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=checkpointing):
        outs = [m(input_ids=ids, labels=ids, output_router_logits=True) for m in (eager, compiled)]
    for o in outs:
        o.loss.backward()
    assert records.counters["rewritten"] - before.get("rewritten", 0) == 2, dict(records.counters)
    assert outs[0].aux_loss is not None
    assert_close_rel(outs[1].loss, outs[0].loss, HF_FP32_REL, "loss")
    assert_close_rel(outs[1].aux_loss, outs[0].aux_loss, HF_FP32_REL, "aux_loss")
    for a, b in zip(outs[1].router_logits, outs[0].router_logits):
        assert_close_rel(a, b, HF_FP32_REL, "router logits")
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close_rel(p.grad, q.grad, HF_FP32_REL, f"gradient of {n}")


@pytest.mark.parametrize("how", ["compile_blocks", "checkpointing", "compile_blocks_hidden_states"])
def test_router_logits_recorders_are_named(how, caplog):
    """Review helper-84: with transformers' router-logit recorders installed, compile_blocks refused every
    layer with ids_from_graph_input (a fix about peft) while explain(), tracing the whole model, said 2
    rewritten (paths `layers.0._compiled_call_impl._torchdynamo_inline.__self__.mlp...`); under
    gradient_checkpointing_enable every layer ran eagerly with a generic ran_eagerly fix. Both name the
    recorders and the fix now, in explain() and (compile_blocks) in the compile's warnings. Values as eager's.
    (``compile_blocks_hidden_states``: a first call that asked only for hidden states installs the routers'
    recorders too, and the message says so: review helper-86.)"""
    torch._dynamo.reset()
    model, eager, ids = _with_router_logits(asked="output_hidden_states" if how.endswith("states") else
                                            "output_router_logits")
    caplog.set_level(logging.WARNING, logger="moe_compile")
    if how.startswith("compile_blocks"):
        moe_compile.compile_blocks(model, options=OPTS)
        run = model
    else:
        for m in (model, eager):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        run = torch.compile(model, backend="moe", options=OPTS)
    before = dict(records.counters)
    losses = [m(input_ids=ids, labels=ids, output_router_logits=True).loss for m in (eager, run)]
    for loss in losses:
        loss.backward()
    assert records.counters["rewritten"] == before.get("rewritten", 0)   # the case this test is about
    assert_close_rel(losses[1], losses[0], HF_FP32_REL, "loss")
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close_rel(p.grad, q.grad, HF_FP32_REL, f"gradient of {n}")
    if how.startswith("compile_blocks"):
        warned = [w for w in _warnings(caplog) if "[router_logits_recorder]" in w]
        assert len(warned) == 1 and "model.layers.0.mlp.gate` (router_logits)" in warned[0], _warnings(caplog)
        assert "any output_*" in warned[0] and "self_attn" not in warned[0], warned[0]
    report = moe_compile.explain(run, input_ids=ids, labels=ids, output_router_logits=True)
    regions = report.regions   # (no stale skipped frame of an earlier test's compile: skipped_frames.live_skips)
    assert [(r.module, r.status, r.code) for r in regions] == [
        (f"model.layers.{i}.mlp.experts", "refused", "router_logits_recorder") for i in range(2)], report
    assert "torch.compile(model, backend=\"moe\")" in regions[0].fix
