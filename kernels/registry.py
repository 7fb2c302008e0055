"""The one place that chooses an implementation for every moe_compile op.

    implementation("grouped_mm", x)   -> the function that computes grouped_mm for x's device

Implementations per op: the pure-torch ``reference`` (ground truth, used on CPU and wherever
nothing faster is registered) and, per device type, what a provider module registers. A provider
is imported lazily, the first time an op sees a tensor of its device type, so CPU never imports
Triton; it lists its implementations in a module-level ``IMPLS`` dict (op name -> function) and
imports nothing from here (no import cycle):

    device  provider                     implementations (inside, chosen per call by shape/dtype)
    cuda    moe_compile.kernels.cuda     Triton TMA / pointer grouped GEMMs, CUTLASS via
                                         torch._grouped_mm, Triton gather/combine/SwiGLU kernels

``register`` adds or replaces one (tests, experiments); ``reference_only()`` makes every op use
its reference inside a block (to compare a device's kernels against the ground truth).
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Callable

import torch

from . import reference

PROVIDERS: dict[str, str] = {"cuda": "moe_compile.kernels.cuda"}
_IMPLS: dict[tuple[str, str], Callable] = {}
_LOADED: set[str] = set()
_REFERENCE_ONLY = [False]


def _load(device_type: str) -> None:
    _LOADED.add(device_type)
    module = PROVIDERS.get(device_type)
    if module is None:
        return
    try:
        impls = importlib.import_module(module).IMPLS
    except ImportError:  # e.g. no Triton: the references run
        return
    for op, fn in impls.items():
        _IMPLS.setdefault((op, device_type), fn)


def register(op: str, device_type: str, fn: Callable) -> None:
    """Use ``fn`` for ``op`` on tensors of ``device_type`` (replaces the provider's)."""
    if device_type not in _LOADED:
        _load(device_type)
    _IMPLS[(op, device_type)] = fn


def implementation(op: str, t: torch.Tensor) -> Callable:
    """The implementation of ``op`` for tensors on ``t``'s device; float64 runs the reference on every
    device (the kernels compute in 16/32-bit)."""
    device_type = t.device.type
    if device_type not in _LOADED:
        _load(device_type)
    if _REFERENCE_ONLY[0] or t.dtype == torch.float64:
        return getattr(reference, op)
    return _IMPLS.get((op, device_type)) or getattr(reference, op)


@contextlib.contextmanager
def reference_only():
    """Inside the block every op runs its pure-torch reference, on every device."""
    _REFERENCE_ONLY[0], old = True, _REFERENCE_ONLY[0]
    try:
        yield
    finally:
        _REFERENCE_ONLY[0] = old
