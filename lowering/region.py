"""lower_region: replace one accepted ``passes.region.Region`` with the moe_compile ops (edits the graph).

Before: a region as the finders describe it (``passes/loop_regions.py``: E unrolled per-expert
blocks with where/nonzero, gathers, the expert MLP and in-place accumulation, plus Dynamo's
runtime asserts on the data-dependent sizes; ``passes/grouped_regions.py``: one sorted / batched /
dense chain ending in the combined output).

After, inserted after the region's last write (or its output)::

    perm, inv, offs = moe_compile.route_permute(ids, E)          # static shapes, no host sync
    h0 = moe_compile.permute_rows(x, perm, inv, offs, K)
    h_i = <expert step i>   linears -> moe_compile.grouped_mm(h, W[E,K,N], offs, bias)
                                       or grouped_mm_list(h, [W_e], offs, [b_e], transposed=True)
                                          (ModuleList nn.Linear weights [N, K], no per-expert view)
            sibling linears of one input (SwiGLU w1, w3) -> one grouped_mm_list_cat(h, [W1_e], [W3_e], ...)
                                       or, 3-D [E, N, K] weights, one grouped_mm_cat(h, W1^T, W3^T, offs)
    out = moe_compile.unpermute_combine(h_last, inv, weights[T,K], offs).to(dtype) (+ base)
          | moe_compile.unpermute_sum(h_last, perm, inv, offs, K)   (unweighted, or weights on the input)

``AccumulateInPlace``: every reader of the finished accumulator reads ``out``; the writes into it
are erased. ``ReplaceOutput``: readers of the output (and of its in-place aliases, after it) read
``out``; the region's side-effecting nodes are erased. Then the per-expert nodes, the runtime
asserts that guarded their sizes and dead code go (``graph_edit.finish``, which the pipeline runs once
after every region of the graph is lowered). Invariant, after it: no node of the region, and no
unbacked symbol it introduced, is left in the graph.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from moe_compile.kernels import ops as _ops  # noqa: F401  (registers torch.ops.moe_compile.*)
from moe_compile.passes.normalize import val
from moe_compile.passes.writes import inplace_call
from moe_compile.passes.region import AccumulateInPlace, Region, ReplaceOutput, stacked_source

from . import expert_parallel, region_forms
from .graph_edit import GraphBuilder, in_graph_order, is_impure

OPS = torch.ops.moe_compile


def _stacked(b: GraphBuilder, nodes: tuple[fx.Node, ...], layout: str):
    """A 3-D weight view [E, K, N] if all experts index one stacked parameter, else None."""
    src = stacked_source(nodes) if len(nodes) > 1 else None
    if src is None:
        return None
    sv = val(src)
    if not isinstance(sv, torch.Tensor) or sv.dim() not in (2, 3) or sv.shape[0] != len(nodes):
        return None
    if sv.dim() == 2:           # a stacked bias [E, N]
        return src
    return b.method("transpose", src, 1, 2) if layout == "nk" else src


def _cast(b: GraphBuilder, node: fx.Node, dtype) -> fx.Node:
    """``node.to(dtype)`` where its value is a floating tensor of another dtype (the cast torch.autocast
    applies to a product's operands), else ``node``."""
    v = val(node)
    if dtype is None or not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dtype == dtype:
        return node
    return b.method("to", node, dtype)


def _emit_linear(b: GraphBuilder, region: Region, h: fx.Node, step, offs: fx.Node, ep) -> fx.Node:
    """One linear step over all experts. Under torch.autocast (``step.dtype``, the dtype the product
    ran in, differs from its operands') its operands are cast to that
    dtype first, as autocast casts a linear's: the input rows and each weight tensor once (a weight
    list per expert; ``lowering/expert_stack.py`` turns those casts into one of the stack). A bias
    added after the product in a wider dtype is added after the GEMM (``_add_group_bias``)."""
    w_slot, b_slot, layout = step.linear
    ws = region.experts.slots[w_slot]
    bs = region.experts.slots[b_slot] if b_slot is not None else None
    if ep is not None:  # every expert's weight (and bias) is a view of this rank's local shard
        ws = (expert_parallel.local_operand(b, stacked_source(ws)),)
        bs = (expert_parallel.local_operand(b, stacked_source(bs)),) if bs is not None else None
    cd = step.dtype
    h = _cast(b, h, cd)
    if bs is not None and step.bias_after and _promoted(step, bs):
        y = _emit_linear(b, region, h, dataclasses.replace(step, linear=(w_slot, None, layout)), offs, ep)
        return _add_group_bias(b, y, bs, offs, step.sum_dtype)
    if len(ws) == 1 and val(ws[0]).dim() == 3:      # one weight for all experts (grouped_regions)
        w3 = _cast(b, ws[0], cd)
        w3 = w3 if layout == "kn" else b.method("transpose", w3, 1, 2)
        return b.fn(OPS.grouped_mm.default, h, w3, offs, _cast(b, bs[0], cd) if bs is not None else None)
    w3 = _stacked(b, ws, layout)
    b3 = _stacked(b, bs, layout) if bs is not None else None
    if w3 is not None and (bs is None or b3 is not None):
        return b.fn(OPS.grouped_mm.default, h, _cast(b, w3, cd), offs, _cast(b, b3, cd) if b3 is not None else None)
    # nn.Linear weights [N, K] go in as they are (transposed=True): no per-expert view in the graph
    return b.fn(OPS.grouped_mm_list.default, h, [_cast(b, w, cd) for w in ws], offs,
                [_cast(b, x, cd) for x in bs] if bs is not None else [], layout == "nk")


def _promoted(step, bs) -> bool:
    """``x @ W + b`` whose sum is not computed in the product's dtype: a bias wider than the product
    (torch.autocast's bf16 product plus an fp32 bias) is added in the wider dtype, and the sum stays
    there (out of place) or is rounded back (``add_``). The grouped GEMM's bias epilogue would add it
    to the fp32 accumulator before the product's own rounding, and return the product's dtype."""
    bias_dtype = getattr(val(bs[0]), "dtype", None)
    return bias_dtype is not None and (bias_dtype != step.dtype or step.sum_dtype not in (None, step.dtype))


def _add_group_bias(b: GraphBuilder, y: fx.Node, bs: tuple, offs: fx.Node, sum_dtype) -> fx.Node:
    """y + bias[group of each row] computed as torch computes ``y + b`` of mixed dtypes (in the
    promoted dtype, then ``sum_dtype``); rows past the last group get no bias (they are zero rows
    that no combine reads). The row's group: ``searchsorted(offsets, row, right=True)``, on the
    device, sizes taken from ``y`` (no host sync, no symbolic size to build)."""
    bias = bs[0] if len(bs) == 1 and val(bs[0]).dim() == 2 else _stacked(b, bs, "kn")
    if bias is None:
        bias = b.fn(torch.stack, list(bs))                       # per-expert [N] biases: one [E, N] tensor
    e = val(bias).shape[0]
    rows = b.fn(torch.ones_like, b.fn(operator.getitem, y, (slice(None), 0)), dtype=val(offs).dtype)
    rows = b.method("sub", b.method("cumsum", rows, 0, dtype=val(offs).dtype), 1)   # 0, 1, ..., M - 1
    group = b.fn(torch.searchsorted, offs, rows, right=True)                   # [M] in [0, E]
    inside = b.method("unsqueeze", b.fn(operator.lt, group, e), 1)
    per_row = b.method("index_select", bias, 0, b.method("clamp", group, max=e - 1))
    per_row = b.fn(torch.where, inside, per_row, 0.0)
    out = b.fn(operator.add, y, per_row)                                       # torch's promotion, as eager's
    return b.method("to", out, sum_dtype) if sum_dtype is not None and val(out).dtype != sum_dtype else out


def _is_list_linear(region: Region, step) -> bool:
    """A linear whose experts hold separate 2-D weights (ModuleList) and no bias, layout nk."""
    if step.linear is None or step.linear[1] is not None or step.linear[2] != "nk":
        return False
    ws = region.experts.slots[step.linear[0]]
    return len(ws) > 1 and val(ws[0]).dim() == 2 and stacked_source(ws) is None


def _kn_view(b: GraphBuilder, w: fx.Node, layout: str) -> fx.Node:
    return w if layout == "kn" else b.method("transpose", w, 1, 2)


def _stacked_kn(region: Region, step) -> torch.Tensor | None:
    """The [E, K, N] value of a linear whose experts share one 3-D weight stored [E, N, K] (torchtitan's
    w1, w3: the operand is column-major), no bias; else None."""
    if step.linear is None or step.linear[1] is not None:
        return None
    ws = region.experts.slots[step.linear[0]]
    w = val(ws[0]) if len(ws) == 1 else None
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        return None
    w = w if step.linear[2] == "kn" else w.transpose(1, 2)
    return w if w.stride(1) == 1 else None


def _is_stacked_linear(region: Region, step) -> bool:
    return _stacked_kn(region, step) is not None


def _siblings(region: Region, si, sj) -> bool:
    """Steps si, sj are two linears of one input, weights of one dtype, run in one dtype (autocast's,
    or none): list linears (ModuleList), or 3-D weights of one shape (``cat_without_copy`` says where
    grouped_mm_cat costs no copy)."""
    if not _same_value(region, sj.args[0], si.args[0]):
        return False
    wa, wb = val(region.experts.slots[si.linear[0]][0]), val(region.experts.slots[sj.linear[0]][0])
    if wa.dtype != wb.dtype:
        return False
    if si.dtype != sj.dtype:   # run in two dtypes (autocast around one of them): one GEMM would run both in one
        return False
    if _is_list_linear(region, si):
        return _is_list_linear(region, sj)
    ka, kb = _stacked_kn(region, si), _stacked_kn(region, sj)
    return (ka is not None and kb is not None and ka.shape == kb.shape
            and _ops.cat_without_copy(wa.device, si.dtype or wa.dtype, ka.shape[2]))


_PURE_METHODS = {"to", "bfloat16", "float", "half", "type", "contiguous", "view", "reshape"}


def _same_value(region: Region, a, b) -> bool:
    """Operands a, b of expert steps are one value: the same, or two steps of one cast or view (pure: not a
    dropout) on the same operands (torchtitan casts the rows ``x.bfloat16()`` once per GEMM; a cast to one
    dtype however spelled: ``x.to(torch.bfloat16)`` and ``x.bfloat16()``)."""
    if a == b:
        return True
    if not (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2 and a[0] == b[0] == "step"):
        return False
    sa, sb = region.experts.steps[a[1]], region.experts.steps[b[1]]
    dtype = region_forms.cast_step_dtype(sa)
    if dtype is not None and dtype == region_forms.cast_step_dtype(sb):
        return _same_value(region, sa.args[0], sb.args[0])
    return (sa.op == sb.op == "call_method" and sa.target in _PURE_METHODS and sa.target == sb.target
            and sa.kwargs == sb.kwargs and len(sa.args) == len(sb.args)
            and all(_same_value(region, x, y) for x, y in zip(sa.args, sb.args)))


def _writes(step) -> bool:
    """The step may write a tensor in place: an in-place method or function (``add_``, ``+=``, ``t[i] = v``),
    ``inplace=True`` or an ``out=`` argument. Names only: anything not named so returns a new tensor."""
    kwargs = dict(step.kwargs)
    return inplace_call(step) or kwargs.get("inplace") is True or "out" in kwargs


def _sibling_linears(region: Region, ep=None) -> dict[int, int]:
    """{i: j}: expert steps i < j are sibling linears (``_siblings``: SwiGLU's w1 and w3): list linears
    lowered as one grouped_mm_list_cat, one GEMM once the weights share a buffer; 3-D weights (not under
    expert parallelism, whose weights are views of a rank's shard) as one grouped_mm_cat."""
    pairs, used = {}, set()
    steps = region.experts.steps
    # one op computes both at the first one's place: a write before the second (to its input, an alias of
    # it, or what a cast of it reads) would be read by eager's second linear and not by the pair (found by
    # review: rows += 1 between w1 and w3, rewritten 0.79 off); such experts keep their linears apart
    first_write = next((n for n, step in enumerate(steps) if _writes(step)), len(steps))
    for i, si in enumerate(steps):
        if i in used or not (_is_list_linear(region, si) or ep is None and _is_stacked_linear(region, si)):
            continue
        for j in range(i + 1, len(steps)):
            if j not in used and j < first_write and steps[j].linear is not None and _siblings(region, si, steps[j]):
                pairs[i] = j
                used.update((i, j))
                break
    return pairs


def _emit_sibling_linears(b: GraphBuilder, region: Region, h: fx.Node, si, sj, offs: fx.Node):
    if _is_stacked_linear(region, si):   # [E, N, K] weights: one output [M, Na + Nb] of both
        wa, wb = (_kn_view(b, _cast(b, region.experts.slots[s.linear[0]][0], si.dtype), s.linear[2]) for s in (si, sj))
        y = b.fn(OPS.grouped_mm_cat.default, _cast(b, h, si.dtype), wa, wb, offs)
        return _halves(b, y, _stacked_kn(region, si).shape[2])
    ws_a, ws_b = list(region.experts.slots[si.linear[0]]), list(region.experts.slots[sj.linear[0]])
    cd = si.dtype    # under autocast, as _emit_linear (``_siblings``: both steps run in it)
    h, ws_a, ws_b = _cast(b, h, cd), [_cast(b, w, cd) for w in ws_a], [_cast(b, w, cd) for w in ws_b]
    y = b.fn(OPS.grouped_mm_list_cat.default, h, ws_a, ws_b, offs, True)  # [N, K] weights as they are
    return _halves(b, y, val(ws_a[0]).shape[0])


def _halves(b: GraphBuilder, y: fx.Node, na: int) -> tuple[fx.Node, fx.Node]:
    return (b.fn(operator.getitem, y, (slice(None), slice(None, na))),
            b.fn(operator.getitem, y, (slice(None), slice(na, None))))


def _decode(x, env, region: Region):
    if isinstance(x, tuple) and x[:1] == ("in",):
        return env["in"]
    if isinstance(x, tuple) and len(x) == 2 and x[0] == "step":
        return env[x[1]]
    if isinstance(x, tuple) and len(x) == 2 and x[0] == "slot":
        return region.experts.slots[x[1]][0]   # legality: non-linear operands are shared
    if isinstance(x, (list, tuple)):
        return type(x)(_decode(i, env, region) for i in x)
    return x


def _anchor(g: fx.Graph, region: Region) -> fx.Node:
    c = region.combine
    if isinstance(c, ReplaceOutput):
        return c.output
    return in_graph_order(g, c.mutations)[-1]


def lower_region(gm: fx.GraphModule, region: Region, ep_chunks: int = 1, with_output: bool = False):
    """Rewrite ``region`` in ``gm`` (in place); returns notes on how (``with_output``: and the node its
    output's readers read now; ``region_chain`` lowers a graph's regions in order). The replaced nodes stay until the
    caller's ``graph_edit.finish(gm)`` (once after all regions of a graph: a dead-code and lint pass per
    region made lowering quadratic in a whole model's depth). ``ep_chunks``: an expert-parallel region's
    tokens are split into this many chunks, whose collectives the post_grad ``ep_overlap`` pass overlaps
    with the other chunks' expert GEMMs."""
    _check_pairs(region)
    g = gm.graph
    anchor = _anchor(g, region)
    b = GraphBuilder(g, anchor, GraphBuilder.fake_mode_of(region.x, "lower_region"), anchor)
    ep = expert_parallel.layout(region)
    chunks = _chunks(region, ep, ep_chunks)
    if chunks:
        h, out, received = _lower_chunked(b, region, ep, chunks)
    else:
        h, out, received = _lower_whole(b, region, ep)
    notes = (expert_parallel.describe(ep, received, len(chunks) or 1),) if ep is not None else ()
    c = region.combine
    if val(out).dtype != c.dtype:
        out = b.method("to", out, c.dtype)
    if isinstance(c, AccumulateInPlace) and c.base is not None:
        out = region_forms.keep_unrouted(b, region.router, c.base, out) if c.overwrite else \
            b.fn(operator.add, c.base, out)
    elif isinstance(c, ReplaceOutput) and c.base is not None:   # base.scatter_add(0, idx, rows), out of place
        out = b.fn(operator.add, c.base, out)

    if isinstance(c, ReplaceOutput):
        _rewire_output(g, region, c, out)
    else:
        _rewire_accumulator(g, c, out)
    return (notes, out) if with_output else notes


def _check_pairs(region: Region) -> None:
    """The ops read the router's ids as [T, K] pairs of the region's T tokens (``ids.reshape(-1)``: pair p is
    token p // K, slot p % K). Any other count would pair rows with other tokens: refused before any edit."""
    t, n, k = val(region.x).shape[0], val(region.router.ids).numel(), region.router.top_k
    if isinstance(t, int) and isinstance(n, int) and n != t * k:
        raise ValueError(f"the router's ids {tuple(val(region.router.ids).shape)} are not top_k={k} ids for each "
                         f"of the expert input's {t} tokens ({tuple(val(region.x).shape)}); route every token of "
                         f"the input to top_k experts, with ids viewed as [tokens, top_k]")


def _lower_whole(b: GraphBuilder, region: Region, ep):
    """route_permute -> permute_rows -> expert function -> unpermute_combine over every token (expert
    parallel: ``_ep_chain``): (last expert output, combined output, the expert rows' buffer or None)."""
    router = region.router
    if ep is not None:
        h, out, received = _ep_chain(b, region, ep, *_ep_tokens(b, region, ep))
        return h, _ep_own_rows(b, region, ep, out), received
    routed = b.fn(OPS.route_permute.default, router.ids, router.num_experts)
    perm, inv, offs = (b.fn(operator.getitem, routed, i) for i in range(3))
    rows, done = region_forms.input_rows(b, region, region.x, perm, inv, offs)
    # the weights before the experts: lowering/weights_in_swiglu.py may move them into the activation
    weights = _pair_weights(b, router, ones=False)
    h = _emit_experts(b, region, rows, offs, ep, done)
    wide = _wide(region, h)
    if weights is None:  # weight 1: the backward is a gather, y is not kept
        return h, b.fn(OPS.unpermute_sum.default, h, perm, inv, offs, router.top_k, **wide), None
    return h, b.fn(OPS.unpermute_combine.default, h, inv, weights, offs, **wide), None


def _ep_tokens(b: GraphBuilder, region: Region, ep):
    """The tokens [T, H], ids [T, K] and weights [T, K] | None an expert-parallel region sends; with a
    token bound (``ep.max_tokens``) padded to that many rows."""
    router = region.router
    # -1, not T: a symbolic T would enter the graph as a raw SymInt (dynamic shapes)
    x, ids, w = region.x, b.method("reshape", router.ids, -1, router.top_k), _ep_weights(b, router)
    return expert_parallel.pad_tokens(b, x, ids, w, ep) if ep.max_tokens else (x, ids, w)


def _ep_own_rows(b: GraphBuilder, region: Region, ep, out: fx.Node) -> fx.Node:
    """The output rows of the rank's own tokens: ``out`` without the padding of ``_ep_tokens``."""
    return expert_parallel.unpad_tokens(b, out, region.x) if ep.max_tokens else out


def _ep_weights(b: GraphBuilder, router) -> fx.Node | None:
    """The [T, K] pair weights that travel with the tokens (they weight the outputs, or with
    ``scale_input`` the input rows), or None (unweighted)."""
    if router.weights is None:
        return None
    w = region_forms.pair_weights(b, router)
    return w if val(w).dim() == 2 else b.method("reshape", w, -1, router.top_k)


def _ep_chain(b: GraphBuilder, region: Region, ep, x: fx.Node, ids: fx.Node, w: fx.Node | None):
    """Tokens x [T, H] with ids / weights [T, K] through this rank's experts (lowering/expert_parallel.py):
    every rank's tokens gathered, the rows routed to this rank's experts run, each token's partial output
    summed over the ranks back on its own rank. Returns (last expert output, [T, H], the rows' buffer)."""
    router = region.router
    k = router.top_k
    # scaled input rows (Llama 4) must be scaled before autocast's cast, as in the model: no early cast
    x_all, local_ids, w_all = expert_parallel.gather_tokens(
        b, x if router.scale_input else _cast(b, x, _travel_dtype(region)), ids, w, ep)
    routed = b.fn(OPS.route_permute.default, local_ids, expert_parallel.local_experts(ep))
    perm, inv, offs = (b.fn(operator.getitem, routed, i) for i in range(3))
    rows, done = region_forms.input_rows(b, region, x_all, perm, inv, offs, w_all)
    h = _emit_experts(b, region, rows, offs, ep, done)
    wide = _wide(region, h)
    partial = (b.fn(OPS.unpermute_sum.default, h, perm, inv, offs, k, **wide) if w_all is None or router.scale_input
               else b.fn(OPS.unpermute_combine.default, h, inv, w_all, offs, **wide))
    return h, expert_parallel.scatter_tokens(b, partial, ep), val(rows)


def _travel_dtype(region: Region):
    """The dtype the expert function reads its rows in, when every step reading them is a linear whose
    product autocast runs in one dtype: rows sent to other ranks are cast to it before they travel
    (fp32 activations under bf16 autocast: half the bytes; the cast commutes with moving rows, forward
    and backward). None otherwise (rows travel as they are)."""
    readers = [st for st in region.experts.steps if region_forms.reads_rows((st.args, st.kwargs))]
    dtypes = {st.dtype for st in readers}
    if readers and all(st.linear is not None for st in readers) and len(dtypes) == 1:
        return dtypes.pop()
    return None


def _wide(region: Region, y: fx.Node) -> dict:
    """``{"out_dtype": promote(rows, output)}`` where the expert rows' dtype does not hold the output
    they are summed into: bf16 rows into an fp32 accumulator (autocast's bf16 products; bf16 rows
    times fp32 routing weights, as transformers' DeepSeek-V3 experts), fp16 rows into a bf16 or fp64
    one. The combine widens each row as it loads it and sums in fp32, as the model's ``y.float() * w``
    does, without a wide copy of the rows (kept for the backward: [T*K, H] fp32 per layer), and its
    sum is not rounded to the rows' dtype on the way (fp16 overflows above 65504 where bf16 does
    not). {} otherwise (the rows' own dtype)."""
    rows, acc = val(y).dtype, region.combine.dtype
    wide = torch.promote_types(rows, acc) if rows.is_floating_point and acc.is_floating_point else rows
    return {"out_dtype": wide} if wide != rows else {}


def _chunks(region: Region, ep, ep_chunks: int) -> list[int]:
    """Token counts of the chunks of an expert-parallel region ([] for one chain). Regions whose
    weights or base are token-indexed by the variants of region_forms stay whole."""
    r, c = region.router, region.combine
    if ep is None or ep_chunks < 2 or r.scale_input or r.per_expert or getattr(c, "overwrite", False):
        return []
    t = ep.max_tokens or val(region.x).shape[0]   # with a token bound, the padded rows are split
    sizes = [t // ep_chunks + (i < t % ep_chunks) for i in range(ep_chunks)]
    return [n for n in sizes if n] if len([n for n in sizes if n]) > 1 else []


def _lower_chunked(b: GraphBuilder, region: Region, ep, sizes: list[int]):
    """``_ep_chain`` per chunk of tokens, so that one chunk's tokens travel while another chunk's
    expert GEMMs run (lowering/overlap.py issues each collective early and waits late); outputs cat."""
    x, ids, w = _ep_tokens(b, region, ep)
    splits = [b.fn(torch.split, v, sizes) for v in (x, ids)]
    w_split = b.fn(torch.split, w, sizes) if w is not None else None
    outs = []
    for i in range(len(sizes)):
        x_c, ids_c = (b.fn(operator.getitem, s_, i) for s_ in splits)
        w_c = b.fn(operator.getitem, w_split, i) if w_split is not None else None
        h, out, received = _ep_chain(b, region, ep, x_c, ids_c, w_c)
        outs.append(out)
    return h, _ep_own_rows(b, region, ep, b.fn(torch.cat, outs)), received


def _pair_weights(b: GraphBuilder, router, ones: bool = True) -> fx.Node | None:
    """[T, K] weights for unpermute_combine; when the experts are unweighted, weight 1 per routed pair
    (``ones``) or None (the combine is then ``unpermute_sum``)."""
    w = region_forms.combine_weights(b, router)
    if w is None:
        if not ones:
            return None
        w = b.fn(torch.ones_like, router.ids, dtype=torch.float32)   # built from ids: no symbolic sizes needed
    return w if val(w).dim() == 2 else b.method("reshape", w, -1, router.top_k)


def _emit_experts(b: GraphBuilder, region: Region, rows: fx.Node, gemm_offs: fx.Node, ep, done: int = 0) -> fx.Node:
    """The expert function over ``rows`` (grouped by ``gemm_offs``); returns its last step's output.
    ``done``: the rows are already the output of the first step (``region_forms.input_rows``)."""
    steps = region.experts.steps
    env = {"in": rows, **({0: rows} if done else {})}
    siblings = _sibling_linears(region, ep)
    for i, step in enumerate(steps):
        if i in env:
            continue  # the second of two sibling linears, emitted with the first
        if i in siblings:
            j = siblings[i]
            env[i], env[j] = _emit_sibling_linears(b, region, _decode(step.args[0], env, region), step,
                                                    steps[j], gemm_offs)
        elif step.linear is not None:
            env[i] = _emit_linear(b, region, _decode(step.args[0], env, region), step, gemm_offs, ep)
        else:
            env[i] = b(step.op, step.target, _decode(step.args, env, region), dict(_decode(step.kwargs, env, region)))
    return env[len(steps) - 1]


def _rewire_accumulator(g: fx.Graph, c: AccumulateInPlace, out: fx.Node) -> None:
    aliases = set(c.aliases)
    for reader in c.readers:
        for a in list(reader.all_input_nodes):
            if a in aliases:
                reader.replace_input_with(a, out)
    own = set(c.mutations) | set(c.readers)
    for m in reversed(in_graph_order(g, c.mutations)):
        for u in list(m.users):  # aliases returned by in-place ops, read only by the pattern itself
            if u not in own:
                u.replace_input_with(m, out)
        g.erase_node(m)


def _rewire_output(g: fx.Graph, region: Region, c: ReplaceOutput, out: fx.Node) -> None:
    """Readers of ``output`` (and of its in-place aliases, after it) read ``out``; the region's
    side-effecting nodes (checked by the finder to touch only region-internal tensors) are erased,
    then every pure region node left without users."""
    order = {n: i for i, n in enumerate(g.nodes)}
    new = {n for n in g.nodes if order[c.output] < order[n] <= order[out]}
    for src in (c.output, *c.aliases):
        for u in list(src.users):
            if u not in new and order[u] > order[c.output]:
                u.replace_input_with(src, out)
    for n in sorted(set(c.erase) | set(region.nodes), key=order.__getitem__, reverse=True):
        if not n.users and n.op != "placeholder" and (n in c.erase or not is_impure(n)):
            g.erase_node(n)
