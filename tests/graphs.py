"""Dynamo graphs for finder and legality unit tests: captured once per test session, no AOTAutograd or Inductor.

    gm, inputs = dynamo_graph(("loop", "index_add", 2, "softmax_topk", "swiglu", None))
    verdicts = check_all(gm)                  # legality verdict per candidate, all finders
    new, records = rewrite(spec)              # the dynamo stage (find, check, lower, fuse) on a copy

A spec is a hashable tuple naming a model from ``helpers`` / ``test_grouped_forms`` (see
``build``); the graph is what this torch version's Dynamo really produces for it, with the backend's
data-dependent capture on (as ``backend="moe"`` traces it).
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

import helpers
from moe_compile.config import MoEConfig
from moe_compile.passes.legality import check
from moe_compile.passes.normalize import annotate


def build(spec: tuple):
    """(model, example inputs) for a spec: ("loop", spelling, k, router, expert, shared[, routing]) |
    ("sorted" | "batched" | "dense", frozenset of keyword items) | ("fn", callable, inputs)."""
    kind = spec[0]
    if kind == "loop":
        _, spelling, k, router, expert, shared, *rest = spec
        model = helpers.make_model(spelling=spelling, k=k, e=4, router=router, expert=expert, shared=shared,
                                   routing=rest[0] if rest else "random")
        return model, (helpers.make_input((2, 5, 16), requires_grad=False),)
    if kind in ("sorted", "batched", "dense"):
        import test_grouped_forms as forms

        cls = {"sorted": forms.SortedMoE, "batched": forms.BatchedMoE, "dense": forms.DenseMoE}[kind]
        torch.manual_seed(0)
        return cls(**dict(spec[1])), (helpers.make_input((2, 8, 16), requires_grad=False),)
    if kind == "fn":
        return spec[1], spec[2]
    raise ValueError(spec)


@functools.cache
def dynamo_graph(spec: tuple) -> tuple[fx.GraphModule, list]:
    """Dynamo's graph of the spec's model (one graph: a break fails here) and its example inputs."""
    model, inputs = build(spec)
    got = []

    def grab(gm, example_inputs):
        got.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), torch.no_grad():
        torch.compile(model, backend=grab)(*inputs)
    assert len(got) == 1, f"{spec}: Dynamo produced {len(got)} graphs"
    return got[0]


def candidates(gm: fx.GraphModule) -> list:
    """Every finder's candidates on a copy of ``gm`` (normalised as the pipeline does)."""
    from moe_compile.passes.grouped_regions import find_grouped_regions
    from moe_compile.passes.loop_regions import find_loop_regions
    from moe_compile.lowering.graph_edit import copy_graph_module

    work = copy_graph_module(gm)
    annotate(work.graph)
    return find_loop_regions(work) + find_grouped_regions(work)


def check_all(gm: fx.GraphModule) -> list:
    return [check(c) for c in candidates(gm)]


def rewrite(spec: tuple, **options):
    """The dynamo stage on the spec's graph: (rewritten copy, records)."""
    from moe_compile.pipeline import run_dynamo_stage

    gm, inputs = dynamo_graph(spec)
    return run_dynamo_stage(gm, inputs, MoEConfig(inductor=False, **options))


def ops_in(gm: fx.GraphModule) -> list[str]:
    """moe_compile op names called by ``gm``, one entry per call."""
    return [n.target._opname for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", "") == "moe_compile"]
