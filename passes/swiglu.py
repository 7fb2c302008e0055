"""find_swiglu: SwiGLU activations applied to the output of a moe_compile grouped GEMM.

Contract (finds and checks, never mutates)::

    h = moe_compile.grouped_mm*(...)                  [M, 2N] (w1|w3 side by side, or HF gate_up)
    g = h[:, :N]   | h[..., :N]   | h.chunk(2, -1)[0]
    u = h[:, N:]   | h[..., N:]   | h.chunk(2, -1)[1]
    a = silu(g) * u   (either operand order; ``s = silu(g); s *= u`` when nothing else reads s)
                                                      [M, N], h's dtype
  -> SwiGLUMatch(mul=a, h=h, n=N); ``lowering/swiglu.py`` replaces a with moe_compile.swiglu(h).

Only GEMM outputs of the rewrite are considered, so user code outside MoE regions is never touched.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .normalize import arg, canon, val
from .writes import writes_in_place, written


@dataclasses.dataclass(frozen=True)
class SwiGLUMatch:
    mul: fx.Node   # the product silu(g) * u
    h: fx.Node     # the grouped GEMM output [M, 2N]
    n: int


def _is_grouped_gemm(node: fx.Node) -> bool:
    return (canon(node) or "").startswith("moe_compile::grouped_mm")


def _half(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(h, 0 | 1) when node is the first / second column half of a 2-D GEMM output h, else None."""
    if canon(node) != "getitem" or not isinstance(node.args[0], fx.Node):
        return None
    src, idx = node.args[0], node.args[1]
    if canon(src) in ("chunk",) and isinstance(idx, int) and idx in (0, 1):
        h = src.args[0]
        chunks, dim = arg(src, 1, "chunks"), arg(src, 2, "dim", 0)
        if isinstance(h, fx.Node) and _is_grouped_gemm(h) and chunks == 2 and dim in (-1, 1):
            return h, idx
        return None
    if not _is_grouped_gemm(src) or not isinstance(idx, tuple) or len(idx) != 2:
        return None
    if not (idx[0] is Ellipsis or idx[0] == slice(None)) or not isinstance(idx[1], slice):
        return None
    hv = val(src)
    if not isinstance(hv, torch.Tensor) or hv.dim() != 2 or hv.shape[1] % 2:
        return None
    n = hv.shape[1] // 2
    s = idx[1]
    if s.step not in (None, 1):
        return None
    if s.start in (None, 0) and s.stop == n:
        return src, 0
    if s.start == n and s.stop in (None, 2 * n):
        return src, 1
    return None


def _silu_input(node: fx.Node) -> fx.Node | None:
    if canon(node) != "silu" or arg(node, 1, "inplace", False):
        return None
    x = node.args[0]
    return x if isinstance(x, fx.Node) else None


def find_swiglu(gm: fx.GraphModule) -> list[SwiGLUMatch]:
    found = []
    for node in gm.graph.nodes:
        if canon(node) != "mul" or len(node.args) != 2 or node.kwargs:
            continue
        for act, other in (node.args, node.args[::-1]):
            if not isinstance(act, fx.Node) or not isinstance(other, fx.Node):
                continue
            g = _silu_input(act)
            gh, uh = (_half(g) if g is not None else None), _half(other)
            if gh is None or uh is None or gh[0] is not uh[0] or (gh[1], uh[1]) != (0, 1):
                continue
            if writes_in_place(node) and not (written(node) is act and set(act.users) == {node}):
                break   # ``s *= u`` writes s (a view of it, ``s0 = s[:, :N]`` taken before, sees the
                #         product) and ``u *= silu(g)`` writes h: swiglu(h) is a new tensor, no such write
            h, out = val(gh[0]), val(node)
            n = h.shape[1] // 2
            if isinstance(out, torch.Tensor) and out.dtype == h.dtype and tuple(out.shape) == (h.shape[0], n):
                found.append(SwiGLUMatch(node, gh[0], n))
            break
    return found
