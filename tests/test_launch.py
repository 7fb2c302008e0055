"""kernels/_launch.py: a lean launch picks exactly the compiled kernel kernel[grid](...) would (keyed
on Triton's own specialisation), launches it with the same arguments, and falls back to
kernel[grid](...) for a new key, launch hooks, LEAN_LAUNCH=False, or a Triton it does not know.
Triton is faked here (CPU CI has none); tests/gpu runs every kernel through the real thing."""
from __future__ import annotations

import sys
import types

import pytest

from moe_compile.kernels import _launch, cuda


class Compiled:
    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class FakeJIT:
    """``fn[grid](*args, **kw)`` compiles per (alignment of each int arg, kwargs); the binder
    specialises the same way (what Triton's binder does for pointers and ints, in small)."""

    def __init__(self):
        self.slow, self.compiled = [], {}
        self.device_caches = {0: ({}, {}, None, None, self.binder)}

    @staticmethod
    def binder(*args, **kwargs):
        params = {f"a{i}": a for i, a in enumerate(args)}
        params.update(kwargs)
        return params, [("i64", "D" if a % 16 == 0 else "") for a in args], {}

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.slow.append(args)
            key = (tuple(a % 16 == 0 for a in args), tuple(kwargs.items()))
            return self.compiled.setdefault(key, Compiled())
        return call


@pytest.fixture
def fake_triton(monkeypatch):
    hooks = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[]),
                                  launch_exit_hook=types.SimpleNamespace(calls=[]))
    triton = types.ModuleType("triton")
    triton.knobs = types.SimpleNamespace(runtime=hooks)
    runtime = types.ModuleType("triton.runtime")
    runtime.driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_device=lambda: 0,
                                                                          get_current_stream=lambda d: 777))
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.runtime", runtime)
    return hooks


def test_cached_kernel_launched_with_the_arguments_run_would_pass(fake_triton):
    fn = FakeJIT()
    k = _launch.lean(fn)
    first = k[(3,)](32, 5, BLOCK=64)
    assert len(fn.slow) == 1 and first.runs == []          # first call: kernel[grid](...) compiles and launches
    again = k[(4, 2)](48, 7, BLOCK=64)                       # same specialisation: the cached kernel
    assert again is first and len(fn.slow) == 1
    assert first.runs == [(4, 2, 1, 777, "function", "packed", None, None, None, 48, 7, 64)]
    k[lambda bound: (bound["a0"] // 16,)](64, 9, BLOCK=64)   # a grid function gets the bound arguments
    assert first.runs[-1][:3] == (4, 1, 1)


def test_new_specialisation_or_keyword_compiles_through_run(fake_triton):
    fn = FakeJIT()
    k = _launch.lean(fn)
    a = k[(1,)](32, 5, BLOCK=64)
    b = k[(1,)](33, 5, BLOCK=64)        # not 16-aligned: another compiled kernel, as run would pick
    c = k[(1,)](32, 5, BLOCK=128)       # another constexpr
    assert len(fn.slow) == 3 and len({id(a), id(b), id(c)}) == 3
    k[(1,)](33, 6, BLOCK=64)
    assert len(fn.slow) == 3 and b.runs and not a.runs and not c.runs


def test_launch_hooks_take_the_full_path(fake_triton):
    fn = FakeJIT()
    k = _launch.lean(fn)
    k[(1,)](32, 5)
    fake_triton.launch_enter_hook.calls.append(print)   # e.g. Triton's profiler
    k[(1,)](32, 5)
    assert len(fn.slow) == 2


def test_lean_launch_off_and_unknown_triton_take_the_full_path(fake_triton, monkeypatch):
    fn = FakeJIT()
    k = _launch.lean(fn)
    monkeypatch.setattr(cuda, "LEAN_LAUNCH", False)
    k[(1,)](32, 5)
    k[(1,)](32, 5)
    assert len(fn.slow) == 2
    monkeypatch.setattr(cuda, "LEAN_LAUNCH", True)
    fn.device_caches = {}                # a Triton without per-device binders: kernel[grid](...) from now on
    k[(1,)](32, 5)
    k[(1,)](32, 5)
    assert len(fn.slow) == 4 and k.broken
