"""find_host_syncs: ops in an ATen graph (after AOTAutograd) that make the host wait for the device.

A rewritten MoE region has none: its shapes are static and its routing stays on the device, which
is what lets CUDA graphs capture it and collectives overlap it. What is left (router code outside
a region, a region that was refused) is reported on the graph's records so a user sees it.

    aten.nonzero / masked_select / unique / _local_scalar_dense (.item()) ... -> reported by name
    any op whose output size is data-dependent (an unbacked symbol in its fake value) -> by name
"""
from __future__ import annotations

import collections

import torch
import torch.fx as fx

_SYNC_OPS = {"nonzero", "masked_select", "_local_scalar_dense", "item", "unique", "_unique2", "unique_consecutive",
             "unique_dim", "repeat_interleave", "bincount"}  # _assert_async: a device-side check, no sync


def _data_dependent(v) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if isinstance(v, torch.Tensor):
        return bool(free_unbacked_symbols(v.shape))
    if isinstance(v, (list, tuple)):
        return any(_data_dependent(x) for x in v)
    return isinstance(v, torch.SymInt) and bool(free_unbacked_symbols(v))


def find_host_syncs(graph: fx.Graph) -> dict[str, int]:
    """{op name: count} of host-syncing nodes in ``graph`` (no syncs: empty)."""
    found: collections.Counter = collections.Counter()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        name = getattr(n.target, "_opname", getattr(n.target, "__name__", ""))
        if name == "repeat_interleave" and "output_size" in n.kwargs:
            continue  # a known output size: no sync
        if name in _SYNC_OPS or _data_dependent(n.meta.get("val")):
            found[name] += 1
    return dict(found)
