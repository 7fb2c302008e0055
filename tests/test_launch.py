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
        self.device_caches = {0: ({}, {}, None, None, self.binder), 1: ({}, {}, None, None, self.binder)}

    @staticmethod
    def binder(*args, **kwargs):
        if any(not isinstance(a, int) for a in args):
            raise TypeError("a bad argument")
        params = {f"a{i}": a for i, a in enumerate(args)}
        params.update(kwargs)
        return params, [("i64", "D" if a % 16 == 0 else "") for a in args], {}

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.slow.append(args)
            if any(not isinstance(a, int) for a in args):
                raise TypeError("a bad argument")
            key = (DEVICE[0], tuple(a % 16 == 0 for a in args), tuple(kwargs.items()))
            return self.compiled.setdefault(key, Compiled())
        return call


DEVICE = [0]


@pytest.fixture
def fake_triton(monkeypatch):
    DEVICE[0] = 0
    hooks = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[]),
                                  launch_exit_hook=types.SimpleNamespace(calls=[]), debug=False)
    triton = types.ModuleType("triton")
    triton.__version__ = "3.6.0"
    triton.knobs = types.SimpleNamespace(runtime=hooks, compilation=types.SimpleNamespace(instrumentation_mode=""))
    runtime = types.ModuleType("triton.runtime")
    runtime.driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_device=lambda: DEVICE[0],
                                                                          get_current_stream=lambda d: 777 + d))
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


def test_launch_hooks_and_debug_knobs_take_the_full_path(fake_triton):
    fn = FakeJIT()
    k = _launch.lean(fn)
    k[(1,)](32, 5)
    fake_triton.launch_enter_hook.calls.append(print)   # e.g. Triton's profiler
    k[(1,)](32, 5)
    fake_triton.launch_enter_hook.calls.clear()
    fake_triton.debug = True                            # part of run()'s key: a debug build
    k[(1,)](32, 5)
    assert len(fn.slow) == 3
    fake_triton.debug = False
    k[(1,)](32, 5)
    assert len(fn.slow) == 3


def test_each_device_gets_its_own_kernel_and_stream(fake_triton):
    fn = FakeJIT()
    k = _launch.lean(fn)
    on0 = k[(1,)](32, 5)
    DEVICE[0] = 1
    on1 = k[(1,)](32, 5)                # same arguments, another device: compiled for it
    assert on1 is not on0 and len(fn.slow) == 2
    k[(1,)](32, 5)
    assert on1.runs[-1][3] == 778 and not on0.runs


def test_a_bad_argument_raises_the_callers_error_and_keeps_lean_on(fake_triton):
    fn = FakeJIT()
    k = _launch.lean(fn)
    k[(1,)](32, 5)
    with pytest.raises(TypeError, match="a bad argument"):
        k[(1,)](32, "x")
    assert not k.broken
    k[(1,)](32, 5)
    assert len(fn.slow) == 2


def test_untested_triton_takes_the_full_path_and_warns_once(fake_triton, monkeypatch, caplog):
    monkeypatch.setattr(sys.modules["triton"], "__version__", "9.0.0")
    monkeypatch.setattr(_launch, "_WARNED", [False])
    a, b = _launch.lean(FakeJIT()), _launch.lean(FakeJIT())
    with caplog.at_level("WARNING", logger=_launch.__name__):
        for k in (a, b, a):
            k[(1,)](32, 5)
    assert a.broken and b.broken and len(a.fn.slow) == 2
    assert sum("launch through kernel[grid]" in r.message for r in caplog.records) == 1


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


def test_interpreter_takes_the_full_path_without_a_gpu_driver(fake_triton, monkeypatch):
    """TRITON_INTERPRET=1 on a machine with no GPU driver: Triton's driver lookup raises there, so the
    first call must take kernel[grid](...) (the interpreter) before asking the driver for a device."""
    class NoDriver:
        @property
        def active(self):
            raise RuntimeError("0 active drivers ([]). There should only be one.")

    monkeypatch.setattr(sys.modules["triton.runtime"], "driver", NoDriver())
    fake_triton.interpret = True
    fn = FakeJIT()
    k = _launch.lean(fn)
    k[(1,)](32, 5)
    k[(1,)](32, 5)
    assert len(fn.slow) == 2 and not k.broken
