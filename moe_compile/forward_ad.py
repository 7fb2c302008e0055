"""Forward-mode AD stops at a rewritten graph with a clear error instead of losing its tangents.

The fused ops of a rewritten MoE region (``torch.ops.moe_compile.*`` and the twins compiled graphs call)
have backward formulas only. A graph run inside ``torch.autograd.forward_ad.dual_level()`` on dual
tensors with nothing requiring grad (a frozen model, ``torch.no_grad()``) takes AOTAutograd's inference
path, where each aten op carries its tangent forward and an op without a forward-mode formula drops it:
the region's output came back with no tangent, a silent zero (review helper-107). With grad enabled
AOTAutograd raises torch's "You must implement the jvp function" for every backend.

    compiled(*inputs)                               -> compiled(*inputs)      (no dual level open: one
                                                                               int compare per call)
    compiled(*inputs), a level open, a dual input   -> RuntimeError naming forward-mode AD and the fix
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as _fwad


class RefuseForwardAD:
    """Wraps the compiled callable of a graph that holds a rewritten region (boxed or not)."""

    def __init__(self, fn):
        self.fn = fn
        if getattr(fn, "_boxed_call", False):
            self._boxed_call = True

    def __call__(self, *args, **kwargs):
        if _fwad._current_level >= 0:
            inputs = args[0] if len(args) == 1 and isinstance(args[0], list) else args
            if any(isinstance(t, torch.Tensor) and _fwad.unpack_dual(t).tangent is not None for t in inputs):
                raise RuntimeError(
                    "moe_compile: forward-mode AD (torch.autograd.forward_ad dual tensors) reached a graph whose MoE "
                    "region backend='moe' rewrote: its fused ops have no forward-mode derivative and would return "
                    "no tangent. Compute the forward-mode derivative on the uncompiled model (or one compiled with "
                    "backend='aot_eager'); reverse mode (.backward(), torch.autograd.grad) is supported.")
        return self.fn(*args, **kwargs)
