"""The pass table: every pass the backend runs, in order, one stage per place a graph exists.

    stage          graph                                     passes
    dynamo         a copy of Dynamo's torch-level graph      normalize, loop_regions, grouped_regions,
                                                             check, unclaimed, lower, static_counts, swiglu,
                                                             weights_in_swiglu, router_topk, host_syncs
    before_compile the rewritten graph and its real inputs   stack_expert_params
    post_grad      each forward / backward ATen graph after  wgrad_early, ep_overlap, runtime_ops
                   AOTAutograd (Inductor's post-grad hook,
                   or the aot_eager compilers)
    after_compile  the compiled graph's real inputs          rehome_weights

The post_grad passes only edit graphs: they note nothing, because Inductor's FX graph cache skips
them on a hit (their names and a digest of this package's source are the cache key's part,
``backend._PostGradPass.uuid``). What a user must be told is found in the other stages, which run
on every compile.

``moe.disable`` names optional passes to skip (never ``normalize``, ``check`` or ``lower``);
``moe.debug`` logs the graph after each pass. ``run_dynamo_stage`` works on a copy of Dynamo's
graph, subgraphs included: if a pass fails, the original graph is compiled unchanged (a warning,
or an error with ``moe.strict``) and the regions are recorded as refused with the error.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import torch.fx as fx

from moe_compile.passes.normalize import annotate, canon
from moe_compile.passes.writes import graph_scans_shared

from .records import REFUSED, REWRITTEN, RegionRecord

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    stage: str          # "dynamo" | "before_compile" | "post_grad" | "after_compile"
    run: Callable       # (state) -> None
    optional: bool
    doc: str
    inductor_only: bool = False   # post_grad: not in the aot_eager path (moe.inductor=False)


@dataclasses.dataclass
class DynamoState:
    """The dynamo stage's work: the graph copy and what the passes found so far."""
    gm: fx.GraphModule
    example_inputs: list
    config: object
    candidates: list = dataclasses.field(default_factory=list)
    accepted: list = dataclasses.field(default_factory=list)      # passes.region.Region
    refused: list = dataclasses.field(default_factory=list)       # passes.legality.Refusal
    errors: list = dataclasses.field(default_factory=list)        # RegionRecord of matcher failures
    region_notes: dict = dataclasses.field(default_factory=dict)  # id(region) -> notes from its lowering
    region_nodes: dict = dataclasses.field(default_factory=dict)  # id(region) -> nodes its lowering added
    unclaimed: list = dataclasses.field(default_factory=list)     # RegionRecord: MoE-like code no region covers
    graph_notes: list = dataclasses.field(default_factory=list)   # notes for every rewritten region of the graph
    routed_inputs: frozenset = frozenset()   # a checkpoint body's placeholders fed a router's indices by its caller


# ------------------------------------------------------------------------------- dynamo stage
def _finder(name: str, module: str, fn: str):
    def run(s: DynamoState) -> None:
        import importlib

        finder = getattr(importlib.import_module(module), fn)
        try:
            s.candidates += finder(s.gm)
        except Exception as exc:  # a matcher bug must not break the user's compile
            if s.config.strict:
                raise
            log.warning("moe_compile: %s failed (%s: %s); its regions are left unchanged", name,
                        type(exc).__name__, exc)
            from moe_compile.passes import reasons

            detail = {"finder": name, "error": f"{type(exc).__name__}: {exc}"}
            s.errors.append(RegionRecord("", "?", REFUSED, reasons.message("matcher_error", detail), (), "",
                                         code="matcher_error", fix=reasons.fix("matcher_error")))
    return run


def _check(s: DynamoState) -> None:
    from moe_compile.passes.legality import Accepted, check, random_in_experts, refusal

    # where this compile draws random numbers as eager does, regions whose experts draw are refused
    # (legality.random_in_experts); under Inductor's own random numbers no draw is eager's anyway.
    # explain() runs without Inductor but reports what the compile it explains does
    import torch

    from moe_compile.records import current_session

    session = current_session()
    aot_only = not (session.explain_inductor if session.explaining else s.config.inductor)
    eager_draws = aot_only or bool(torch._inductor.config.fallback_random)
    for c in s.candidates:
        verdict = check(c)
        drawn = random_in_experts(verdict.region) if isinstance(verdict, Accepted) and eager_draws else None
        if drawn is not None:
            verdict = refusal(c, drawn)
        (s.accepted if isinstance(verdict, Accepted) else s.refused).append(
            verdict.region if isinstance(verdict, Accepted) else verdict)


def _lower(s: DynamoState) -> None:
    from moe_compile.lowering.expert_parallel import check_data_dependent_tokens
    from moe_compile.lowering.graph_edit import finish
    from moe_compile.lowering.region_chain import RegionChain
    from moe_compile.passes.autocast import narrowed_product, wide_experts_note

    autocast = narrowed_product(s.gm.graph.nodes) if s.accepted else None   # read before any region is lowered
    chain = RegionChain(s.gm)   # in graph order: a region may read what an earlier one computes
    for region in chain.in_order(s.accepted):
        check_data_dependent_tokens(region, s.config.inductor)
        wide = wide_experts_note(region, autocast)
        notes, added = chain.lower(region, s.config.ep_overlap_chunks)
        s.region_notes[id(region)], s.region_nodes[id(region)] = notes + ((wide,) if wide else ()), added
    finish(s.gm)   # dead code, orphaned asserts, lint: once per graph, not per region


def _unclaimed(s: DynamoState) -> None:
    """Never silent: records for code that looks like MoE but that no candidate covers."""
    if s.errors:
        return  # a finder failed: its matcher_error record already lists this graph
    from moe_compile.passes.unclaimed import unclaimed_records

    try:
        disabled = tuple(n for n in ("loop_regions", "grouped_regions") if n in s.config.disable)
        s.unclaimed += unclaimed_records(s.gm, s.example_inputs, s.candidates, disabled, s.routed_inputs)
    except Exception as exc:  # a detector bug must not stop the rewrite of what was found
        if s.config.strict:
            raise
        log.warning("moe_compile: the unclaimed-MoE detector failed (%s: %s)", type(exc).__name__, exc)
        from moe_compile.passes import reasons

        detail = {"finder": "unclaimed", "error": f"{type(exc).__name__}: {exc}"}
        s.errors.append(RegionRecord("", "?", REFUSED, reasons.message("matcher_error", detail), (), "",
                                     code="matcher_error", fix=reasons.fix("matcher_error")))


def _swiglu(s: DynamoState) -> None:
    if s.accepted:
        from moe_compile.lowering.swiglu import fuse_swiglu
        from moe_compile.passes.swiglu import find_swiglu

        fuse_swiglu(s.gm, find_swiglu(s.gm))


def _weights_in_swiglu(s: DynamoState) -> None:
    from moe_compile.lowering.weights_in_swiglu import weights_into_swiglu
    from moe_compile.passes.weights_in_swiglu import find_weights_in_swiglu

    matches = find_weights_in_swiglu(s.gm)
    for m, added in zip(matches, weights_into_swiglu(s.gm, matches)):
        for r in s.accepted:  # listed with the region whose combine it replaced (explain's ops)
            if m.combine in s.region_nodes.get(id(r), ()):
                s.region_nodes[id(r)].update(added)


def _static_counts(s: DynamoState) -> None:   # runs only where a region was accepted (_REWRITES)
    from moe_compile.lowering.static_counts import use_static_counts
    from moe_compile.passes.static_counts import find_static_counts

    try:
        found = find_static_counts(s.gm.graph)
    except Exception as exc:  # an optional pass: a finder bug must not cost the graph its rewrite
        if s.config.strict:
            raise
        log.warning("moe_compile: static_counts failed (%s: %s); bincounts left as written", type(exc).__name__, exc)
        return
    use_static_counts(s.gm, found)


def _router_topk(s: DynamoState) -> None:
    if s.accepted:
        from moe_compile.lowering.router_topk import use_router_topk
        from moe_compile.passes.router_topk import find_router_topks

        matches = find_router_topks(s.gm)
        for m, node in zip(matches, use_router_topk(s.gm, matches)):
            for r in s.accepted:  # listed with the region it routes (explain's ops)
                if m.seed in s.region_nodes.get(id(r), ()):
                    s.region_nodes[id(r)].add(node)


def _host_syncs(s: DynamoState) -> None:
    """What still makes the host wait once the regions are rewritten (code outside them)."""
    if not s.accepted:
        return
    from moe_compile.passes.host_syncs import find_host_syncs, sync_note

    try:
        found = find_host_syncs(s.gm.graph)
    except Exception as exc:  # a detector bug must not stop the rewrite
        if s.config.strict:
            raise
        log.warning("moe_compile: the host-sync detector failed (%s: %s)", type(exc).__name__, exc)
        return
    if found:
        s.graph_notes.append(sync_note(found))


# ------------------------------------------------------------------------------- later stages
def _wgrad_early(graph: fx.Graph) -> None:
    from moe_compile.lowering.wgrad_order import hoist_weight_gradients

    hoist_weight_gradients(graph)


def _ep_overlap(graph: fx.Graph) -> None:
    from moe_compile.lowering.overlap import schedule_collectives

    schedule_collectives(graph)


def _runtime_ops(graph: fx.Graph) -> None:
    from moe_compile.lowering.runtime_ops import use_runtime_ops

    use_runtime_ops(graph)


@dataclasses.dataclass
class BeforeCompileState:
    """The before_compile stage's work: the rewritten graph (edited in place), the inputs it will be
    compiled with, and the plan that maps Dynamo's inputs onto them (``lowering/expert_stack.py``)."""
    gm: fx.GraphModule
    inputs: list
    may_move: bool
    plan: object = None
    records: list = dataclasses.field(default_factory=list)
    to_rehome: list = dataclasses.field(default_factory=list)   # stacked Parameter groups, moved after compiling
    notes: list = dataclasses.field(default_factory=list)


def _stack_expert_params(s: BeforeCompileState) -> None:
    from moe_compile.lowering.expert_stack import stack_expert_params

    s.plan, s.inputs, s.to_rehome, notes = stack_expert_params(s.gm, s.inputs, s.may_move)
    s.notes += notes


def _rehome(state) -> None:
    gm, example_inputs, notes, stacked = state
    from moe_compile.lowering.expert_stack import rehome_groups
    from moe_compile.lowering.rehome import rehome_expert_weights
    from moe_compile.passes.checkpoint_bodies import checkpoint_bodies

    notes += rehome_groups(stacked) + rehome_expert_weights(gm, example_inputs)
    for b in checkpoint_bodies(gm, example_inputs):   # their placeholders' values: the caller's inputs
        notes += rehome_expert_weights(b.body, list(b.example_inputs))


PASSES: tuple[Pass, ...] = (
    Pass("normalize", "dynamo", lambda s: annotate(s.gm.graph), False,
         "name every call node's op once (passes/normalize.py)"),
    Pass("loop_regions", "dynamo", _finder("loop_regions", "moe_compile.passes.loop_regions", "find_loop_regions"),
         True, "find per-expert loops (passes/loop_regions.py)"),
    Pass("grouped_regions", "dynamo",
         _finder("grouped_regions", "moe_compile.passes.grouped_regions", "find_grouped_regions"),
         True, "find sorted / batched / dense forms (passes/grouped_regions.py)"),
    Pass("check", "dynamo", _check, False, "accept each candidate or refuse it with a reason (passes/legality.py)"),
    Pass("unclaimed", "dynamo", _unclaimed, False,
         "record MoE-like code that no candidate covers (passes/unclaimed.py): never silent"),
    Pass("lower", "dynamo", _lower, False, "rewrite accepted regions into moe_compile ops (lowering/region.py)"),
    Pass("static_counts", "dynamo", _static_counts, True,
         "bincount(router ids, minlength=E) or torch.tensor(len(tok) per expert) still read outside the regions "
         "(a load-balancing loss) -> static counts on the device, no host read (lowering/static_counts.py)"),
    Pass("swiglu", "dynamo", _swiglu, True,
         "silu(h[:, :N]) * h[:, N:] on rewritten GEMM outputs -> moe_compile.swiglu (lowering/swiglu.py)"),
    Pass("weights_in_swiglu", "dynamo", _weights_in_swiglu, True,
         "a combine's routing weights -> moe_compile.weighted_swiglu before a bias-free down projection, the "
         "combine -> moe_compile.unpermute_sum: its backward no longer reads the expert outputs "
         "(lowering/weights_in_swiglu.py)"),
    Pass("router_topk", "dynamo", _router_topk, True,
         "torch.topk in the routers of rewritten regions -> moe_compile.router_topk (lowering/router_topk.py)"),
    Pass("host_syncs", "dynamo", _host_syncs, True,
         "note the host-sync ops left in a rewritten graph, outside its regions (passes/host_syncs.py)"),
    Pass("stack_expert_params", "before_compile", _stack_expert_params, True,
         "ModuleList expert weights -> one graph input (one autograd leaf) per buffer (lowering/expert_stack.py)"),
    Pass("wgrad_early", "post_grad", _wgrad_early, True,
         "run each expert weight-gradient GEMM as soon as its inputs exist: its inputs are freed before the "
         "input-gradient GEMMs allocate; under Inductor, whose memory-aware reordering checks the order "
         "(lowering/wgrad_order.py)", inductor_only=True),
    Pass("ep_overlap", "post_grad", _ep_overlap, True,
         "issue each expert-parallel all-to-all early, wait late: another chunk's GEMMs run under it "
         "(lowering/overlap.py)"),
    Pass("runtime_ops", "post_grad", _runtime_ops, True,
         "each moe_compile op call -> its moe_compile_rt twin: the same kernel without the custom op's "
         "Python autograd and backend layers, which a differentiated graph does not need (lowering/runtime_ops.py)"),
    Pass("rehome_weights", "after_compile", _rehome, True,
         "move ModuleList expert weights into one buffer per linear (lowering/rehome.py)"),
)
PASS_NAMES = tuple(p.name for p in PASSES)
OPTIONAL_PASSES = tuple(p.name for p in PASSES if p.optional)


def enabled(stage: str, config) -> list[Pass]:
    return [p for p in PASSES if p.stage == stage and p.name not in config.disable]


# ------------------------------------------------------------------------------- the driver
def _ops_used(gm: fx.GraphModule, nodes=None) -> tuple[str, ...]:
    """The moe_compile ops of ``nodes`` (default: the whole graph), in graph order."""
    names = [canon(n).split("::", 1)[1] for n in gm.graph.nodes if (nodes is None or n in nodes)
             and (canon(n) or "").startswith("moe_compile::")]
    return tuple(dict.fromkeys(names))


def _with_fused(nodes: set) -> set:
    """A region's nodes plus the ops later passes fused onto them (moe_compile.swiglu of its GEMM output)."""
    return nodes | {u for n in nodes for u in n.users if (canon(u) or "") == "moe_compile::swiglu"}


_REWRITES = ("lower", "static_counts", "swiglu", "weights_in_swiglu", "router_topk")   # dynamo passes that edit the graph
_READS_ONLY = ("loop_regions", "grouped_regions", "check", "unclaimed")   # their scans are shared


def run_dynamo_stage(gm: fx.GraphModule, example_inputs, config) -> tuple[fx.GraphModule, list[RegionRecord]]:
    """The dynamo stage on a copy of ``gm``: (the graph to compile, one record per MoE region).

    The passes run on the graph and, as graphs of their own, on the bodies of its
    ``torch.utils.checkpoint`` regions (``passes/checkpoint_bodies.py``), which the copy holds: a
    rewrite there is compiled with the rest. A failure anywhere compiles ``gm`` unchanged."""
    from moe_compile import debug
    from moe_compile.lowering.graph_edit import copy_graph_module
    from moe_compile.passes.checkpoint_bodies import checkpoint_bodies

    passes = enabled("dynamo", config)
    if not any(p.name.endswith("_regions") or p.name == "unclaimed" for p in passes):
        return gm, []
    t0 = time.perf_counter()
    top = DynamoState(copy_graph_module(gm), example_inputs, config)
    states = [top] + [DynamoState(b.body, list(b.example_inputs), config, routed_inputs=b.routed_inputs)
                      for b in checkpoint_bodies(top.gm, example_inputs)]
    verbose = config.debug or log.isEnabledFor(logging.DEBUG)
    graphs = [("dynamo graph", top.gm.print_readable(print_output=False))] if verbose else []
    for s in states:
        try:
            for p in passes:
                if p.name in _REWRITES and not s.accepted:
                    continue
                with graph_scans_shared(p.name in _READS_ONLY):
                    p.run(s)
                if verbose and p.name in _REWRITES:
                    graphs.append((f"after {p.name}", s.gm.print_readable(print_output=False)))
        except Exception as exc:
            from moe_compile.lowering.graph_edit import InvalidSetup

            if isinstance(exc, InvalidSetup):   # the graph's records go with it: explain() reports them
                exc.records = tuple([rec for t in states for rec in _not_rewritten(t)]
                                    + [_refused(r, "invalid_setup", exc) for r in s.accepted])
                raise
            if config.strict:
                raise
            log.warning("moe_compile: lowering failed (%s: %s); the graph is compiled unchanged",
                        type(exc).__name__, exc)
            failed = [_refused(r, "lowering_error", exc) for t in states for r in t.accepted]
            return gm, [rec for t in states for rec in _not_rewritten(t)] + failed
    for s in [s for s in states if s.accepted]:   # the passes edited the graph, not its code: regenerated once
        s.gm.recompile()
    records = [rec for s in states for rec in _not_rewritten(s)]
    if not any(s.accepted for s in states):
        if verbose:   # a refusal's graph, to read what the finders saw
            shown = [("as captured (nothing rewritten)", gm.print_readable(print_output=False))] if records else []
            debug.log_rewrite(shown, records, time.perf_counter() - t0, loud=config.debug)
        return gm, records
    for s in states:
        notes = tuple(s.graph_notes)
        alive = set(s.gm.graph.nodes)
        for r in s.accepted:
            nodes = _with_fused(s.region_nodes.get(id(r), alive) & alive)
            records.append(RegionRecord(r.module, r.form, REWRITTEN, "", _ops_used(s.gm, nodes), r.where,
                                        r.router.num_experts, r.router.top_k,
                                        s.region_notes.get(id(r), ()) + notes + _list_weight_note(s.gm, nodes)))
    if verbose:
        debug.log_rewrite(graphs, records, time.perf_counter() - t0, loud=config.debug)
    return top.gm, records


def check_ep_markers(gm: fx.GraphModule, records: list, cause: BaseException | None = None) -> None:
    """Never a compiled graph that fails on its first call: expert-parallel markers that no rewrite
    replaced (passes/ep_markers.py) raise here, at compile time, with the refusals and the fix."""
    from moe_compile.passes.ep_markers import error_message, leftover_markers

    left = leftover_markers(gm)
    if left:
        from moe_compile.lowering.graph_edit import InvalidSetup

        err = InvalidSetup(error_message(left, [r for r in records if r.status == REFUSED and not r.is_break], cause))
        err.records = tuple(records)   # explain() reports them with the error (the graph is never published)
        raise err


def _refused(r, code: str, exc: BaseException) -> RegionRecord:
    """The record of an accepted region ``r`` whose lowering raised ``exc``."""
    from moe_compile.passes import reasons

    detail = {"error": f"{type(exc).__name__}: {exc}"}
    return RegionRecord(r.module, r.form, REFUSED, reasons.message(code, detail), (), r.where, r.router.num_experts,
                        r.router.top_k, code=code, fix=reasons.fix(code))


def _not_rewritten(s: DynamoState) -> list[RegionRecord]:
    """A state's records of what it did not rewrite: finder errors, refusals, unclaimed MoE-like code."""
    from moe_compile.passes.legality import Refusal

    return s.errors + [RegionRecord(r.module, r.form, REFUSED, r.message, (), r.where, r.num_experts, r.top_k,
                                    code=r.code, fix=r.fix) for r in s.refused if isinstance(r, Refusal)] + s.unclaimed


_LIST_NOTE = " per-expert weight tensors enter the compiled graph"


def _list_weight_note(gm: fx.GraphModule, nodes=None) -> tuple[str, ...]:
    """Per-expert weight lists (ModuleList experts) cost host time per parameter on every step."""
    n = sum(len(a) for node in gm.graph.nodes if (nodes is None or node in nodes)
            and (canon(node) or "").startswith("moe_compile::grouped_mm_list")
            for a in node.args if isinstance(a, (list, tuple)))
    if n < 64:
        return ()
    return (f"{n}{_LIST_NOTE} one by one (ModuleList experts): guards, "
            "autograd and gradient accumulation cost host time for each on every step (~10 us each; the backend "
            "stacks them into one input per buffer where nothing hooks their gradients: moe.stack_expert_params); "
            "if the step is host-bound, mode=\"reduce-overhead\" (CUDA graphs) hides the kernel launches, "
            "`with moe_compile.compiled_backward(): loss.backward()` runs the backward and its per-parameter "
            "gradient accumulation as one compiled graph, and storing each projection's experts as one 3-D "
            "parameter [E, N, K] (as transformers 5 does) removes the per-parameter cost (docs/benchmarks.md)",)


def post_grad_hook(config):
    """The post_grad stage as a graph pass (Inductor's ``post_grad_custom_post_pass`` or the
    aot_eager compilers): runs each enabled post-grad pass on every forward/backward graph (none
    when ``moe.disable`` names them all: the hook is still installed, it carries the cache key).
    The hook's ``passes`` names them (part of the Inductor cache key, ``backend._PostGradPass.uuid``)."""
    passes = [p for p in enabled("post_grad", config) if config.inductor or not p.inductor_only]

    def run(graph: fx.Graph) -> None:
        if any((canon(n) or "").startswith("moe_compile::") for n in graph.nodes):
            for p in passes:
                p.run(graph)

    run.passes = tuple(p.name for p in passes)
    return run


def keep_weights_in_nested_region(gm: fx.GraphModule, records: list, config):
    """(config, records) for compiling ``gm``: ``rehome_weights`` off for this graph, noted, where a rewritten
    region runs in a nested_compile_region function (``lowering/rehome.nested_region_note``)."""
    from moe_compile.lowering.rehome import nested_region_note
    from moe_compile.records import current_session

    if "rehome_weights" in config.disable and not current_session().explaining:   # explain() never re-homes
        return config, records
    note = nested_region_note(gm)
    if note is None:
        return config, records
    return (dataclasses.replace(config, disable=tuple(dict.fromkeys(config.disable + ("rehome_weights",)))),
            [dataclasses.replace(r, notes=r.notes + (note,)) if r.status == REWRITTEN else r for r in records])


def run_before_compile(gm: fx.GraphModule, example_inputs, records: list, config) -> BeforeCompileState:
    """The before_compile stage on the rewritten graph (edited in place). Returns its state: the plan
    (None when the graph keeps Dynamo's inputs), the inputs to compile it with, the records (what the
    stage did noted; op names and notes of the weight lists it replaced updated) and the Parameter
    groups for the after_compile stage to re-home."""
    s = BeforeCompileState(gm, list(example_inputs), "rehome_weights" not in config.disable)
    for p in enabled("before_compile", config):
        p.run(s)
    if s.plan is not None and not any((canon(n) or "").startswith("moe_compile::grouped_mm_list") for n in gm.graph.nodes):
        # every weight list became a stack: the regions run the 3-D-weight ops, with no per-Parameter cost
        records = [dataclasses.replace(r, ops=tuple(dict.fromkeys("grouped_mm" if o.startswith("grouped_mm_list") else o
                                                                  for o in r.ops)),
                                       notes=tuple(n for n in r.notes if _LIST_NOTE not in n))
                   if r.status == REWRITTEN else r for r in records]
    if s.notes:
        records = [dataclasses.replace(r, notes=r.notes + tuple(s.notes)) if r.status == REWRITTEN else r
                   for r in records]
    s.records = records
    if s.plan is not None and (config.debug or log.isEnabledFor(logging.DEBUG)):
        from moe_compile import debug

        debug.log_rewrite([("after stack_expert_params", gm.print_readable(print_output=False))], records,
                          None, loud=config.debug)
    return s


def run_after_compile(gm: fx.GraphModule, example_inputs, records: list, config, stacked: list = ()) -> list:
    """The after_compile stage; returns the records with what it did noted on rewritten regions.
    ``stacked``: Parameter groups the compiled graph reads as stacked inputs (``run_before_compile``)."""
    notes: list = []
    for p in enabled("after_compile", config):
        p.run((gm, example_inputs, notes, list(stacked)))
    if not notes:
        return records
    return [dataclasses.replace(r, notes=r.notes + tuple(notes)) if r.status == REWRITTEN else r for r in records]
