"""check: accept or refuse each candidate MoE region. Every refusal is made here (finds nothing; never mutates).

A ``region.Candidate`` is refused when its finder recorded a ``Finding`` (the first one is the
reason), or when its assembled ``Region`` breaks one of ``RULES``; every refusal carries a stable
code from ``reasons.REASONS``, the filled message and the fix. The rules::

    expert_operands     only linear weights and biases may differ per expert; weights of one
                        linear have one shape; there is at least one linear
    input_2d            the expert input is [tokens, hidden]
    not_float64         no float64 expert input or weight (the fused ops accumulate in float32)
    plain_weights       no expert input, weight or bias is a tensor subclass with its own storage format
                        (quantized, float8: torchao's tensors), which the fused ops cannot take
    one_dtype_products  a product on operands of different float dtypes runs under torch.autocast (else
                        eager raises, and so must the compiled code)
    accumulator         an in-place accumulator is not a graph input
    expert_parallel     expert weights sharded by ``parallelize_experts`` (``ep_experts`` markers) are
                        all of the region's expert weights, over one group, for the router's E
    weights_path        the routing weights the lowering uses are the node the graph multiplies the
                        expert rows by, reached only through ops that keep value and gradient
                        (views, routing gathers, masks by the selection, casts): a tensor that only
                        has the same forward value (a straight-through estimator, a custom autograd
                        Function, a detach trick) would train with another gradient
    input_weights       weights that scale the expert input reach it through views and casts only;
                        for dense experts, the expert maps the zero rows of unselected pairs to zero
    no_foreign_writes   no in-place write other than the region's own lands, while the region runs, on a
                        tensor it reads or computes (``writes.foreign_write``)
    outside_transforms  the region does not run inside a torch.func transform Dynamo traced into the graph
                        (between its ``_grad/_jvp/_vmap/_func_increment_nesting`` and decrement calls)

Under torch.autocast (a product whose output dtype differs from an operand's) there is nothing to
refuse: the lowering casts the grouped GEMMs' operands as autocast does (``Step.dtype``), with or
without expert parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from . import reasons
from .autocast import AutocastAt
from .grouped_state import GMM_OPS
from .normalize import SYM_NUMBERS, ancestors, arg, attribute_path, canon, descendants, val, where_in_user_code
from .region import AccumulateInPlace, Candidate, Finding, Region, ReplaceOutput
from .token_paths import MATMULS
from .writes import foreign_write, graph_order, written


@dataclass(frozen=True)
class Accepted:
    region: Region


@dataclass(frozen=True)
class Refusal:
    module: str
    form: str
    where: str
    code: str
    message: str
    fix: str
    num_experts: int = 0
    top_k: int = 0


def refusal(candidate: Candidate, finding: Finding) -> Refusal:
    detail = dict(finding.detail)
    if finding.node is not None:
        detail.setdefault("at", where_in_user_code(finding.node) or "?")
        detail.setdefault("node_at", f" `{finding.node.name}` at {detail['at']}")
    return Refusal(candidate.module, candidate.form, candidate.where, finding.code,
                   reasons.message(finding.code, detail), reasons.fix(finding.code),
                   candidate.num_experts, candidate.top_k)


def check(candidate: Candidate) -> Accepted | Refusal:
    """The verdict on one candidate (from its captured facts only)."""
    if candidate.findings or candidate.region is None:
        finding = candidate.findings[0] if candidate.findings else Finding.of("router_unknown")
        return refusal(candidate, finding)
    for rule in RULES:
        finding = rule(candidate.region)
        if finding is not None:
            return refusal(candidate, finding)
    return Accepted(candidate.region)


# ===================================================================================== rules
def _target_name(target) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _flat(x):
    """Leaves of an encoded step argument: ("slot", s) / ("step", i) / ("in",) stay whole."""
    if isinstance(x, (list, tuple)) and not (len(x) == 2 and x[:1] == ("slot",)) \
            and x[:1] not in (("step",), ("in",)):
        return [leaf for i in x for leaf in _flat(i)]
    return [x]


def _input_number(n: fx.Node, depth: int = 8) -> fx.Node | None:
    """The graph input a symbolic number is computed from: a SymInt / SymFloat input, ``.item()`` of one (Dynamo
    passes a module's Python float under dynamic=True as a 0-d tensor input), or arithmetic on such numbers
    and constants (``-self.limit``, ``self.alpha * 2``); None for any other number (a size of the expert's own
    rows, a value computed from tensors in the graph)."""
    if depth == 0 or not isinstance(val(n), SYM_NUMBERS):
        return None
    if n.op == "placeholder":
        return n
    if canon(n) == "item":
        src = n.args[0] if n.args else None
        return src if isinstance(src, fx.Node) and src.op == "placeholder" else None
    if n.op != "call_function" or not n.all_input_nodes:   # number ops only: their inputs are numbers
        return None
    found = [_input_number(a, depth - 1) for a in n.all_input_nodes]
    return found[0] if all(f is not None for f in found) else None


def expert_operands(region: Region) -> Finding | None:
    mlp = region.experts
    for st in mlp.steps:
        if st.linear is None:
            for x in _flat(st.args) + _flat([v for _, v in st.kwargs]):
                if isinstance(x, tuple) and x[:1] == ("slot",) and len(set(mlp.slots[x[1]])) != 1:
                    first = mlp.slots[x[1]][0]
                    if all(_input_number(n) is not None for n in mlp.slots[x[1]]):   # dynamic=True's floats
                        return Finding.of("expert_numbers_dynamic", first, node=first.name, op=_target_name(st.target),
                                          source=_input_number(first).name)
                    return Finding.of("expert_operand_not_linear", first, node=attribute_path(first) or first.name,
                                      op=_target_name(st.target))
        else:
            for slot in st.linear[:2]:
                if slot is not None:
                    # str: a symbolic size (parameters with dynamic shapes) is not hashable; two
                    # different symbols count as different sizes (refused, never wrong)
                    shapes = [tuple(str(d) for d in val(n).shape) for n in mlp.slots[slot]]
                    if len(set(shapes)) != 1:
                        return Finding.of("weight_shapes_differ", None, shapes=_by_expert(shapes))
    if not mlp.steps or not any(st.linear for st in mlp.steps):
        return Finding.of("no_linear")
    return None


def _by_expert(shapes: list) -> str:
    """``expert 0: (8, 16); experts 1, 3: (12, 16); expert 2: (16, 16)`` (slot order is expert order)."""
    experts: dict = {}
    for e, sh in enumerate(shapes):
        experts.setdefault(sh, []).append(str(e))
    return "; ".join(f"expert{'s' * (len(es) > 1)} {', '.join(es)}: ({', '.join(sh)})" for sh, es in experts.items())


def input_2d(region: Region) -> Finding | None:
    xv = val(region.x)
    if not isinstance(xv, torch.Tensor) or xv.dim() != 2:
        return Finding.of("input_not_2d", region.x, shape=getattr(xv, "shape", None))
    return None


def not_float64(region: Region) -> Finding | None:
    mlp = region.experts
    nodes = [region.x] + [n for st in mlp.steps if st.linear for slot in st.linear[:2] if slot is not None
                          for n in mlp.slots[slot]]
    for n in nodes:
        v = val(n)
        if isinstance(v, torch.Tensor) and v.dtype == torch.float64:
            return Finding.of("float64", n, what=f"`{n.name}` is float64")
    return None


def plain_weights(region: Region) -> Finding | None:
    """No expert input, weight or bias is a tensor subclass with a storage format of its own (torchao's
    quantized or float8 tensors, NF4): the fused ops have no kernel for it. DTensor is not one here
    (expert-parallel weights reach the region through ``to_local()``)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    mlp = region.experts
    nodes = [region.x] + [n for st in mlp.steps if st.linear for slot in st.linear[:2] if slot is not None
                          for n in mlp.slots[slot]]
    for n in nodes:
        v = val(n)
        if isinstance(v, torch.Tensor) and is_traceable_wrapper_subclass(v) and type(v).__name__ != "DTensor":
            return Finding.of("weight_subclass", n, node=n.name, cls=type(v).__name__)
    return None


def one_dtype_products(region: Region) -> Finding | None:
    """A product (linear, mm, bmm, matmul, einsum, grouped_mm) of the region whose float operands have
    different dtypes computes only under torch.autocast for its device: without it eager raises ("mat1 and
    mat2 must have the same dtype"), and the fake values Dynamo records do not, so the lowering would cast
    them and return a result. Under autocast (entered around the compiled call, or inside the graph around
    the product, enabled, for the product's device: ``autocast.AutocastAt``) the lowering casts as autocast does."""
    state = None
    for n in region.nodes:
        if (canon(n) or "") not in MATMULS:
            continue
        dtypes = {v.dtype for a in n.all_input_nodes if isinstance(v := val(a), torch.Tensor) and v.is_floating_point()}
        if len(dtypes) < 2:
            continue
        out = val(n)
        state = AutocastAt(n.graph) if state is None else state
        if not state.on(n, out.device.type if isinstance(out, torch.Tensor) else "cpu"):
            names = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            return Finding.of("mixed_dtypes", n, node=n.name, dtypes=names)
    return None


# ops that draw random numbers (torch's and Tensor's names, as canon spells them)
RANDOM_OPS = {"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "bernoulli",
              "bernoulli_", "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm",
              "multinomial", "normal", "normal_", "uniform_", "exponential_", "geometric_", "log_normal_",
              "cauchy_", "random_", "rrelu", "rrelu_", "native_dropout", "poisson", "binomial", "_standard_gamma",
              "gumbel_softmax"}


def _draws(n: fx.Node) -> bool:
    """``n`` draws random numbers (a dropout only in training with p > 0)."""
    op = canon(n) or ""
    if op not in RANDOM_OPS:
        return False
    if "dropout" in op and op != "native_dropout":
        p = arg(n, 1, "p", 0.5)
        training = arg(n, 2, "training", True)
        return not (training is False or isinstance(p, (int, float)) and p == 0)
    return True


def random_in_experts(region: Region) -> Finding | None:
    """A random draw on the region's expert rows (dropout in training, in any form), else None. Eager draws
    per expert call (loops) or over every token and expert (dense), the rewrite once over the rows grouped
    by expert: other numbers on every host (CUDA's Philox starts each call at a new offset; Intel CPUs with
    MKL seed each bernoulli_ call's stream). Not one of ``RULES``: ``pipeline._check`` refuses such a region
    only where the compile reproduces eager's draws (moe.inductor=False, or Inductor's fallback_random)."""
    rows = descendants([region.x])
    for n in region.nodes:
        if n in rows and _draws(n):
            return Finding.of("random_in_experts", n, node=n.name)
    return None


def accumulator(region: Region) -> Finding | None:
    c = region.combine
    if isinstance(c, AccumulateInPlace) and c.base is not None and c.base.op == "placeholder":
        return Finding.of("acc_is_input", c.base)
    return None


_EXPERT_LINEARS = {"linear", "matmul", "mm", "bmm"} | GMM_OPS


def expert_parallel(region: Region) -> Finding | None:
    from .region import ep_marker

    operands = [slot for st in region.experts.steps if st.linear for slot in st.linear[:2] if slot is not None]
    markers = {s: ep_marker(region.experts.slots[s]) for s in operands}
    sharded = [s for s, m in markers.items() if m is not None]
    if not sharded:
        return None
    if len(sharded) != len(operands):
        name = lambda s: region.experts.slots[s][0].name  # noqa: E731
        return Finding.of("ep_mixed", None, sharded=", ".join(name(s) for s in sharded),
                          local=", ".join(name(s) for s in operands if s not in sharded))
    groups = {(markers[s].args[1], markers[s].args[2]) for s in sharded}
    if len(groups) != 1:
        return Finding.of("ep_inconsistent", None, groups=sorted(groups))
    (num_experts, group_name), = groups
    if num_experts != region.router.num_experts:
        return Finding.of("ep_expert_count", None, weights=num_experts, router=region.router.num_experts)
    return _replicated_tokens(region, group_name)


def _replicated_tokens(region: Region, group_name: str) -> Finding | None:
    """Tensor parallelism hands the ep ranks the same tokens (passes/ep_tokens.py)."""
    import torch.distributed as dist

    from .ep_tokens import replicated_over_ep

    try:
        ep_ranks = set(dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group_name)))
    except (RuntimeError, ValueError, KeyError):   # no such group here (a destroyed one): other checks say so
        return None
    found, placed = replicated_over_ep(region.x, ep_ranks)
    if found is not None:
        return Finding.of("ep_replicated_tokens", None, placement=found.placement, at=found.where or "?",
                          shared=list(found.shared), times=len(found.shared), ep=sorted(ep_ranks))
    if placed:   # the tokens' nearest DTensors split them (sequence parallel) or live on other ranks
        return None
    from moe_compile.ep_info import tensor_parallel_over

    tp = tensor_parallel_over(group_name)   # tensor parallelism this graph does not show (review helper-119)
    return Finding.of("ep_tokens_unproven", None, param=tp, ep=sorted(ep_ranks)) if tp else None


# ops between the routing weights and the multiplication with the expert rows that keep both the
# value and the gradient of the weights the rewrite uses
_TRANSPARENT = {"view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten", "getitem", "index_select",
                "expand", "expand_as", "t", "transpose", "permute", "contiguous", "clone", "to", "float", "double",
                "half", "bfloat16", "type", "type_as", "scatter", "scatter_", "sum", "gather"}


def weights_path(region: Region) -> Finding | None:
    w = region.router.weights
    if w is None or region.router.scale_input:   # weights on the input: ``input_weights`` checks them
        return None
    c = region.combine
    sinks = set(c.mutations) if isinstance(c, AccumulateInPlace) else {c.output}
    order = graph_order(w.graph)
    # walks bounded by graph order: only nodes between the weights and the last sink are looked at
    last = max(order.get(s, len(order)) for s in sinks)
    past = (lambda n: order.get(n, last) > last)   # a node not in the order (none expected): walked past
    rows = set()   # values computed from an expert output
    for n in region.nodes:
        if canon(n) in _EXPERT_LINEARS:
            rows |= descendants([n], past)
    # rows written into a buffer (torchtitan's ``buf[perm] = rows``): what reads the buffer reads expert rows
    rows |= descendants([t for m in region.nodes if m in rows and (t := written(m)) is not None], past)
    first = order.get(w, 0)
    ahead = ancestors(sinks, lambda n: order.get(n, first) < first)
    for n in sorted(descendants([w], past) & ahead, key=order.__getitem__):
        if n is w or n in sinks:
            continue
        if any(i in rows for i in n.all_input_nodes):
            continue  # where the weights meet the expert rows (the multiplication), or after it
        op = canon(n)
        if op in _TRANSPARENT or _mask_op(n, w):
            continue
        return Finding.of("weights_not_transparent", n, op=op or n.op, node=n.name)
    return None


def _mask_op(n: fx.Node, w: fx.Node) -> bool:
    """w * selection (a boolean or integer mask) or where(selection, w, 0)."""
    op = canon(n)
    others = [a for a in n.args if isinstance(a, fx.Node) and a is not w]
    if op == "mul":
        return all(isinstance(val(a), torch.Tensor) and not val(a).is_floating_point() for a in others)
    return op == "where" and len(n.args) == 3 and n.args[2] == 0


# ops that map a zero row to a zero row (and a zero intermediate to zero gradients of the weights
# after it): what a dense expert may contain when its input, not its output, is weighted
_ZERO_TO_ZERO = {"bmm", "matmul", "mm", "linear", "silu", "gelu", "relu", "tanh", "neg", "mul", "chunk", "split",
                 "getitem", "view", "reshape", "sum", "to", "float", "bfloat16", "half", "contiguous", "relu6",
                 "leaky_relu", "elu", "selu", "mish", "hardswish", "abs", "square", "type", "squeeze",
                 "unsqueeze"} | GMM_OPS


def input_weights(region: Region) -> Finding | None:
    """Weights on the expert input (``Router.scale_input``, Llama 4): the weights reach the input rows
    only through views and casts, and when every token runs through every expert (dense) the expert
    maps the zero rows of unselected pairs to zero (no bias, no op with f(0) != 0), so leaving those
    pairs out changes no value and no gradient."""
    router = region.router
    if not router.scale_input:
        return None
    c = region.combine
    sinks = set(c.mutations) if isinstance(c, AccumulateInPlace) else {c.output}
    rows = descendants([region.x])   # the input rows and everything computed from them
    for n in sorted(descendants([router.weights]) & ancestors(sinks), key=graph_order(region.x.graph).__getitem__):
        if n is router.weights or n in sinks or any(i in rows for i in n.all_input_nodes):
            continue  # where the weights meet the input rows, or after it
        if canon(n) not in _TRANSPARENT:
            return Finding.of("weights_not_transparent", n, op=canon(n) or n.op, node=n.name)
    if not region.form.startswith("dense") or not isinstance(c, ReplaceOutput):
        return None
    desc_w = descendants([router.weights])
    meet = [n for n in desc_w - {router.weights} if any(i in rows and i not in desc_w for i in n.all_input_nodes)]
    fn_nodes = set().union(*(descendants([m]) for m in meet)) & ancestors([c.output])
    for n in sorted(fn_nodes, key=graph_order(region.x.graph).__getitem__):
        op = canon(n)
        if op in _ZERO_TO_ZERO and not _has_bias(n):
            continue
        if op in ("add", "sub", "iadd") and all(a in fn_nodes for a in n.all_input_nodes) \
                and not any(isinstance(a, (int, float)) and a != 0 for a in n.args):
            continue  # zero + zero
        return Finding.of("dense_input_nonzero", n, op=op or n.op, node=n.name)
    return None


def _has_bias(n: fx.Node) -> bool:
    at = {"linear": 2, **{op: 3 for op in GMM_OPS}}.get(canon(n))
    return at is not None and arg(n, at, "bias") is not None


def no_foreign_writes(region: Region) -> Finding | None:
    n = foreign_write(region)
    if n is None:
        return None
    return Finding.of("written_in_place", n, node=n.name, target=written(n).name)


_NESTING = {f"_{t}_{d}_nesting": (1 if d == "increment" else -1)
            for t in ("grad", "jvp", "vmap", "func") for d in ("increment", "decrement")}


def outside_transforms(region: Region) -> Finding | None:
    """A region inside a torch.func transform (grad, vjp, jvp, vmap) that Dynamo traced into the graph: its
    tensors are functorch wrappers the lowering cannot rewrite (it failed there on values with no fake
    tensor), so it is refused by name."""
    depth, last = 0, ""
    for n in region.x.graph.nodes:
        if n is region.x:
            return Finding.of("func_transform", region.x, transform=last) if depth > 0 else None
        step = _NESTING.get(getattr(n.target, "__name__", ""), 0) if n.op == "call_function" else 0
        depth += step
        if step > 0:
            last = f"torch._C._functorch.{n.target.__name__}"
    return None


RULES = (expert_operands, input_2d, not_float64, plain_weights, one_dtype_products, accumulator, expert_parallel, weights_path, input_weights,
         no_foreign_writes, outside_transforms)
