"""The ops at their boundary (a review of the kernels' limits): arguments the kernels cannot take are
refused with an error naming them, float64 is computed in float64, fake outputs are laid out as the
implementations return them, and an address table read by kernels in place is not freed while a
launch may still read it (kernels/weight_tables.py). The CUDA side: tests/gpu/test_kernel_limits.py.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from moe_compile.kernels import ops  # noqa: F401  (registers torch.ops.moe_compile.*)
from moe_compile.kernels import weight_tables

OPS = torch.ops.moe_compile
# float64 all the way (reference ops in float64 against float64 torch): summation order only
FP64_REL = 1e-12


def _routing(t=6, k=2, e=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[0, 0] = -1  # one dropped pair
    return OPS.route_permute(ids, e)


def test_routing_ops_refuse_offsets_without_groups():
    """An empty offsets made the CUDA kernels read offsets[-1] before the tensor (illegal address)."""
    perm, inv, _ = _routing()
    none = torch.empty(0, dtype=torch.int32)
    x, y, w = torch.randn(6, 5), torch.randn(12, 5), torch.rand(6, 2)
    with pytest.raises(ValueError, match="permute_rows: offsets must be"):
        OPS.permute_rows(x, perm, inv, none, 2)
    with pytest.raises(ValueError, match="unpermute_combine: offsets must be"):
        OPS.unpermute_combine(y, inv, w, none)
    with pytest.raises(ValueError, match="unpermute_sum: offsets must be"):
        OPS.unpermute_sum(y, perm, inv, none, 2)
    with pytest.raises(ValueError, match="unpermute_combine_backward: offsets must be"):
        OPS.unpermute_combine_backward(x, y, inv, w, none)


def test_weight_gradient_ops_refuse_an_expert_count_unlike_offsets():
    """num_experts above offsets' length made the kernels read offsets out of bounds (CUTLASS: a
    [4, K, N] result where the fake says [6, K, N])."""
    x, dy = torch.randn(8, 3), torch.randn(8, 5)
    offsets = torch.tensor([2, 4, 6, 8], dtype=torch.int32)
    for op in (OPS.grouped_mm_wgrad, OPS.grouped_mm_wgrad_lowp):
        with pytest.raises(ValueError, match="num_experts is 6"):
            op(x, dy, offsets, 6)
    with pytest.raises(ValueError, match="grouped_bias_grad: offsets must be"):
        OPS.grouped_bias_grad(dy, offsets, 6)
    with pytest.raises(ValueError, match="grouped_mm_wgrad: x .* and dy .* same number of rows"):
        OPS.grouped_mm_wgrad(x, dy[:7], offsets, 4)


@pytest.mark.parametrize("shape", [(5,), (2, 1), (2, 5, 1)])
def test_grouped_mm_refuses_a_bias_that_is_not_one_row_per_expert(shape):
    """A bias of [N] or [E, 1] broadcast silently into a wrong sum on CPU (and overlapping rows on CUDA)."""
    x, w = torch.randn(4, 3), torch.randn(2, 3, 5)
    offsets = torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"grouped_mm: bias must be \[E, N\] = \(2, 5\)"):
        OPS.grouped_mm(x, w, offsets, torch.randn(shape))


def _rel(got, ref):
    return ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def test_float64_is_computed_in_float64():
    """The references accumulated float64 in float32 (relative error ~1e-7, gradcheck failed)."""
    gen = torch.Generator().manual_seed(1)
    perm, inv, offsets = _routing(t=7, k=2, e=3)
    x = torch.randn(7, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    r = torch.rand(7, 2, generator=gen, dtype=torch.float64, requires_grad=True)

    def layer(x, w, b, r):
        xp = OPS.permute_rows(x, perm, inv, offsets, 2)
        return OPS.unpermute_combine(OPS.grouped_mm(xp, w, offsets, b), inv, r, offsets)

    assert torch.autograd.gradcheck(layer, (x, w, b, r))
    xp = OPS.permute_rows(x, perm, inv, offsets, 2).detach()
    dy = torch.randn(xp.shape[0], 5, generator=gen, dtype=torch.float64)
    ends = offsets.tolist()
    ref = torch.stack([xp[s:t].t() @ dy[s:t] for s, t in zip([0] + ends[:-1], ends)])
    dw = OPS.grouped_mm_wgrad(xp, dy, offsets, 3)
    assert dw.dtype == torch.float64 and _rel(dw, ref) < FP64_REL
    db = OPS.grouped_bias_grad(dy, offsets, 3)
    assert db.dtype == torch.float64


def test_fake_outputs_are_contiguous_as_the_implementations_return_them():
    """The fakes copied a column-major input's strides while every implementation returns contiguous
    outputs: Inductor failed ("incorrect fake kernel") where eager ran."""
    torch.manual_seed(0)
    m, n = 8, 4
    h = torch.randn(2 * n, m).t()  # [M, 2N], column-major
    da = torch.randn(m, n)
    perm, inv, offsets = _routing(t=4, k=2, e=4)
    w, dout = torch.rand(4, 2), torch.randn(4, 2 * n)

    def f(h, da, w, dout):
        dh = OPS.swiglu_backward(h, da)
        dhw, dw = OPS.weighted_swiglu_backward(h, w, perm, offsets, da)
        dy, dcw = OPS.unpermute_combine_backward(dout, h, inv, w, offsets)
        return dh * 1.0, dhw + 1.0, dw, dy * 2.0, dcw

    torch._dynamo.reset()
    # stock Inductor's graph cache does not key on the ops' fakes (backend="moe" keys on this package)
    with torch._inductor.config.patch(force_disable_caches=True):
        got = torch.compile(f, backend="inductor", fullgraph=True)(h, da, w, dout)
    for g, r in zip(got, f(h, da, w, dout)):
        assert torch.allclose(g, r)


class _Event:
    def __init__(self, stream, log):
        self.stream, self.done = stream, False
        log.append(self)

    def query(self):
        return self.done


def _table(values):
    return ("table", torch.tensor(values, dtype=torch.int64), set(), [])


def test_address_tables_are_freed_only_when_no_launch_can_read_them(monkeypatch):
    """The plan cache was cleared at 256 plans, freeing pinned tables whose kernels were still queued:
    the next table reused the block, and those kernels read other experts' weights (2 x H200: 43 of
    300 lists wrong; tests/gpu/test_kernel_limits.py)."""
    events = []
    monkeypatch.setattr(weight_tables, "PLAN_CACHE_SIZE", 2)
    monkeypatch.setattr(weight_tables, "_PLANS", {})
    monkeypatch.setattr(weight_tables, "_RETIRED", [])
    monkeypatch.setattr(weight_tables, "_READ_BY_GRAPHS", [])
    monkeypatch.setattr(weight_tables, "_record_event", lambda stream: _Event(stream, events))

    eager, graph = _table([0, 64]), _table([0, 128])
    weight_tables.put("a", eager, capturing=False)
    weight_tables.note_read(eager, "stream 0", capturing=False)
    weight_tables.note_read(eager, "stream 1", capturing=False)
    weight_tables.put("b", graph, capturing=False)
    weight_tables.note_read(graph, "stream 0", capturing=True)
    eager_table, graph_table = weakref.ref(eager[1]), weakref.ref(graph[1])
    del eager, graph

    weight_tables.put("c", ("view", 8), capturing=True)  # full, but no eviction while capturing
    assert set(weight_tables._PLANS) == {"a", "b", "c"} and not events
    weight_tables.put("d", ("stack",), capturing=False)  # evicts a, b, c
    assert set(weight_tables._PLANS) == {"d"}
    assert sorted(e.stream for e in events) == ["stream 0", "stream 1"]  # where the eager table was read
    gc.collect()
    assert eager_table() is not None and graph_table() is not None

    weight_tables._evict()  # the next eviction: the events still pending
    gc.collect()
    assert eager_table() is not None
    events[0].done = True
    weight_tables._evict()
    gc.collect()
    assert eager_table() is not None  # one of its two streams may still read it
    events[1].done = True
    weight_tables._evict()
    gc.collect()
    assert eager_table() is None
    assert graph_table() is not None  # a captured graph reads it on every replay
