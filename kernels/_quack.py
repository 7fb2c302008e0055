"""quack-kernels' CuTe DSL varlen grouped GEMM (Hopper, warp-specialised, ping-pong consumer warp
groups: one group's epilogue overlaps the other's main loop) for the weight gradient.

Optional: ``pip install "moe_compile[quack]"`` (quack-kernels 0.4.1 with nvidia-cutlass-dsl 4.4.2:
the newest pair that imports on torch 2.11 / CUDA 13 here; quack 0.6.5 with nvidia-cutlass-dsl 4.8.1
has no ``cutlass.cutlass_dsl`` as installed). Imported lazily, the first
time a weight gradient runs on an sm90 GPU; never on CPU.

    dw[e] = a[rows e]^T @ b[rows e]   (a [M, P], b [M, Q], rows of group e = offsets[e-1]..offsets[e])

is quack's ``varlen_k`` GEMM: A = a.t() [P, M] (M-major, no copy), B = b [M, Q], K split by
``cu_seqlens_k = [0, offsets...]``; output [E, P, Q] in the requested dtype (fp32 accumulation,
one rounding). Rows past offsets[-1] are in no group. An expert with no rows runs a zero-length
main loop and its tile is written from the zeroed accumulator (tests/gpu checks a poisoned output).

Config: 128 x 192 tiles, ping-pong, 2 x 1 cluster (quack's sm90 default), with quack's dynamic
(atomic-counter) tile scheduler or its static one (``dynamic``; cuda.WGRAD_SCHEDULER picks: by
default static only where ``static_is_balanced``, since a tile's work is its expert's row count).
Measured against the
others quack offers on the benchmark layers' weight gradients (examples/benchmark/quack_ab.py,
docs/benchmarks.md section 2.7). Fixed, not autotuned: the autotuner compiles dozens of configs on
first use (minutes). Shapes are symbolic in quack's compile, so the kernel compiles once per
process and dtype/layout (~1-3 s), not per token count.

No host sync: offsets stay on the device; the launch shape depends only on M, P, Q and E.
"""
from __future__ import annotations

import logging
import warnings

import torch

log = logging.getLogger(__name__)

TILE_M, TILE_N, PINGPONG, CLUSTER_M, CLUSTER_N = 128, 192, True, 2, 1

_STATE: dict = {}  # "gemm": quack's gemm_tuned, "config": {dynamic: its GemmConfig}, or "error": why not


def _load():
    if not _STATE:
        try:
            from quack.gemm_config import GemmConfig
            from quack.gemm_interface import gemm_tuned

            _STATE["gemm"] = gemm_tuned.fn  # the untuned entry point: config given, no autotuning
            _STATE["config"] = {dyn: GemmConfig(tile_m=TILE_M, tile_n=TILE_N, pingpong=PINGPONG, cluster_m=CLUSTER_M,
                                                cluster_n=CLUSTER_N, is_dynamic_persistent=dyn, device_capacity=9)
                                for dyn in (False, True)}
        except ModuleNotFoundError as exc:
            if exc.name != "quack":  # quack is there but a dependency is missing or mismatched
                _broken(exc)
            else:  # not installed: the optional extra was not asked for
                _STATE["error"] = f"quack-kernels is not installed ({exc})"
                log.debug("moe_compile.kernels: %s; the weight gradient uses torch._grouped_mm", _STATE["error"])
        except Exception as exc:  # installed but broken: say so once, and run the fallback
            _broken(exc)
    return _STATE.get("gemm")


def _broken(exc: Exception) -> None:
    _STATE["error"] = f"quack-kernels failed to import: {type(exc).__name__}: {exc}"
    warnings.warn(f"moe_compile.kernels: {_STATE['error']}; the weight gradient uses torch._grouped_mm "
                  "instead. Fix: pip install 'moe_compile[quack]' (pins a working quack/cutlass-dsl pair)",
                  stacklevel=4)


def available() -> bool:
    """quack imports here (tried once per process)."""
    return _load() is not None


def why_not() -> str | None:
    """None when available, else the reason."""
    _load()
    return _STATE.get("error")


def usable(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """The operands this kernel is used (and tested) for: bf16 a and b, 2-D, contiguous, widths a
    multiple of 8 elements (16-byte rows), 16-byte aligned bases, at least one row; bf16 or fp32 out."""
    return (a.dtype == torch.bfloat16 and b.dtype == a.dtype and a.dim() == 2 and b.dim() == 2
            and out_dtype in (a.dtype, torch.float32) and a.shape[0] > 0
            and all(t.is_contiguous() and t.shape[1] % 8 == 0 and t.data_ptr() % 16 == 0 for t in (a, b))
            and available())


def tiles_per_expert(p: int, q: int) -> int:
    """Output tiles of one expert's [P, Q] weight gradient."""
    return -(-p // TILE_M) * -(-q // TILE_N)


def static_is_balanced(p: int, q: int, num_sms: int) -> bool:
    """True when quack's static schedule (tile i on SM i mod #SMs) gives every SM the same tiles of
    every expert, so the same work whatever the routing: each expert's tile count is a multiple of
    the SM count (Qwen3-30B-A3B's up projection on 132 SMs: [1536, 2048] -> 12 x 11 = 132 tiles).
    Otherwise a tile's work, its expert's row count, varies and the dynamic scheduler balances it."""
    return tiles_per_expert(p, q) % num_sms == 0


def cu_seqlens(offsets: torch.Tensor) -> torch.Tensor:
    """quack's int32 group bounds from group ends: offsets [2, 2, 5] -> [0, 2, 2, 5]."""
    return torch.cat([offsets.new_zeros(1, dtype=torch.int32), offsets.to(torch.int32)])


def grouped_mm_wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, num_experts: int,
                     out_dtype: torch.dtype, dynamic: bool = False) -> torch.Tensor:
    """[E, P, Q] in out_dtype: a[rows e]^T @ b[rows e] per group, 0 for empty groups. ``dynamic``:
    quack's atomic-counter tile scheduler (its counter is one int32 zeroed per call, on the stream)."""
    gemm = _load()
    out = torch.empty(num_experts, a.shape[1], b.shape[1], dtype=out_dtype, device=a.device)
    gemm(a.t(), b, out, config=_STATE["config"][dynamic], cu_seqlens_k=cu_seqlens(offsets))
    return out
