"""find_host_syncs: ops in a graph that make the host wait for the device.

A rewritten MoE region has none: its shapes are static and its routing stays on the device, which
is what lets CUDA graphs capture it and collectives overlap it. What is left (router code outside
a region, a region that was refused) is reported on the graph's records so a user sees it.

Reads a graph, never edits it. Runs on the rewritten torch-level graph (the dynamo stage, after lowering:
Dynamo's fake values under ``example_value``, methods as ``call_method``) and on ATen graphs (fake
values under ``val``). A node counts when

    its op is a known syncing op: nonzero / masked_select / unique / .item() ... -> reported by name
    (not ``.item()`` of a Python number Dynamo passes as a 0-d host tensor: no device there)
    its output has a data-dependent size or value that none of its inputs has  -> reported by name
    (an unbacked symbol it introduces: nodes downstream of that node are not counted again)
    it copies an accelerator tensor's values to the host, blocking (``.cpu()``, ``.to("cpu")``)
                                                                            -> "<op> (to the host)"

Subgraphs of higher-order ops (activation checkpointing, ...) are searched too; the higher-order op
itself is not counted (its subgraph names the op).
"""
from __future__ import annotations

import collections

import torch
import torch.fx as fx

from moe_compile.passes.normalize import canon, val

# always sync; repeat_interleave only with tensor repeats and no output_size (its output size is then
# data-dependent, which the unbacked-symbol rule sees); _assert_async: a device-side check, no sync
_SYNC_OPS = {"nonzero", "masked_select", "_local_scalar_dense", "item", "tolist", "unique", "_unique2",
             "unique_consecutive", "unique_dim", "bincount"}


def _unbacked(v) -> set:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    try:
        return set(free_unbacked_symbols(v))
    except Exception:  # a value of a type the walker does not know (an opaque object): no symbols
        return set()


def _introduces_unbacked(n: fx.Node) -> bool:
    out = _unbacked(val(n))
    if not out:
        return False
    for inp in n.all_input_nodes:
        out -= _unbacked(val(inp))
    return bool(out)


def _device_types(v) -> set:
    if isinstance(v, torch.Tensor):
        return {v.device.type}
    if isinstance(v, (tuple, list)):
        return set().union(*map(_device_types, v))
    return set()


# ops that copy a tensor's values (Dynamo's methods, ATen's ops); factories such as new_zeros or
# empty_like(device="cpu") only take an accelerator tensor's metadata
_COPY_OPS = {"cpu", "to", "copy", "copy_", "_to_copy", "numpy"}


def _copies_to_host(n: fx.Node, name: str) -> bool:
    """A blocking copy of an accelerator tensor's values into a host tensor: the host waits for
    them. ``non_blocking=True`` (into pinned memory) does not wait there: not counted."""
    if name not in _COPY_OPS or n.kwargs.get("non_blocking", False):
        return False
    if "cpu" not in _device_types(val(n)):
        return False
    return any(_device_types(val(inp)) - {"cpu", "meta"} for inp in n.all_input_nodes)


def _python_number(n) -> bool:
    """``n`` is a Python number Dynamo passes as a 0-d host tensor (``dynamic=True``: a module's float such as
    ``variance_epsilon``), whose ``.item()`` reads a host value, not a device's."""
    arg = n.meta.get("grapharg") if isinstance(n, fx.Node) and n.op == "placeholder" else None
    return bool(getattr(arg, "pass_arg_as_tensor", False))


def find_host_syncs(graph: fx.Graph) -> dict[str, int]:
    """{op name: count} of host-syncing nodes in ``graph`` and the subgraphs its module holds (no
    syncs: empty)."""
    found: collections.Counter = collections.Counter()
    owner = graph.owning_module
    graphs = [m.graph for m in owner.modules() if isinstance(m, fx.GraphModule)] if owner is not None else [graph]
    for g in graphs:
        for n in g.nodes:
            if n.op not in ("call_function", "call_method") or isinstance(n.target, torch._ops.HigherOrderOperator):
                continue
            name = canon(n) or str(n.target)
            if name == "item" and _python_number(n.args[0] if n.args else None):
                continue
            if name in _SYNC_OPS or _introduces_unbacked(n):
                found["getitem (boolean mask)" if name == "getitem" else name] += 1
            elif _copies_to_host(n, name):
                found[f"{name} (to the host)"] += 1
    return dict(found)


# what to do about the syncs a note names (ops of user code that no rewrite removes)
_SYNC_FIXES = {
    "bincount": "counts by `torch.histc(ids.float(), bins=E, min=0, max=E - 1)` or `one_hot(ids, E).sum(0)` have a "
                "static length (bincount's is its largest id + 1: the device tells the host)",
    "nonzero": "a per-expert selection's size read outside the rewritten region (`tok.shape[0]`, `len(tok)`) other "
               "than as `torch.tensor(sizes, device=...)` (made static), or boolean-mask indexing outside it: "
               "compute such statistics from counts (`histc`, `(ids == e).sum()`) instead",
    "item": "keep the value a tensor (`.item()` waits for the device)",
}
_SYNC_FIXES["where"] = _SYNC_FIXES["nonzero"]


def sync_note(found: dict[str, int]) -> str:
    """The graph note for ``find_host_syncs``' ``found``, with a fix for each op that has one."""
    fixes = [f"{op}: {_SYNC_FIXES[op]}" for op in found if op in _SYNC_FIXES]
    return ("host syncs left in the compiled graph (CUDA graphs and overlap need none): "
            + ", ".join(f"{op} x{n}" for op, n in found.items()) + (f" ({'; '.join(fixes)})" if fixes else ""))
