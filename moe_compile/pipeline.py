"""The ordered pass driver: find -> check -> lower, on a copy of the Dynamo graph.

``run_passes(gm, example_inputs, config) -> (gm, records)``. Matching and lowering happen on a
shallow copy of the graph; if anything fails the original graph is returned unchanged (and the
failure is recorded), so a region the backend cannot handle is compiled exactly as Dynamo gave it.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time

import torch
import torch.fx as fx

from moe_compile.passes.normalize import canon

log = logging.getLogger(__name__)

PASS_NAMES = ("moe_regions", "grouped_regions", "swiglu")  # swiglu: fuse silu(g) * u on rewritten GEMM outputs

# process-wide counters (like torch._dynamo.utils.counters): tests assert on them
counters: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class RegionRecord:
    """What happened to one MoE region of one compiled graph."""
    module: str
    form: str
    status: str            # "rewritten" | "rejected"
    reason: str
    ops: tuple[str, ...]
    where: str
    num_experts: int = 0
    top_k: int = 0
    notes: tuple[str, ...] = ()


# What Dynamo hangs on its GraphModule besides the graph (torch/_dynamo/output_graph.py), read by
# AOTAutograd: _param_name_to_source + each placeholder's _dynamo_source (which inputs are
# parameters: static for CUDA graphs, deduplicated guards) and meta["dynamo_compile_id"].
_DYNAMO_GM_ATTRS = ("_param_name_to_source", "_source_to_user_stacks", "compile_subgraph_reason", "_backend_id")


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a node-by-node copy of gm's graph (node meta copied shallowly) that
    keeps Dynamo's annotations. Without them AOTAutograd treats the copy as a non-Dynamo graph and
    marks no parameter static: CUDA graphs then copied every expert weight into their input buffers
    on every replay (0.9 ms per step for a Qwen3-30B-A3B layer on an H200)."""
    graph = fx.Graph()
    val_map: dict = {}
    out = graph.graph_copy(gm.graph, val_map, return_output_node=True)
    if out is not None:
        graph.output(out[0] if isinstance(out, tuple) else out.args[0])
    new = fx.GraphModule(gm, graph)
    # subgraphs of higher-order ops (autograd.Function bodies, checkpoint, cond) are copied too:
    # the copy must share no graph with the original, which is what runs if a pass fails
    for node in graph.find_nodes(op="get_attr"):
        sub = getattr(new, node.target, None)
        if isinstance(sub, fx.GraphModule) and "." not in node.target:
            setattr(new, node.target, copy_graph_module(sub))
    new.meta.update(getattr(gm, "meta", {}))
    for name in _DYNAMO_GM_ATTRS:
        if hasattr(gm, name):
            setattr(new, name, getattr(gm, name))
    for old, copied in val_map.items():
        if hasattr(old, "_dynamo_source"):
            copied._dynamo_source = old._dynamo_source
    return new


def _ops_used(gm: fx.GraphModule) -> tuple[str, ...]:
    names = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "moe_compile":
            names.append(n.target._opname)
    return tuple(dict.fromkeys(names))


def _surviving_syncs(gm: fx.GraphModule) -> list[str]:
    """where/nonzero nodes left after lowering (kept alive by code outside any region)."""
    return [n.name for n in gm.graph.nodes
            if canon(n) == "nonzero" or (canon(n) == "where" and len(n.args) == 1)]


def run_passes(gm: fx.GraphModule, example_inputs, config) -> tuple[fx.GraphModule, list[RegionRecord]]:
    from moe_compile import debug
    from moe_compile.passes.grouped_regions import find_grouped_regions
    from moe_compile.passes.moe_regions import Accept, MoERegion, check_region, find_moe_regions

    finders = [(name, fn) for name, fn in (("moe_regions", find_moe_regions), ("grouped_regions", find_grouped_regions))
               if name not in config.disable]
    if not finders:
        return gm, []
    t0 = time.perf_counter()
    work = copy_graph_module(gm)
    found = []
    records: list[RegionRecord] = []
    for name, finder in finders:
        try:
            found += finder(work)
        except Exception as exc:  # a matcher bug must not break the user's compile
            if config.strict:
                raise
            log.warning("%s: matcher failed (%s: %s); its regions are left unchanged", name, type(exc).__name__, exc)
            records.append(RegionRecord("", "?", "rejected", f"{name}: matcher error {type(exc).__name__}: {exc}",
                                        (), ""))
    accepted: list[MoERegion] = []
    for region in found:
        verdict = check_region(region)
        if isinstance(verdict, Accept):
            accepted.append(verdict.region)
        else:
            records.append(RegionRecord(region.module, region.form, "rejected", verdict.reason, (), region.where,
                                        getattr(region, "num_experts", 0), getattr(region, "top_k", 0)))
    if not accepted:
        _count(records)
        return gm, records
    verbose = config.debug or log.isEnabledFor(logging.DEBUG)
    before = work.print_readable(print_output=False) if verbose else ""
    from moe_compile.lowering.moe_region import lower_moe_region

    try:
        for region in accepted:
            lower_moe_region(work, region)
        if "swiglu" not in config.disable:
            from moe_compile.lowering.swiglu import fuse_swiglu
            from moe_compile.passes.swiglu import find_swiglu

            fuse_swiglu(work, find_swiglu(work))
        syncs = _surviving_syncs(work)
    except Exception as exc:
        if config.strict:
            raise
        log.warning("moe_regions: lowering failed (%s: %s); graph left unchanged", type(exc).__name__, exc)
        records += [RegionRecord(r.module, r.form, "rejected", f"lower_moe_region failed: {type(exc).__name__}: {exc}",
                                 (), r.where, r.num_experts, r.top_k) for r in accepted]
        _count(records)
        return gm, records
    ops = _ops_used(work)
    notes = (f"where/nonzero still needed outside the rewritten regions: {', '.join(syncs)}",) if syncs else ()
    notes += _list_weight_note(work)
    for region in accepted:
        records.append(RegionRecord(region.module, region.form, "rewritten", "", ops, region.where,
                                    region.num_experts, region.top_k, notes))
    _count(records)
    if verbose:
        debug.log_rewrite(before, work.print_readable(print_output=False), records, time.perf_counter() - t0,
                          loud=config.debug)
    return work, records


def _list_weight_note(gm: fx.GraphModule) -> tuple[str, ...]:
    """Per-expert weight lists (ModuleList experts) cost host time per parameter on every step."""
    n = sum(len(a) for node in gm.graph.nodes if (canon(node) or "").startswith("moe_compile::grouped_mm_list")
            for a in node.args if isinstance(a, (list, tuple)))
    if n < 64:
        return ()
    return (f"{n} per-expert weight tensors enter the compiled graph one by one (ModuleList experts): guards, "
            "autograd and gradient accumulation cost host time for each on every step (~10 us each); if the step is "
            "host-bound, mode=\"reduce-overhead\" (CUDA graphs) hides the kernel launches, "
            "`with moe_compile.compiled_backward(): loss.backward()` runs the backward and its per-parameter "
            "gradient accumulation as one compiled graph, and storing each projection's experts as one 3-D "
            "parameter [E, N, K] (as transformers 5 does) removes the per-parameter cost (docs/benchmarks.md)",)


def _count(records):
    for r in records:
        counters[r.status] += 1
