"""Grouped GEMM through the tensor-memory accelerator (TMA), for Hopper (imported only by cuda.py).

Legend as in ``_triton_gmm``: x [M, K] rows sorted by expert, w [E, K, N] (either major: the
nn.Linear layout [E, N, K] seen through ``.transpose(1, 2)``, or row-major), ``offsets[e]`` the
int32 cumulative end row of group e. Same device-side tile schedule as ``_triton_gmm`` (persistent
grid, no host sync, CUDA-graph safe); what differs is how tiles move:

    A tile   x[m0 : m0+BM, k0 : k0+BK]         TMA load   (descriptor over x [M, K])
    B tile   w[e][k0 : k0+BK, n0 : n0+BN]      TMA load   (descriptor over w's storage, 2-D or 3-D)
    C tile   tile inside its group             two TMA stores of BN/2 columns (descriptor over y)
             last tile of a group              masked stores (rows < group end, cols < N)
             rows past the last group's end    zeros, masked stores (after the tile loop)

Rows an A tile reads past its group's end belong to the next group (or are zero-filled past M):
they only feed output rows that are never stored. Weight tiles of the 2-D [E*N, K] view that run
past an expert's N columns only feed output columns >= N, which are clipped. The 2-D [E*K, N] view
is used only when BK divides K, so a k-step never reads the next expert's rows.

Each program runs its tiles as one flat loop over (tile, k-step) pairs, the epilogue under
``if k-step == last``, rather than a loop over tiles around a k-loop: the software pipeliner then
issues the next tile's first TMA loads while this tile's epilogue converts and stores, which a
k-loop per tile leaves exposed. (Triton's own ``flatten=True`` does not compile this loop: its
nested-loop fusion fails on the full-tile / last-tile store branch.) Storing the tile as two halves
keeps the store buffer at 32 KB, so three 48 KB operand stages still fit in shared memory.

Measured on one H200 against the nested-loop kernel this replaced (a scratch A/B, 5 interleaved
rounds, median TFLOP/s, outputs ``torch.equal``): Qwen3-30B-A3B up 533 -> 550, down 500 -> 514,
up dgrad 514 -> 536, down dgrad 523 -> 538; Moonlight-width DeepSeek-V3-like 533-569 -> 547-586;
DeepSeek-V3 (256 experts, ~128 rows each) up 356 -> 386, down 349 -> 375; Mixtral up 620 -> 626,
down 612 -> 612. The nested kernel ran a group's last tile at half height when it had at most 64
rows; in the same A/B that path cost up to 7% (on 128-row groups) and gained at most 2%, so it is gone. Current
figures against ``torch._grouped_mm``: ``examples/benchmark/gmm_ab.py``. Weight gradients are not
here: a TMA version of the 2Dx2D form was 5-15% slower than CUTLASS (quack's is used when present).

SwiGLU fused into this kernel's epilogue (forward, and the down dgrad's dSwiGLU) was built and
measured in session 5 and removed: the epilogue was not overlapped with the next tile's main loop
then, so what the fusion saved in bytes came back as exposed epilogue time (forward 1.00-1.05x,
backward 1.15-1.50x the GEMM plus the one-pass swiglu op on an H200; docs/benchmarks.md). Re-tried
on the flat loop (gate and up columns of a tile as one box of the weight viewed [E, 2, I, H]): still
1.00-1.03x, the extra store and math are not hidden by the next tile's loads (benchmarks section 6).
"""
from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._launch import lean  # @lean kernels: a cached compiled kernel launched directly (less host work per call)
from ._triton_gmm import group_tiles, num_sms, tile_coords
from .layout import TMA_K_STEP


@triton.jit
def _load_b(b_desc, e, n0, k0, K, N, NH, FLIP, B_NK: tl.constexpr, B3D: tl.constexpr, PAIR: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr):
    """The [BK, BN] weight tile of expert e at (k0, n0); N is the weight's full column count. PAIR: two
    weights [E, NH, N] of one storage layout seen by one descriptor [2, E, NH, N] (``pair_desc``; N here is
    the output's column count, the weights' K there), the first at index FLIP of its leading dim, split
    along K (the sum of two products: K = 2 NH). A k-step never straddles the two (NH is a multiple of
    BK)."""
    if PAIR:
        half = k0 // NH
        b = b_desc.load([half ^ FLIP, e, k0 - half * NH, n0]).reshape(BK, BN)
    elif B_NK:
        if B3D:
            b = b_desc.load([e, n0, k0]).reshape(BN, BK).T
        else:
            b = b_desc.load([e * N + n0, k0]).T
    else:
        if B3D:
            b = b_desc.load([e, k0, n0]).reshape(BK, BN)
        else:
            b = b_desc.load([e * K + k0, n0])
    return b


@triton.jit
def _with_bias(acc, bias_ptr, e, sbe, n0, N, HAS_BIAS: tl.constexpr, BN: tl.constexpr):
    if HAS_BIAS:
        cols = n0 + tl.arange(0, BN)
        acc += tl.load(bias_ptr + e.to(tl.int64) * sbe + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _store_tile(c_desc, c_ptr, acc, m0, n0, row_end, N, stride, BM: tl.constexpr, BN: tl.constexpr):
    """Store the [BM, BN] tile at (m0, n0): a tile inside its group as two TMA stores of BN/2 columns
    (a half-tile store buffer leaves shared memory for three operand stages), the group's last tile
    by masked stores (rows < row_end, cols < N)."""
    if m0 + BM <= row_end:
        halves = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        c_desc.store([m0, n0], left.to(c_ptr.dtype.element_ty))
        c_desc.store([m0, n0 + BN // 2], right.to(c_ptr.dtype.element_ty))
    else:
        rows = m0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@triton.jit
def _zero_rows(ptr, tail0, M, N, stride, pid, num_progs, BM: tl.constexpr, BN: tl.constexpr):
    """Zero rows [tail0, M) of a [M, N] output (rows past the last group's end belong to no expert)."""
    n_tiles = tl.cdiv(N, BN)
    for zt in range(pid, tl.cdiv(M - tail0, BM) * n_tiles, num_progs):
        rows = tail0 + (zt // n_tiles) * BM + tl.arange(0, BM)
        cols = (zt % n_tiles) * BN + tl.arange(0, BN)
        tl.store(ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :],
                 tl.zeros((BM, BN), dtype=ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@lean
@triton.jit
def _tma_gmm_kernel(a_desc, b_desc, c_desc, c_ptr, bias_ptr, offs_ptr, M, N, K, E, WN, NH, FLIP, stride_cm, sbe,
                    num_progs, B_NK: tl.constexpr, B3D: tl.constexpr, PAIR: tl.constexpr, HAS_BIAS: tl.constexpr,
                    E_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    GROUP_M: tl.constexpr):
    """N: the output's column count; WN: the weight's. This program's tiles pid, pid + P, ... run as
    one loop over (tile, k-step), not a loop of k-loops, so the software pipeliner issues the next
    tile's first loads while this tile's epilogue runs (module docstring)."""
    pid = tl.program_id(0)
    eidx, starts, counts, m_tiles, g_tiles, g_end, total = group_tiles(offs_ptr, M, N, E, E_P2, BM, BN)
    k_steps = tl.cdiv(K, BK)
    my_tiles = tl.cdiv(tl.maximum(total - pid, 0), num_progs)
    tile = pid - num_progs
    ki = -1
    e = 0
    m0 = 0
    n0 = 0
    row_end = 0
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, k_steps * my_tiles):
        ki = tl.where(ki == k_steps - 1, 0, ki + 1)
        if ki == 0:  # the next tile of this program
            tile += num_progs
            e, row_start, row_end, pid_m, pid_n = tile_coords(tile, eidx, starts, counts, m_tiles, g_tiles,
                                                              g_end, N, BN, GROUP_M)
            m0 = row_start + pid_m * BM
            n0 = pid_n * BN
        a = a_desc.load([m0, ki * BK])
        acc = tl.dot(a, _load_b(b_desc, e, n0, ki * BK, K, WN, NH, FLIP, B_NK, B3D, PAIR, BN, BK), acc)
        if ki == k_steps - 1:  # the tile's epilogue
            acc = _with_bias(acc, bias_ptr, e, sbe, n0, N, HAS_BIAS, BN)
            _store_tile(c_desc, c_ptr, acc, m0, n0, row_end, N, stride_cm, BM, BN)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
    # rows past the last group's end belong to no expert: zeroed here rather than by a second launch
    tail0 = tl.max(starts + counts, 0)
    _zero_rows(c_ptr, tail0, M, N, stride_cm, pid, num_progs, BM, BN)


_DTYPES = (torch.bfloat16, torch.float16)


def _aligned(t: torch.Tensor, dims) -> bool:
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((t.stride(d) * es) % 16 == 0 for d in dims)


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """What the descriptors need: 16-bit types, unit inner strides, 16-byte aligned bases and outer
    strides, N a multiple of 8 (the output's row stride is 16 bytes), and K > 0 (a tile's epilogue
    runs after its last k-step)."""
    if x.dtype not in _DTYPES or w.dtype != x.dtype or x.dim() != 2 or w.dim() != 3 or x.stride(1) != 1:
        return False
    if w.stride(2) == 1:
        w_ok = _aligned(w, (0, 1))
    elif w.stride(1) == 1:
        w_ok = _aligned(w, (0, 2))
    else:
        return False
    return w_ok and _aligned(x, (0,)) and w.shape[2] % 8 == 0 and x.shape[1] == w.shape[1] and x.shape[1] > 0


def _config(n: int) -> dict:
    # 128x256x64, 8 warps (two consumer warpgroups), 3 stages: 144 KB of operand buffers + 32 KB
    # for the half-tile TMA store, one program per SM; GROUP_M 16 m-tiles share a weight column
    # block before moving on. Best of the configs tried on the layer GEMMs (module docstring).
    bn = 256 if n >= 256 else (128 if n > 64 else 64)
    return dict(BM=128, BN=bn, BK=TMA_K_STEP, GROUP_M=16, num_warps=8, num_stages=3)


def _b_desc(w: torch.Tensor, bn: int, bk: int):
    """(descriptor, B_NK, B3D) for w [E, K, N] (either major)."""
    e, k, n = w.shape
    if w.stride(2) != 1:  # storage [E, N, K]
        b2d = w.stride(2) == k and w.stride(0) == n * k
        desc = (TensorDescriptor(w, [e * n, k], [k, 1], [bn, bk]) if b2d else
                TensorDescriptor(w, [e, n, k], [w.stride(0), w.stride(2), 1], [1, bn, bk]))
        return desc, True, not b2d
    b2d = w.stride(1) == n and w.stride(0) == k * n and k % bk == 0  # storage [E, K, N]
    desc = (TensorDescriptor(w, [e * k, n], [n, 1], [bk, bn]) if b2d else
            TensorDescriptor(w, [e, k, n], [w.stride(0), w.stride(1), 1], [1, bk, bn]))
    return desc, False, not b2d


_THREAD = threading.local()


def _bind_context(device: torch.device) -> None:
    """Make the device's primary CUDA context current on this thread (once per thread and device).
    Triton encodes host tensor descriptors (cuTensorMapEncodeTiled) before its launcher makes a context
    current: on a thread with no CUDA call yet (autograd's device thread, when a backward's first work
    is this GEMM on a kernel already compiled) the encoding failed with "invalid device context"
    (review helper-70). ``cudaMemGetInfo`` binds it (a runtime call that needs one); nothing waits."""
    bound = _THREAD.__dict__.setdefault("devices", set())
    if device.index not in bound:
        if not torch.cuda.is_current_stream_capturing():   # a capturing thread has its context already
            torch.cuda.mem_get_info(device)
        bound.add(device.index)


def _launch(a, offsets, n, c, w=None, bias=None, pair=None):
    """One persistent launch over the output tile grid [M, n] of a [M, K] against w [E, K, n], or against
    both weights of ``pair`` = (wa, wb) [E, n, NH] with K = 2 NH (``pair_desc``)."""
    _bind_context(a.device)
    m, k = a.shape
    cfg = _config(n)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    if pair is None:
        e, nh, flip = w.shape[0], 0, 0
        b_desc, b_nk, b3d = _b_desc(w, bn, bk)
    else:
        e, nh = pair[0].shape[0], pair[0].shape[2]
        (b_desc, flip), b_nk, b3d = pair_desc(*pair, [1, 1, bk, bn]), False, True
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [bm, bk])
    c_desc = TensorDescriptor(c, [m, n], [c.stride(0), 1], [bm, bn // 2])
    if bias is not None:
        bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    upper = (triton.cdiv(m, bm) + e) * triton.cdiv(n, bn)
    progs = max(1, min(upper, num_sms(a.device)))
    return _tma_gmm_kernel[(progs,)](
        a_desc, b_desc, c_desc, c, bias if bias is not None else c, offsets, m, n, k, e, n, nh, flip,
        c.stride(0), bias.stride(0) if bias is not None else 0, progs,
        B_NK=b_nk, B3D=b3d, PAIR=pair is not None, HAS_BIAS=bias is not None, E_P2=triton.next_power_of_2(e),
        BM=bm, BN=bn, BK=bk, GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] = per-group x @ w[e] (+ bias[e]); rows past offsets[-1] are 0.

    Needs ``supported(x, w)`` and int32 offsets on x's device.
    """
    m, n = x.shape[0], w.shape[2]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        _launch(x, offsets, n, y, w, bias)
    return y


# --------------------------------------------------------------------------- two weights of one input
# torchtitan's w1 / w3: two [E, NH, K] Parameters (two allocations) applied to the same rows. The forward
# runs as two launches writing the two column halves of one [M, 2 NH] output (no copy); one launch over
# both weights (a [2, E, NH, K] descriptor, N tiles that must divide NH) was 0.48-1.00x of these two on an
# H200 (GPT-OSS-20B widths: NH 2880 allows 64-column tiles only; examples/benchmark/pair_ab.py). The input
# gradient runs as one launch with K = 2 NH, one fp32 sum: 1.06-1.26x of two GEMMs and their sum on four
# of five layer widths, 0.93-0.99x on Mixtral-8x7B's (8 experts, NH 14336).
_TMA_STRIDE_LIMIT = 1 << 40   # bytes: the largest global stride a tensor map takes


def halves_supported(x: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor) -> bool:
    """``grouped_mm_halves`` can run: each weight as ``supported`` takes it, of one shape."""
    return wa.shape == wb.shape and wa.shape[2] > 0 and supported(x, wa) and supported(x, wb)


def grouped_mm_halves(x: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[x @ wa[e] | x @ wb[e]] -> [M, 2 NH]: two launches, each writing its half of one output (the same
    values as two ``grouped_mm`` side by side); rows past offsets[-1] are 0. Needs ``halves_supported``."""
    m, nh = x.shape[0], wa.shape[2]
    y = torch.empty(m, 2 * nh, dtype=x.dtype, device=x.device)
    if m:
        _launch(x, offsets, nh, y[:, :nh], wa)
        _launch(x, offsets, nh, y[:, nh:], wb)
    return y


def pair_supported(dy: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor) -> bool:
    """One descriptor can address both weights for ``grouped_mm_cat_dx``: wa, wb [E, K, NH] views of
    [E, NH, K] storage (an nn.Linear layout, torchtitan's w1 / w3) with the same shape and strides,
    16-byte aligned, NH a multiple of BK, apart in memory by a distance the tensor map takes (a stride
    of at most 2^40 bytes that spans one whole weight: the two never overlap); dy [M, 2 NH]."""
    if dy.dtype not in _DTYPES or wa.dtype != dy.dtype or wb.dtype != dy.dtype or dy.dim() != 2 or dy.stride(1) != 1:
        return False
    if wa.dim() != 3 or wa.shape != wb.shape or wa.stride() != wb.stride() or wa.stride(1) != 1:
        return False
    e, k, nh = wa.shape
    if e == 0 or k == 0 or nh == 0 or not (_aligned(wa, (0, 2)) and _aligned(wb, (0, 2)) and _aligned(dy, (0,))):
        return False
    es = wa.element_size()
    span = ((e - 1) * wa.stride(0) + (nh - 1) * wa.stride(2) + k) * es
    gap = abs(wb.data_ptr() - wa.data_ptr())
    if gap < span or gap >= _TMA_STRIDE_LIMIT or nh % TMA_K_STEP:
        return False
    return dy.shape[1] == 2 * nh and k % 8 == 0


def pair_desc(wa: torch.Tensor, wb: torch.Tensor, block: list[int]):
    """(descriptor [2, E, NH, K] over the lower-addressed weight's storage, FLIP: wa's index in it)."""
    flip = int(wb.data_ptr() < wa.data_ptr())
    lo, hi = (wb, wa) if flip else (wa, wb)
    es = lo.element_size()
    e, k, nh = lo.shape
    gap = (hi.data_ptr() - lo.data_ptr()) // es
    return TensorDescriptor(lo, [2, e, nh, k], [gap, lo.stride(0), lo.stride(2), 1], block), flip


def grouped_mm_cat_dx(dy: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dy[:, :NH] @ wa[e]^T + dy[:, NH:] @ wb[e]^T -> [M, K]: one launch of ``_tma_gmm_kernel`` (PAIR) with
    K = 2 NH; rows past offsets[-1] are 0. Needs ``pair_supported(dy, wa, wb)``."""
    m, k = dy.shape[0], wa.shape[1]
    y = torch.empty(m, k, dtype=dy.dtype, device=dy.device)
    if m:
        _launch(dy, offsets, k, y, pair=(wa, wb))
    return y
