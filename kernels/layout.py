"""Where expert weights live: zero-copy [E, K, N] views of E per-expert tensors that share one buffer.

ModuleList experts hold E separate nn.Linear weights; once re-homed into one buffer
(``lowering/rehome.py``) they are evenly spaced views of one storage, and a grouped GEMM can read
them as one strided 3-D tensor without copying. Used by the grouped GEMM ops and by the CUDA
kernels (with the TMA kernel's k-step, which the lowering asks); depends on nothing else in the package.
"""
from __future__ import annotations

import torch

# The TMA grouped GEMM's k-step (``_triton_tma``'s BK): grouped_mm_cat_dx's one launch runs K = 2 NH over
# two weights [E, K, NH], so NH must be a multiple of it (asked by the lowering before any CUDA call).
TMA_K_STEP = 64

_DATA_PTR = torch.Tensor.data_ptr  # map(_DATA_PTR, ws): the per-step address scan, ~2x a generator
_STEP_CACHE: dict = {}   # (addresses, shape, strides, dtype, device) -> element step, 0: not evenly spaced


def even_step(ws: list[torch.Tensor]) -> int:
    """Element step between E same-layout views of one storage, evenly spaced; else 0."""
    first = ws[0]
    base = first.untyped_storage().data_ptr()
    if not all(w.shape == first.shape and w.stride() == first.stride() and w.dtype == first.dtype
               and w.device == first.device and w.untyped_storage().data_ptr() == base for w in ws):
        return 0
    step = ws[1].storage_offset() - first.storage_offset()
    ok = step > 0 and all(w.storage_offset() == first.storage_offset() + e * step for e, w in enumerate(ws))
    return step if ok else 0


def strided_stack(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """[E, K, N] zero-copy view of E tensors [K, N] that are evenly spaced views of one storage
    (e.g. ModuleList weights re-homed into one buffer), else None.

    Called on every step with E-long lists: the full check runs once per set of addresses (cached);
    later calls only gather the addresses and check that the view stays inside the first tensor's
    storage (memory inside it belongs to no other tensor, so the cached answer still holds)."""
    if len(ws) < 2:
        return None
    first = ws[0]
    last = ws[-1]
    key = (tuple(map(_DATA_PTR, ws)), tuple(first.shape), first.stride(), tuple(last.shape), last.stride(),
           first.dtype, first.device)
    step = _STEP_CACHE.get(key)
    if step is None:
        if len(_STEP_CACHE) > 1024:
            _STEP_CACHE.clear()
        step = _STEP_CACHE[key] = even_step(ws)
    if not step:
        return None
    extent = first.storage_offset() + (len(ws) - 1) * step + sum((d - 1) * st for d, st in zip(first.shape, first.stride()))
    if (extent + 1) * first.element_size() > first.untyped_storage().nbytes():
        return None
    return first.as_strided((len(ws), *first.shape), (step, *first.stride()), first.storage_offset())


def stack_expert_weights(ws: list[torch.Tensor]) -> torch.Tensor:
    """[E, K, N] from E tensors [K, N]: ``strided_stack`` when possible, else a copy.
    For kernels that need one 3-D operand; the reference never copies."""
    view = strided_stack(ws)
    return view if view is not None else torch.stack(ws)


def pair_view(ws_a: list[torch.Tensor], ws_b: list[torch.Tensor], transposed: bool = False) -> torch.Tensor | None:
    """[E, K, Na+Nb] zero-copy view when ws_a[e] and ws_b[e] are the row blocks [0, Na) and
    [Na, Na+Nb) of one row-major [E, Na+Nb, K] buffer (nn.Linear w1 | w3 re-homed together,
    lowering/rehome.py), else None. ws[e] are [K, N] views ``W_e.t()``, or with ``transposed``
    the [N, K] weights ``W_e`` themselves.

    Example: E=2, K=4, Na=Nb=3, buffer B [2, 6, 4]: ws_a[e] = B[e, :3].t(), ws_b[e] = B[e, 3:].t()
    (or B[e, :3], B[e, 3:] with ``transposed``) -> B.transpose(1, 2) (strides (24, 1, 4))."""
    va, vb = strided_stack(ws_a), strided_stack(ws_b)
    if va is None or vb is None:
        return None
    if not transposed:
        va, vb = va.transpose(1, 2), vb.transpose(1, 2)  # -> [E, N, K] views of the weights
    na, nb, k = va.shape[1], vb.shape[1], va.shape[2]
    if va.stride() != vb.stride() or va.stride(2) != 1 or va.stride(1) != k \
            or va.untyped_storage().data_ptr() != vb.untyped_storage().data_ptr() \
            or vb.storage_offset() != va.storage_offset() + na * k or va.stride(0) < (na + nb) * k:
        return None
    return va.as_strided((va.shape[0], na + nb, k), va.stride(), va.storage_offset()).transpose(1, 2)
