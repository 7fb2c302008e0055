"""The moe_compile custom ops (``torch.ops.moe_compile.*``): importing this module registers all of them.

Every op has static output shapes (no data-dependent sizes, no host sync in the graph), a fake
(meta) implementation, an autograd formula built from other ops, and a pure-torch reference in
``reference.py``; ``registry.implementation`` picks what runs on each device.

    routing_ops     route_permute, permute_rows, permute_scale(_backward), saved_copy,
                    unpermute_combine(_backward), unpermute_sum, router_topk
    gemm_ops        grouped_mm, grouped_mm_cat(_dx), grouped_mm_list, grouped_mm_list_cat(_dx),
                    grouped_mm_wgrad(_lowp), grouped_bias_grad
    activation_ops  swiglu, swiglu_backward, weighted_swiglu(_backward)
    ep              ep_experts, ep_plan, ep_dispatch, ep_combine (expert parallelism)
    runtime_ops     torch.ops.moe_compile_rt.<op>: what compiled (differentiated) graphs call, the
                    same functions without the custom op's Python autograd and backend layers

A compiled backward loaded from Inductor's / AOTAutograd's cache in a new process is not re-traced,
so the generated code finds every op it calls only if all of them are registered: the lowering
imports this module.
"""
from __future__ import annotations

from .activation_ops import swiglu, swiglu_backward, weighted_swiglu, weighted_swiglu_backward
from .ep import ep_combine, ep_dispatch, ep_experts, ep_plan
from .gemm_ops import (cat_without_copy, grouped_bias_grad, grouped_mm, grouped_mm_cat, grouped_mm_cat_dx,
                       grouped_mm_list, grouped_mm_list_cat, grouped_mm_list_cat_dx, grouped_mm_weight_grad,
                       grouped_mm_wgrad, grouped_mm_wgrad_lowp)
from .layout import even_step, pair_view, stack_expert_weights, strided_stack
from .routing_ops import (permute_rows, permute_scale, permute_scale_backward, route_permute, router_topk,
                          saved_copy, unpermute_combine, unpermute_combine_backward, unpermute_sum)
from . import runtime_ops  # noqa: E402,F401  (the moe_compile_rt twins compiled graphs call; registered at import)

__all__ = ["cat_without_copy", "ep_combine", "ep_dispatch", "ep_experts", "ep_plan", "even_step", "grouped_bias_grad",
           "grouped_mm",
           "grouped_mm_cat", "grouped_mm_cat_dx", "grouped_mm_list", "grouped_mm_list_cat", "grouped_mm_list_cat_dx",
           "grouped_mm_weight_grad", "grouped_mm_wgrad", "grouped_mm_wgrad_lowp", "pair_view", "permute_rows",
           "permute_scale", "permute_scale_backward", "route_permute", "router_topk", "saved_copy",
           "stack_expert_weights", "strided_stack", "swiglu", "swiglu_backward", "unpermute_combine",
           "unpermute_combine_backward", "unpermute_sum", "weighted_swiglu", "weighted_swiglu_backward"]
