"""find_weights_in_swiglu: rewritten combines whose routing weights can move into the SwiGLU.

Contract (finds and checks, never mutates)::

    perm, inv, offs = moe_compile.route_permute(ids, E)          (getitems 0, 1, 2 of one call)
    h   = moe_compile.grouped_mm*(rows, W_up, offs, ...)         [M, 2N]
    a   = moe_compile.swiglu(h)                                  read only by the down projection
          [.to(dtype) ...]                                       (casts, each read once, are looked through)
    y   = moe_compile.grouped_mm(a, W_down, offs, None)          bias-free, read only by the combine
        | moe_compile.grouped_mm_list(a, [W_e], offs, [], ...)
    out = moe_compile.unpermute_combine(y, inv, w[T, K], offs[, out_dtype=])   w defined before a
  -> WeightsInSwiGLUMatch; ``lowering/weights_in_swiglu.py`` rewrites it to
    a   = moe_compile.weighted_swiglu(h, w, perm, offs)          a[p] = w.flat[perm[p]] * swiglu(h)[p]
    y   = <the same casts and down projection>(a, ...)
    out = moe_compile.unpermute_sum(y, perm, inv, offs, K[, out_dtype=])   (an fp32 sum of bf16 rows stays one)

Why it is the same function: the down projection is linear and bias-free, so for every row p,
w_p * (a_p @ W) = (w_p * a_p) @ W; and the weights' gradient <dout_t, a_p @ W> = <dout_t @ W^T, a_p>
is what weighted_swiglu's backward sums from the down projection's input gradient and h. Values
differ from the combine's order of operations by bf16 rounding only (the weight is applied in fp32
before the activation's one rounding instead of after the down projection's). What it saves: the
combine's backward becomes a gather that does not read y [M, H], and y is not kept for the backward.

Only this exact chain of moe_compile ops is matched (an expert-parallel combine reads received
rows, not a GEMM output, so it never matches), and only on activations with fp32's exponent range
(bf16, fp32, fp64; not fp16: ``_FP32_RANGE``), the swiglu's and every cast's before the down
projection; a chain that does not match keeps the weighted combine (correct, a read of y slower),
so nothing here is a refusal.
"""
from __future__ import annotations

import dataclasses
import torch
import torch.fx as fx

from .normalize import canon, route_permute_output, val


@dataclasses.dataclass(frozen=True)
class WeightsInSwiGLUMatch:
    combine: fx.Node   # unpermute_combine(y, inv, w, offs)
    down: fx.Node      # the bias-free down projection y
    swiglu: fx.Node    # swiglu(h): the down projection's input rows (through casts)
    weights: fx.Node   # w [T, K]
    perm: fx.Node      # route_permute(...)[0]
    top_k: int
    out_dtype: torch.dtype | None = None   # the combine's (rows summed into a wider output), kept by the sum


# activation dtypes with fp32's exponent range: the weighted activation rounds w * swiglu(h) once to this
# dtype, where eager multiplies the down projection's rows by w in promote(rows, w). In fp16 (max 65504,
# subnormal below 6e-5) that product overflowed to inf / NaN (weights 300, rows 20) or lost its digits
# (weights 1e-5: 7e-2 off) where eager's fp32 product did not (found by review); fp16 keeps the combine.
_FP32_RANGE = (torch.bfloat16, torch.float32, torch.float64)


def _perm_of(rp: fx.Node) -> fx.Node | None:
    return next((u for u in rp.users if route_permute_output(u, "perm") is rp), None)


def _bias_free_down(y: fx.Node, offs: fx.Node) -> bool:
    """y is a grouped GEMM over ``offs`` without bias whose only reader is the combine."""
    name = canon(y)
    if len(y.users) != 1 or len(y.args) < 3 or y.args[2] is not offs or y.kwargs:
        return False
    if name == "moe_compile::grouped_mm":
        return len(y.args) < 4 or y.args[3] is None
    if name == "moe_compile::grouped_mm_list":
        return len(y.args) < 4 or not y.args[3]
    return False


def _cast_chain(x) -> list:
    """``x``, then the nodes under it through a chain of ``.to(float dtype)`` casts that are each read once:
    the last is the node under the casts (``x`` if none)."""
    out = [x]
    while isinstance(x, fx.Node) and canon(x) == "to" and len(x.users) == 1 and isinstance(x.args[0], fx.Node) \
            and isinstance(val(x), torch.Tensor) and val(x).is_floating_point() \
            and tuple(val(x).shape) == tuple(val(x.args[0]).shape):
        x = x.args[0]
        out.append(x)
    return out


def _match(c: fx.Node, order: dict) -> WeightsInSwiGLUMatch | None:
    if len(c.args) != 4 or set(c.kwargs) - {"out_dtype"}:
        return None
    y, inv, w, offs = c.args
    rp = route_permute_output(inv, "inv")
    if rp is None or route_permute_output(offs, "offsets") is not rp or not isinstance(y, fx.Node) \
            or not _bias_free_down(y, offs):
        return None
    chain = _cast_chain(y.args[0])
    a, perm = chain[-1], _perm_of(rp)
    if not isinstance(a, fx.Node) or canon(a) != "moe_compile::swiglu" or len(a.users) != 1 or perm is None:
        return None
    wv, av = val(w), val(a)
    if not isinstance(w, fx.Node) or not isinstance(wv, torch.Tensor) or not wv.is_floating_point() \
            or wv.dim() != 2 or wv.numel() != av.shape[0] or order[w] > order[a]:
        return None
    if any(val(n).dtype not in _FP32_RANGE for n in chain):
        return None   # fp16 rows (swiglu's or a cast's before the down GEMM): w * swiglu(h) rounded to fp16
        #               underflows / overflows where eager's y * w does not
    return WeightsInSwiGLUMatch(c, y, a, w, perm, wv.shape[1], c.kwargs.get("out_dtype"))


def find_weights_in_swiglu(gm: fx.GraphModule) -> list[WeightsInSwiGLUMatch]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = []
    for node in gm.graph.nodes:
        if canon(node) == "moe_compile::unpermute_combine":
            m = _match(node, order)
            if m is not None:
                found.append(m)
    return found
