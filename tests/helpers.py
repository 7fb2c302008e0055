"""Shared test helpers: ``check_compiled`` (eager vs backend="moe", outputs + every gradient +
the backend's counters) and small MoE layers written in each per-expert loop spelling.

Legend: T tokens, K top-k, E experts, H model width, I expert width.
"""
from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_compile import records

# --- tolerances: relative Frobenius error ||got - ref|| / ||ref|| --------------------------------
# fp32 vs fp32: the rewrite sums the K expert outputs in a different order (gather-reduce instead of
# index_add_/setitem) and runs a grouped GEMM instead of per-expert GEMMs; ~1e-7 measured, 100x margin.
FP32_REL = 1e-5
# bf16 vs bf16 eager: the rewrite accumulates in fp32 and rounds once, eager bf16 index_add_ rounds
# after every expert (K roundings of 2^-8), and every chained bf16 intermediate can differ by 1 ulp.
BF16_REL = 3e-2
# gradients flow through ~6 chained bf16 ops (combine bwd, 2-3 GEMMs, activation bwd, permute bwd):
# roundings compound, and small per-expert weight grads are sums of few rows.
BF16_GRAD_REL = 6e-2
# a gradient whose reference norm is below this is "zero" (e.g. an expert with no tokens): then the
# compiled gradient must be zero too, up to this absolute norm.
ZERO_NORM = 1e-6
# bf16 outputs of the dense/batched forms: eager rounds every [E, T, *] or per-pair bmm result to
# bf16 and sums E (or K) bf16 products; the rewrite sums K products in fp32 and rounds once.
DENSE_BF16_REL = 4e-2
# bf16 gradients of the dense/batched forms through 2 GEMMs + SwiGLU + combine, with different
# rounding points. The router bias gradient is a cancelling sum: against an fp64 run of the same
# model, eager bf16 was 3.6% off and the rewrite (SwiGLU rounded once, in fp32) 4.9% off, in
# opposite directions (8.4% apart; test_batched[True-bf16], input set 1).
DENSE_BF16_GRAD_REL = 1e-1
# Hugging Face models, fp32 logits and gradients (any depth, train mode included): the rewrite sums
# the K expert outputs in a different order and runs one grouped GEMM instead of HF's per-expert
# mm, through every layer after it; measured ~1e-7 to 1e-6 relative, 10x margin over FP32_REL.
HF_FP32_REL = 10 * FP32_REL
# one op against its fp64 reference (test_kernels.py): fp32 rounding of short dot products
# (K <= 64), ~1e-7 measured.
OP_FP32_REL = 1e-5
# one op, bf16 inputs, fp32 accumulation, one rounding of the output to bf16 (2^-8 relative) vs fp64.
OP_BF16_REL = 1e-2


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    den = ref.norm().item()
    return (got - ref).norm().item() / max(den, 1e-30)


# a gradient that is zero in exact arithmetic (e.g. the router's under a top-1 renormalised router,
# where w / w.sum() == 1) comes out as fp32 rounding noise, ~1e-7 of the largest gradient in the
# same backward: below this fraction of the largest reference gradient it counts as zero.
ZERO_REL = 1e-5


def assert_close_rel(got, ref, rel: float, what: str, zero: float = ZERO_NORM):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    if ref.double().norm().item() < zero:
        assert got.double().norm().item() < zero, f"{what}: reference is zero, got norm {got.norm()}"
        return
    err = rel_err(got, ref)
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel:.3g}"


def _fresh_like(args):
    """Fresh random tensors of the same shapes/dtypes (never all-zeros); ints are kept."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            out.append(torch.randn(a.shape, dtype=a.dtype, device=a.device).requires_grad_(a.requires_grad))
        else:
            out.append(a)
    return out


def _clone_args(args):
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
            for a in args]


def _run(fn, args, module=None):
    """Outputs and gradients of ``fn(*args)``; ``module`` holds the parameters (default: fn)."""
    module = module if module is not None else (fn if isinstance(fn, nn.Module) else None)
    out = fn(*args)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    grads = {}
    diff = [o for o in outs if o.requires_grad]
    if diff:
        # a fixed, non-uniform cotangent so every output element matters
        loss = sum((o.float() * torch.linspace(-1, 1, o.numel(), device=o.device).view(o.shape)).sum()
                   for o in diff)
        loss.backward()
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                grads[f"input{i}"] = a.grad
        for name, p in (module.named_parameters() if module is not None else []):
            if p.requires_grad:
                grads[name] = p.grad if p.grad is not None else torch.zeros_like(p)
    return [o.detach() for o in outs], grads


def check_compiled(fn, args, *, expect_rewritten: int, expect_refused: int = 0, rel: float | None = None,
                   grad_rel: float | None = None, inductor: bool = False, options: dict | None = None,
                   fresh_inputs: int = 1, grads: bool = True, compiled_ctx=contextlib.nullcontext,
                   seed: int | None = None, dynamic: bool | None = None):
    """Compile a deep copy of ``fn`` with backend="moe" and compare it with eager ``fn``.

    Outputs and every gradient (inputs that require grad and all parameters) must match on ``args``
    and on ``fresh_inputs`` further sets of fresh random inputs of the same shapes; the backend's
    counters must show exactly ``expect_rewritten`` rewritten and ``expect_refused`` refused regions
    (so a rewrite that silently did not fire fails). The compiled side's forward and backward run
    inside ``compiled_ctx()`` (e.g. ``moe_compile.compiled_backward``). ``seed``: reseed torch's RNG
    before each side runs (sampling routers, dropout: both sides draw the same numbers; with
    ``inductor=True`` this also needs ``torch._inductor.config.fallback_random``). ``dynamic``:
    torch.compile's. Returns the counter deltas.
    """
    torch._dynamo.reset()
    dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), torch.float32)
    low = dtype in (torch.bfloat16, torch.float16)
    rel = rel if rel is not None else (BF16_REL if low else FP32_REL)
    grad_rel = grad_rel if grad_rel is not None else (BF16_GRAD_REL if low else FP32_REL)
    opts = {"moe.inductor": inductor, **(options or {})}
    eager = fn
    compiled_src = copy.deepcopy(fn) if isinstance(fn, nn.Module) else fn
    compiled = torch.compile(compiled_src, backend="moe", options=opts, dynamic=dynamic)

    before = dict(records.counters)
    arg_sets = [list(args)] + [_fresh_like(args) for _ in range(fresh_inputs)]
    for n, a in enumerate(arg_sets):
        if isinstance(fn, nn.Module):
            eager.zero_grad(set_to_none=True)
            compiled_src.zero_grad(set_to_none=True)
        if seed is not None:
            torch.manual_seed(seed + n)
        ref_out, ref_g = _run(eager, _clone_args(a))
        if seed is not None:
            torch.manual_seed(seed + n)
        with compiled_ctx():
            got_out, got_g = _run(compiled, _clone_args(a),
                                  module=compiled_src if isinstance(fn, nn.Module) else None)
        for i, (g, r) in enumerate(zip(got_out, ref_out)):
            assert_close_rel(g, r, rel, f"input set {n}: output {i}")
        assert len(got_out) == len(ref_out)
        if grads:
            assert ref_g.keys() == got_g.keys(), f"gradients differ in which tensors get one: {ref_g.keys()} vs {got_g.keys()}"
            zero = max([ZERO_NORM] + [ZERO_REL * g.double().norm().item() for g in ref_g.values()])
            for k in ref_g:
                assert_close_rel(got_g[k], ref_g[k], grad_rel, f"input set {n}: grad of {k}", zero)
    delta = {k: records.counters[k] - before.get(k, 0) for k in (records.REWRITTEN, records.REFUSED)}
    assert delta["rewritten"] == expect_rewritten, f"expected {expect_rewritten} rewritten region(s), got {delta}"
    assert delta["refused"] == expect_refused, f"expected {expect_refused} refused region(s), got {delta}"
    return delta


def spy_static_inputs(monkeypatch) -> dict | None:
    """Record the static input indices AOTAutograd takes from Dynamo's graph (CUDA graphs copy every
    non-static input on every replay) as ``seen["static"]``; None on a torch without the hook."""
    import torch._functorch.aot_autograd as aot

    if not hasattr(aot, "_try_get_metadata_from_dynamo"):
        return None
    seen: dict = {}
    orig = aot._try_get_metadata_from_dynamo  # aot_autograd's own reference is the one it calls

    def spy(mod, *args, **kwargs):
        sources, static = orig(mod, *args, **kwargs)
        seen["static"] = list(static)
        return sources, static

    monkeypatch.setattr(aot, "_try_get_metadata_from_dynamo", spy)
    return seen


# ==================================================================================== model builders
class SwiGLU(nn.Module):
    def __init__(self, h, i, bias=False):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(h, i, bias=bias), nn.Linear(h, i, bias=bias), nn.Linear(i, h, bias=bias)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """Returns (w [T, K] or [T], ids [T, K] or [T]). ``routing`` forces the choice through the bias:
    "random", "empty" (experts 1 and E-1 never chosen), "hot" (every token picks experts 0..K-1)."""

    def __init__(self, h, e, k, kind="softmax_topk", routing="random", n_group=2, topk_group=1, scale=2.5):
        super().__init__()
        self.e, self.k, self.kind = e, k, kind
        self.n_group, self.topk_group, self.scale = n_group, topk_group, scale
        self.proj = nn.Linear(h, e, bias=True)
        with torch.no_grad():
            self.proj.weight.mul_(0.5)
            b = torch.randn(e) * 0.1
            if routing == "empty":
                b[1] = b[e - 1] = -30.0
            elif routing == "hot":
                for j in range(k):
                    b[j] = 30.0 - 5.0 * j
            self.proj.bias.copy_(b)
        self.register_buffer("sel_bias", torch.linspace(-0.05, 0.05, e))

    def forward(self, x):
        logits = self.proj(x)
        if self.kind == "softmax_topk":         # softmax -> topk -> renormalise
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
            w, ids = torch.topk(probs, self.k, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            return w.to(x.dtype), ids
        if self.kind == "topk_softmax":         # topk -> softmax
            w, ids = torch.topk(logits, self.k, dim=-1)
            return F.softmax(w, dim=-1, dtype=torch.float32).to(x.dtype), ids
        if self.kind == "sort_slice":           # a top-k written as a sort of the scores and its first K
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
            sv, si = probs.sort(dim=-1, descending=True)
            w = sv[:, :self.k]
            return (w / w.sum(-1, keepdim=True)).to(x.dtype), si[:, :self.k]
        if self.kind == "topk_plus1":           # Shazeer's noisy top-k: topk(K + 1) for the load loss, K route
            w, ids = torch.topk(logits, self.k + 1, dim=-1)
            return F.softmax(w[:, :self.k], dim=-1, dtype=torch.float32).to(x.dtype), ids[..., :self.k]
        if self.kind == "argmax":               # top-1, ids [T, 1]
            probs = F.softmax(logits, dim=-1)
            ids = probs.argmax(dim=-1, keepdim=True)
            return probs.gather(-1, ids), ids
        if self.kind == "argmax_flat":          # top-1, ids [T], w [T]
            probs = F.softmax(logits, dim=-1)
            ids = torch.argmax(probs, dim=-1)
            return probs.gather(-1, ids[:, None]).squeeze(-1), ids
        if self.kind == "sigmoid_group":        # DeepSeek-V3: sigmoid, selection bias, groups, scaling
            t = x.shape[0]
            scores = torch.sigmoid(logits.float())
            choice = scores + self.sel_bias
            per = self.e // self.n_group
            gs = choice.view(t, self.n_group, per).topk(min(2, per), dim=-1).values.sum(-1)
            gidx = torch.topk(gs, self.topk_group, dim=-1, sorted=False).indices
            gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0)
            emask = gmask.unsqueeze(-1).expand(t, self.n_group, per).reshape(t, -1)
            choice = choice.masked_fill(emask == 0, float("-inf"))
            ids = torch.topk(choice, self.k, dim=-1, sorted=False).indices
            w = scores.gather(1, ids)
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
            return (w * self.scale).to(x.dtype), ids
        if self.kind == "group_inplace":        # group limit, sorted top-ks, mask written in place
            t = x.shape[0]
            scores = torch.sigmoid(logits.float())
            per = self.e // self.n_group
            gs = scores.view(t, self.n_group, per).topk(min(2, per), dim=-1)[0].sum(-1)
            gidx = torch.topk(gs, self.topk_group, dim=-1)[1]
            gmask = torch.zeros_like(gs)
            gmask.scatter_(1, gidx, 1.0)            # a statement of its own: ids depend on it only in place
            emask = gmask.unsqueeze(-1).expand(t, self.n_group, per).reshape(t, -1)
            w, ids = torch.topk(scores.masked_fill(emask == 0, 0.0), self.k, dim=-1)
            return (w / (w.sum(-1, keepdim=True) + 1e-20)).to(x.dtype), ids
        raise ValueError(self.kind)


class Experts(nn.Module):
    """E expert MLPs; ``fwd(e, rows)`` applies expert e. Kinds: swiglu, gelu_seq (ModuleList of
    Linear-GELU-Linear with biases), stacked_chunk (F.linear(x, gate_up_proj[e]).chunk(2)),
    stacked_interleave (x @ W[e], [..., ::2] / [..., 1::2]), gptoss (clamped SwiGLU, x @ W[e] + b[e])."""

    def __init__(self, h, i, e, kind="swiglu"):
        super().__init__()
        self.kind, self.e = kind, e
        if kind == "swiglu":
            self.experts = nn.ModuleList([SwiGLU(h, i) for _ in range(e)])
        elif kind == "gelu_seq":
            self.experts = nn.ModuleList([nn.Sequential(nn.Linear(h, i), nn.GELU(), nn.Linear(i, h))
                                          for _ in range(e)])
        elif kind == "stacked_chunk":
            self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) / math.sqrt(h))
            self.down_proj = nn.Parameter(torch.randn(e, h, i) / math.sqrt(i))
        elif kind in ("stacked_interleave", "gptoss"):
            self.gate_up_proj = nn.Parameter(torch.randn(e, h, 2 * i) / math.sqrt(h))
            self.down_proj = nn.Parameter(torch.randn(e, i, h) / math.sqrt(i))
            if kind == "gptoss":
                self.gate_up_bias = nn.Parameter(torch.randn(e, 2 * i) * 0.1)
                self.down_bias = nn.Parameter(torch.randn(e, h) * 0.1)
        else:
            raise ValueError(kind)

    def fwd(self, e, x):
        if self.kind in ("swiglu", "gelu_seq"):
            return self.experts[e](x)
        if self.kind == "stacked_chunk":
            g, u = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, self.down_proj[e])
        if self.kind == "stacked_interleave":
            h = x @ self.gate_up_proj[e]
            return (F.silu(h[..., ::2]) * h[..., 1::2]) @ self.down_proj[e]
        # gptoss: clamped SwiGLU with sigmoid(alpha * gate) and (up + 1)
        gu = x @ self.gate_up_proj[e] + self.gate_up_bias[e]
        gate, up = gu[..., ::2], gu[..., 1::2]
        gate = gate.clamp(min=None, max=7.0)
        up = up.clamp(min=-7.0, max=7.0)
        glu = gate * torch.sigmoid(gate * 1.702)
        return self.down_bias[e] + ((up + 1) * glu) @ self.down_proj[e]   # bias on the left: either order


SPELLINGS = ("where_setitem", "index_add", "one_hot", "bool_mask", "nonzero", "scatter_add", "index_put",
             "assign", "assign_mask", "where_flat")


class LoopMoE(nn.Module):
    """A per-expert loop MoE layer [.., H] -> [.., H] in one of ``SPELLINGS``.

    shared: None, "add" (out + shared(x) at the end) or "base" (the accumulator starts from shared(x)).
    """

    def __init__(self, h=16, i=12, e=4, k=2, spelling="where_setitem", expert="swiglu", router="softmax_topk",
                 routing="random", shared=None):
        super().__init__()
        self.h, self.e, self.k, self.spelling, self.shared_mode = h, e, k, spelling, shared
        self.router = Router(h, e, k, router, routing)
        self.experts = Experts(h, i, e, expert)
        self.shared = SwiGLU(h, i) if shared else None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, self.h)
        w, ids = self.router(x)
        out = self.shared(x) if self.shared_mode == "base" else torch.zeros_like(x)
        sp = self.spelling
        if sp == "one_hot":
            mask = F.one_hot(ids, num_classes=self.e).permute(2, 1, 0)
        for i in range(self.e):
            if sp == "where_setitem":
                tok, slot = torch.where(ids == i)
                out[tok] += w[tok, slot, None] * self.experts.fwd(i, x[tok])
            elif sp == "index_add":
                tok, slot = torch.where(ids == i)
                out.index_add_(0, tok, self.experts.fwd(i, x[tok]) * w[tok, slot].unsqueeze(-1))
            elif sp == "one_hot":                       # HF Mixtral (transformers 4.x) style
                idx, top = torch.where(mask[i])
                cur = x[None, top].reshape(-1, self.h)
                y = self.experts.fwd(i, cur) * w[top, idx, None]
                out.index_add_(0, top, y.to(x.dtype))
            elif sp == "bool_mask":
                sel = ids == i
                m = sel.any(-1)
                we = (w * sel).sum(-1)
                out[m] += we[m, None] * self.experts.fwd(i, x[m])
            elif sp == "nonzero":
                tok, slot = torch.nonzero(ids == i, as_tuple=True)
                out[tok] += w[tok, slot, None] * self.experts.fwd(i, x[tok])
            elif sp == "scatter_add":
                tok, slot = torch.where(ids == i)
                y = self.experts.fwd(i, x[tok]) * w[tok, slot, None]
                out.scatter_add_(0, tok.unsqueeze(-1).expand(-1, self.h), y)
            elif sp == "index_put":
                tok, slot = torch.where(ids == i)
                out.index_put_((tok,), self.experts.fwd(i, x[tok]) * w[tok, slot, None], accumulate=True)
            elif sp == "assign":                        # overwrite: correct only for top-1
                tok, slot = torch.where(ids == i)
                out[tok] = self.experts.fwd(i, x[tok]) * w[tok, slot, None]
            elif sp == "assign_mask":                   # overwrite through a boolean token mask
                sel = ids == i
                m = sel.any(-1)
                out[m] = self.experts.fwd(i, x[m]) * (w * sel).sum(-1)[m, None]
            elif sp == "where_flat":                    # top-1 with ids [T], w [T]
                tok = torch.where(ids == i)[0]
                out[tok] += w[tok, None] * self.experts.fwd(i, x[tok])
            else:
                raise ValueError(sp)
        if self.shared_mode == "add":
            out = out + self.shared(x)
        return out.view(shape)


def make_input(shape, dtype=torch.float32, requires_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype).requires_grad_(requires_grad)


def make_model(dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    return LoopMoE(**kw).to(dtype)


class WithExtra(nn.Module):
    """A residual MoE layer (``make_model(spelling="index_add", e=4, k=2)``) plus ``extra(x)``: code
    outside the MoE region, e.g. a host sync the backend must report."""

    def __init__(self, extra):
        super().__init__()
        self.mlp, self.extra = make_model(spelling="index_add", e=4, k=2), extra

    def forward(self, x):
        return x + self.mlp(x) + self.extra(x)


def tiny_qwen3_moe(layers: int):
    """A tiny transformers Qwen3-MoE causal LM in training mode (4 experts, top-2, every layer MoE),
    its router weights drawn wider than the default init so that routing is not near-uniform."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, intermediate_size=32, max_position_embeddings=64,
                                      use_cache=False, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM._from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    return model.train()


def check_dropped_pairs_unread(device: str) -> None:
    """The ops never read a dropped pair (an id no expert of the layer has, as eager's loop over its experts
    never does): an inf / NaN routing weight there, inf rows past the groups (what a kernel may leave in
    rows it does not compute), a NaN token whose every pair is dropped, an inf gradient in those rows, give
    no NaN elsewhere and a zero weight gradient for the dropped pairs (the references multiplied by a 0/1
    mask: NaN * 0 is NaN, the token's whole row; review helper-104). Runs the ops of ``device``."""
    ops = torch.ops.moe_compile
    t, k, e, h = 9, 2, 3, 8
    ids = torch.tensor([[0, 1], [1, e], [2, e + 1], [e, e + 1], [0, 2], [e, 1], [2, 0], [1, 2], [e + 1, 0]],
                       device=device)
    dropped = ids >= e
    weights = torch.rand(t, k, device=device).masked_fill(dropped, float("nan"))
    weights[1, 1] = float("inf")
    perm, inv, offs = ops.route_permute(ids, e)
    total = int(offs[-1])
    x = torch.randn(t, h, device=device)
    x[3] = float("nan")                                   # token 3: both pairs dropped
    xp = ops.permute_rows(x, perm, inv, offs, k)
    assert torch.isfinite(xp).all() and (xp[total:] == 0).all(), xp
    xs = ops.permute_scale(x, perm, inv, offs, weights, x.dtype)
    assert torch.isfinite(xs).all() and (xs[total:] == 0).all(), xs
    y = torch.randn(t * k, h, device=device)
    y[total:] = float("inf")
    out = ops.unpermute_combine(y, inv, weights, offs)
    assert torch.isfinite(out).all() and (out[3] == 0).all(), out
    dout = torch.randn(t, h, device=device)
    dout[3] = float("inf")                               # a gradient only the dropped pairs meet
    dy, dw = ops.unpermute_combine_backward(dout, y, inv, weights, offs)
    assert torch.isfinite(dy).all() and (dy[total:] == 0).all() and (dw[dropped] == 0).all(), (dy, dw)
    dxp = torch.randn(t * k, h, device=device)
    dxp[total:] = float("inf")
    dx, dw = ops.permute_scale_backward(dxp, x, inv, weights, offs)
    assert torch.isfinite(dx).all() and (dw[dropped] == 0).all(), (dx, dw)
    hh = torch.randn(t * k, 2 * h, device=device)
    hh[total:] = float("inf")
    a = ops.weighted_swiglu(hh, weights, perm, offs)
    assert torch.isfinite(a).all() and (a[total:] == 0).all(), a
    da = torch.randn(t * k, h, device=device)
    da[total:] = float("inf")
    dh, dw = ops.weighted_swiglu_backward(hh, weights, perm, offs, da)
    assert torch.isfinite(dh).all() and (dh[total:] == 0).all() and (dw[dropped] == 0).all(), (dh, dw)
