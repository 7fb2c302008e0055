"""Launch a Triton kernel with less host work per call than ``kernel[grid](...)``.

    @lean
    @triton.jit
    def _permute_rows_kernel(...): ...

    _permute_rows_kernel[(blocks, cols)](x, perm, ..., BR=16, num_warps=4)   # the call is unchanged

``JITFunction.run`` does, on every call: read Triton's knobs, bind and specialise the arguments,
build the cache key (formatting the compile options as a string), check the kernel's globals, build
launch metadata for the launch hooks (an empty hook chain is called twice), then launch. Measured on
an H100 machine's host CPU: 40-60 µs per launch of our glue kernels, 150 µs for the TMA grouped GEMM
(``examples/benchmark/op_overhead.py``, ``kernel`` column), at ~13 launches per MoE layer per
training step.

Here: Triton's own binder specialises the arguments (the exact specialisation ``run`` computes, so
the compiled kernel chosen is the one ``run`` would choose), the key is that specialisation plus
the keyword arguments and the device, and a cached ``CompiledKernel`` is launched directly. The
first call of each key, and every call while a launch hook (e.g. Triton's profiler) or the debug,
instrumentation or interpreter knob is set, goes through ``kernel[grid](...)`` itself. Not repeated
per call: the check that the kernel's globals kept the values it was compiled with (ours reads
module constants only). On a Triton other
than ``TESTED_TRITON``, or if its internals differ from what is used here, every call goes through
``kernel[grid](...)`` (a warning says why, once).
"""
from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)
_CHOICES = "moe_compile.kernels.cuda"   # LEAN_LAUNCH: the one place kernel choices are made


# Triton versions whose JITFunction.run this mirrors (device_caches' binder, CompiledKernel.run's
# arguments); any other version launches through kernel[grid](...)
TESTED_TRITON = ("3.6.",)
_WARNED = [False]


def _plain_launch(knobs) -> bool:
    """Nothing that changes how run() launches: no launch hook (Triton 3.6 keeps them in
    always-present ``HookChain`` objects), no debug or instrumentation knob (part of run()'s key)."""
    rt = knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return not rt.debug and not knobs.compilation.instrumentation_mode and not getattr(rt, "interpret", False)


class LeanKernel:
    """``kernel[grid](*args, **kwargs)`` with the per-call work above cut; see the module doc."""

    __slots__ = ("fn", "kernels", "broken", "knobs", "device", "stream", "choices")

    def __init__(self, fn):
        self.fn = fn
        self.kernels: dict = {}
        self.broken = False
        self.knobs = self.device = self.stream = self.choices = None

    def _off(self, exc: Exception) -> None:
        self.broken = True
        if not _WARNED[0]:
            _WARNED[0] = True
            log.warning("moe_compile: Triton kernels launch through kernel[grid](...) (correct, more host time per "
                        "launch): %s: %s", type(exc).__name__, exc)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        choices = self.choices or sys.modules.get(_CHOICES)   # kernels/cuda.py, which imports us (no cycle)
        if self.broken or (choices is not None and not choices.LEAN_LAUNCH):
            return self.fn[grid](*args, **kwargs)
        try:
            if self.knobs is None:
                import triton
                from triton import knobs

                if not triton.__version__.startswith(TESTED_TRITON):
                    raise ImportError(f"triton {triton.__version__} is not one of {TESTED_TRITON}")
                self.knobs = knobs
            self.choices = choices
            if not _plain_launch(self.knobs):   # before the driver: the interpreter may run without one
                return self.fn[grid](*args, **kwargs)
            if self.device is None:   # what JITFunction.run reads the device and stream with
                from triton.runtime import driver

                self.device, self.stream = driver.active.get_current_device, driver.active.get_current_stream
            device = self.device()
            binder = self.fn.device_caches[device][4]
        except (ImportError, AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
            self._off(exc)   # another Triton: its own launch path from now on
            return self.fn[grid](*args, **kwargs)
        try:
            bound, specialization, _ = binder(*args, **kwargs)
            key = (device, tuple(specialization), tuple(kwargs.items()))
            kernel = self.kernels.get(key)
        except Exception:  # e.g. a bad argument: run() raises the error the caller should see
            return self.fn[grid](*args, **kwargs)
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)   # compiles (once) and launches
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            self.kernels[key] = kernel
            return kernel
        grid = grid(bound) if callable(grid) else grid
        stream = self.stream(device)
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                   kernel.function, kernel.packed_metadata, None, None, None, *bound.values())
        return kernel


def lean(fn) -> LeanKernel:
    """Decorator (above ``@triton.jit``): the kernel launches through ``LeanKernel``."""
    return LeanKernel(fn)
