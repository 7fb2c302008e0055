"""check: what torch.autocast did to a graph's products, from Dynamo's recorded values (finds, never mutates).

Under ``torch.autocast`` a product on its op lists (mm, bmm, matmul, linear, einsum) of fp32
operands computes in the autocast dtype: its recorded output dtype differs from an operand's.
Without autocast a product's dtype is its operands'. So one such node is evidence that the graph
ran under autocast, whether the context was entered inside the compiled code or around it.

    narrowed_product(nodes)   the first product whose output dtype differs from a float operand's
    AutocastAt(graph).on(n, device)
                              whether autocast for ``device`` is on at node ``n``: the innermost
                              context entered in the graph around it, else the state it was compiled under
    wide_experts_note(...)    a region note: the graph ran under autocast, but the region's expert
                              products kept their operands' wider dtype (as in eager: transformers'
                              grouped_mm experts call torch._grouped_mm, which autocast passes
                              through, and fall back to fp32 ``mm(out=)`` loops under torch.compile)

Graph before and after: unchanged (a check). The note tells a user why the grouped GEMMs of an
autocast run are fp32 ones (docs/benchmarks.md, section 0: 2.2x the step time of the plain
nn.Linear loop of the same experts, which autocast casts to bf16, on a Qwen3-30B-A3B-shaped model)
and what makes them bf16, without changing what is computed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .normalize import canon, val
from .region import Region
from .token_paths import MATMULS


@dataclass(frozen=True)
class Narrowed:
    """A product that computed in a narrower dtype than its operands (``out`` vs ``ins``)."""
    node: fx.Node
    op: str
    out: str
    ins: str
    out_dtype: torch.dtype


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def narrowed_product(nodes) -> Narrowed | None:
    for n in nodes:
        op = canon(n) or ""
        out = val(n)
        if op not in MATMULS or not isinstance(out, torch.Tensor):
            continue
        ins = [v for v in (val(a) for a in n.all_input_nodes) if isinstance(v, torch.Tensor) and v.is_floating_point()]
        other = sorted({_name(v.dtype) for v in ins if v.dtype != out.dtype})
        if other:
            return Narrowed(n, op, _name(out.dtype), "/".join(other), out.dtype)
    return None


class AutocastAt:
    """Whether torch.autocast is on at a node of ``graph``, for a device: the innermost context for that
    device entered in the graph around the node (``_enter_autocast`` .. its ``_exit_autocast``) says so,
    enabled or not; outside every such context, the state the graph is compiled under."""

    def __init__(self, graph: fx.Graph):
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.spans = []   # (enter, exit, device type, enabled)
        for n in graph.nodes:
            if n.op == "call_function" and getattr(n.target, "__name__", "") == "_exit_autocast" and n.args \
                    and isinstance(n.args[0], fx.Node):
                enter = n.args[0]
                device = enter.args[0] if enter.args and isinstance(enter.args[0], str) else enter.kwargs.get("device_type")
                enabled = enter.args[2] if len(enter.args) > 2 else enter.kwargs.get("enabled", True)
                self.spans.append((self.order[enter], self.order[n], device, enabled is not False))

    def on(self, n: fx.Node, device: str) -> bool:
        at = self.order[n]
        around = [sp for sp in self.spans if sp[0] < at < sp[1] and sp[2] == device]
        if around:
            return max(around)[3]   # the innermost: entered last
        return torch.is_autocast_enabled(device)


def wide_experts_note(region: Region, evidence: Narrowed | None) -> str | None:
    """The note for ``region`` when the graph ran under autocast (``evidence``: a narrowed product of
    the graph) and none of the region's expert products was narrowed: they compute in their
    operands' dtype, as in eager."""
    if evidence is None or narrowed_product(region.nodes) is not None:
        return None
    wide = sorted({_name(st.dtype) for st in region.experts.steps if st.linear is not None and st.dtype is not None
                   and torch.finfo(st.dtype).bits > torch.finfo(evidence.out_dtype).bits})
    if not wide:
        return None
    return (f"the expert GEMMs compute in {'/'.join(wide)}, as in eager, while this graph runs under torch.autocast "
            f"(e.g. `{evidence.node.name}` ({evidence.op}) computes in {evidence.out} on {evidence.ins} operands): "
            f"these expert products are not on autocast's op lists (transformers' grouped_mm experts call "
            f"torch._grouped_mm). For {evidence.out} expert GEMMs keep the expert weights in {evidence.out} "
            f"(model.to(torch.{evidence.out}) or the experts module alone), or write the experts with "
            f"nn.Linear / F.linear, which autocast casts")
