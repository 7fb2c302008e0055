"""CUDA graphs for a graph compiled inside a non-reentrant ``torch.utils.checkpoint``.

A compiled module called inside a non-reentrant checkpoint (transformers'
``gradient_checkpointing_enable()`` with ``compile_blocks`` or ``layer.compile()``, or any
``checkpoint(compiled, ...)``) runs twice per step: in the forward, and again when the backward
recomputes it. With Inductor's CUDA graphs (``mode="reduce-overhead"``, ``triton.cudagraphs``) the
recomputation keeps alive a tensor that died while the graph was recorded, and torch 2.11 raises
"graph recording observed an input tensor deallocate during graph recording that did not occur
during replay" on the first step (pytorch/pytorch#154306; stock ``torch.compile`` fails the same
way: measured with one to four decoder layers of a transformers Qwen3-MoE on an H200,
docs/benchmarks.md). A whole-model compile is not affected: its checkpoints are inside the graph
(``tag_activation_checkpoint``), and Inductor records the graphs once per step.

So a graph that Dynamo hands to the backend while a checkpoint's saved-tensor hooks are active is
compiled without CUDA graphs, with one warning naming the ways out; the rest of the model keeps them.
A whole-model compile keeps CUDA graphs with checkpointing, but is not the faster choice on a
GPU-bound step (docs/benchmarks.md, section 0: per-layer compiles without CUDA graphs 1.28x it).
Detection: the top saved-tensor hooks are torch.utils.checkpoint's (``_checkpoint_hook`` in the
forward, ``_recomputation_hook`` when a recomputation compiles), read with torch's own accessor
(``ignore_is_tracing=True``: the backend defers hooks while it traces). Re-check when torch closes
#154306: this module is then the one place to narrow to the torch versions that still fail.
"""
from __future__ import annotations

import torch

CHECKPOINT_MODULE = "torch.utils.checkpoint"
_KEY = "triton.cudagraphs"


def under_checkpoint() -> bool:
    """torch.utils.checkpoint's (non-reentrant) saved-tensor hooks are the active ones."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return bool(hooks) and getattr(hooks[0], "__module__", None) == CHECKPOINT_MODULE


def cudagraphs_requested(patches: dict) -> bool:
    """Inductor will wrap the compiled graph in CUDA graphs (the compile's patches, else the global flag)."""
    if _KEY in patches:
        return bool(patches[_KEY])
    return bool(torch._inductor.config.triton.cudagraphs)


def without_cudagraphs_under_checkpoint(patches: dict, session) -> dict:
    """``patches`` with CUDA graphs off when this graph is compiled inside a checkpoint and CUDA
    graphs were asked for (warned once per compile), else ``patches`` unchanged."""
    if not cudagraphs_requested(patches) or not under_checkpoint():
        return patches
    session.warn_once(("cudagraphs_under_checkpoint",),
                      "moe_compile: a graph compiled inside torch.utils.checkpoint (non-reentrant, e.g. "
                      "gradient_checkpointing_enable() with per-layer compiles) runs without CUDA graphs: "
                      "torch's CUDA graphs fail when the backward recomputes a graph called inside a "
                      "checkpoint (pytorch/pytorch#154306; stock torch.compile raises there). The rest of "
                      "the model keeps them. A GPU-bound step loses little (4 Qwen3-30B-A3B layers on an H200: "
                      "85 ms per layer-compile without CUDA graphs, 108 ms whole-model with them). To keep CUDA "
                      "graphs with checkpointing, compile the whole model (its checkpoints are then inside the "
                      "graph); to silence this, leave CUDA graphs off (no mode=\"reduce-overhead\").")
    return {**patches, _KEY: False}
