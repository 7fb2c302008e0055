"""The ops compiled graphs call: ``torch.ops.moe_compile_rt.<op>``, one twin per compute op.

Same schema, tags, fake implementation and function as ``torch.ops.moe_compile.<op>`` (the
``torch.library.custom_op`` of ``routing_ops`` / ``gemm_ops`` / ``activation_ops``), registered straight
with the dispatcher (``Library.impl`` at ``CompositeExplicitAutograd``) and without an autograd
formula. A namespace of their own, not a second overload: ``torch.library.opcheck`` and other tools
take a single-overload packet ``torch.ops.moe_compile.<op>``.

Why: a compiled graph calls each op after AOTAutograd has differentiated it, with grad mode off,
yet a ``custom_op`` call still runs two Python layers before the op's function: the autograd
kernel (which finds nothing to record and redispatches) and the backend wrapper (an output-aliasing
check and a Dynamo-disable wrapper). On an H100 machine's host CPU the custom op cost 28-69 µs per
call more than the twin, which costs 8-23 µs more than the function itself
(``examples/benchmark/op_overhead.py``), at 14 calls per MoE layer per training step. The
aliasing check is not repeated here: the twins are opchecked for it (tests/test_runtime_ops.py), and
every implementation returns fresh tensors. ``lowering/runtime_ops.py`` puts the twins into the
post-grad graphs.

Contract: a twin is for graphs that are already differentiated (AOTAutograd's forward and backward
after its post-grad passes; compiled autograd retraces the custom ops, not the twins). A backward
through one is PyTorch's autograd fallback: it warns that no autograd kernel is registered, and the
gradient is then whatever the implementation's own recorded ops give (the CPU references record
theirs; the Triton kernels record nothing: None). The passes name both ``moe_compile::<op>``
(``passes/normalize.canon``); the profiler shows ``moe_compile_rt::<op>`` for calls from compiled
code (``profiler_names``).

Registered when ``kernels/ops.py`` is imported (compiled code loaded from a cache finds them). If
this torch's ``custom_op`` object lacks what is needed here, no twin is defined and the graphs keep
calling the custom op.
"""
from __future__ import annotations

import logging

import torch

from . import activation_ops, gemm_ops, routing_ops

log = logging.getLogger(__name__)

NAMESPACE = "moe_compile_rt"
# every op of a rewritten region's forward and backward; the opaque expert-parallel ops (ep.py) keep
# their custom-op path (they run outside compiled graphs)
OPS = {
    "route_permute": routing_ops.route_permute,
    "permute_rows": routing_ops.permute_rows,
    "permute_scale": routing_ops.permute_scale,
    "permute_scale_backward": routing_ops.permute_scale_backward,
    "saved_copy": routing_ops.saved_copy,
    "unpermute_combine": routing_ops.unpermute_combine,
    "unpermute_combine_backward": routing_ops.unpermute_combine_backward,
    "unpermute_sum": routing_ops.unpermute_sum,
    "router_topk": routing_ops.router_topk,
    "grouped_mm": gemm_ops.grouped_mm,
    "grouped_mm_wgrad": gemm_ops.grouped_mm_wgrad,
    "grouped_mm_wgrad_lowp": gemm_ops.grouped_mm_wgrad_lowp,
    "grouped_bias_grad": gemm_ops.grouped_bias_grad,
    "grouped_mm_list": gemm_ops.grouped_mm_list,
    "grouped_mm_cat": gemm_ops.grouped_mm_cat,
    "grouped_mm_cat_dx": gemm_ops.grouped_mm_cat_dx,
    "grouped_mm_list_cat": gemm_ops.grouped_mm_list_cat,
    "grouped_mm_list_cat_dx": gemm_ops.grouped_mm_list_cat_dx,
    "swiglu": activation_ops.swiglu,
    "swiglu_backward": activation_ops.swiglu_backward,
    "weighted_swiglu": activation_ops.weighted_swiglu,
    "weighted_swiglu_backward": activation_ops.weighted_swiglu_backward,
}

_LIB = torch.library.Library(NAMESPACE, "DEF")  # noqa: TOR901 (kept alive: owns the registrations)


def _register(name: str, op) -> bool:
    fn, fake = getattr(op, "_init_fn", None), getattr(op, "_abstract_fn", None)
    default = getattr(torch.ops.moe_compile, name).default
    if fn is None or fake is None:
        return False
    schema = str(default._schema).split("::", 1)[1]
    assert schema.startswith(name + "("), schema
    _LIB.define(schema, tags=tuple(default.tags))
    _LIB.impl(name, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    return True


def _register_all() -> dict:
    done = {}
    for name, op in OPS.items():
        try:
            if _register(name, op):
                twin = getattr(getattr(torch.ops, NAMESPACE), name).default
                done[getattr(torch.ops.moe_compile, name).default] = twin
        except Exception as exc:  # an older/newer torch: the graphs keep the custom ops
            log.debug("moe_compile: no %s twin for %s (%s: %s)", NAMESPACE, name, type(exc).__name__, exc)
    return done


RUNTIME = _register_all()   # torch.ops.moe_compile.<op>.default -> torch.ops.moe_compile_rt.<op>.default


def profiler_names(op: str) -> tuple[str, str]:
    """The names a call of ``op`` has in a torch.profiler trace: from user code or a Dynamo graph,
    and from compiled code."""
    return f"moe_compile::{op}", f"{NAMESPACE}::{op}"


def count_calls(events, op: str) -> int:
    """Calls of ``op`` among a torch.profiler trace's events, under either name, each counted once
    (not the op's own nested dispatch events)."""
    names = profiler_names(op)
    return sum(1 for e in events if e.name in names and (e.cpu_parent is None or e.cpu_parent.name not in names))
