"""How expert-parallel rows and counts move between ranks for the ops of ``ep.py``: one interface, picked
in one place. (Compiled graphs move rows with ``ep_traceable.py``'s all-gather / reduce-scatter, which
the compiler can schedule; these transports serve the opaque ops called outside a compiled graph.)

Legend: ep ranks in the expert-parallel group, E experts, E_local = E / ep experts per rank (rank r
owns global experts [r*E_local, (r+1)*E_local)), N routed rows per rank (T tokens x K top-k; the
same N on every rank), H row width.

    plan [2, ep, E_local] int64      plan[0][r, j]: rows this rank sends to rank r for r's local expert j
                                     plan[1][s, j]: rows this rank receives from rank s for its expert j
    exchange_counts(send[ep, E_local]) -> recv[ep, E_local]             (one fixed-size all_to_all)
    dispatch(xp[N, H], plan) -> [ep*N, H]   expert-major: expert j's rows from source 0, 1, ...; zeros past the end
    combine(y[ep*N, H2], plan) -> [N, H2]   the inverse movement, back to xp's row order; unsent rows zero

``select_transport(group, device)`` is the only place that chooses. Today it always returns
``PaddedAllToAll`` (sync-free, gloo and NCCL). Extension points, not implemented (no GPU this session):

* ``SymmetricMemoryPeerCopy``: each rank writes its rows straight into the owner's expert-major
  receive buffer (torch symmetric memory, one put per (peer, expert) block at the offsets that
  ``plan`` gives): no padded [ep, N, H] staging copy and no receive-side gather.
* ``DeepEPStatic``: DeepEP's intranode dispatch/combine with ``num_worst_tokens`` (static shapes,
  no host sync). DeepEP moves *tokens* (de-duplicated per destination rank, combined on the
  receiver), not our sorted *rows*: it needs the token-level ids and weights, so its lowering calls
  it in place of permute_rows + dispatch (and combine + unpermute_combine), not through this
  row-level interface. The class marks where that choice would be made.

PaddedAllToAll, worked example (ep=2, E_local=2, N=3; this is rank 0)::

    rank 0 xp rows a b c, offsets [1, 2, 3, 3]  -> send plan[0] = [[1, 1], [1, 0]]  (a->e0, b->e1, c->e2)
    rank 1 xp rows d e f, offsets [0, 2, 3, 3]  -> rank 1 sends rank 0 [[0, 2]]       (d, e -> e1)
    rank 0 send buffer [ab0 | c00] (one N-row chunk per peer, zero padded); all_to_all_single
    rank 0 receives [ab0 | de0], plan[1] = [[1, 1], [0, 2]]
    expert-major output: e0: a; e1: b (from rank 0), d e (from rank 1) -> [a b d e 0 0],
    recv_offsets = [1, 4]
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
import torch.distributed as dist

from .common import device_assert


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` (``ProcessGroup.group_name``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group  # exists in torch 2.11 and 2.13

    return _resolve_process_group(group_name)


# --------------------------------------------------------------------------- layout (pure tensor math)
class PaddedLayout(NamedTuple):
    """Index tensors for the padded exchange; every size is static (ep, N), nothing leaves the device.

    pack_src/pack_ok [ep*N]: send buffer row r*N + q holds xp[pack_src] when pack_ok (else 0).
    unpack_src/unpack_ok [N]: xp row i comes back at returned-buffer row unpack_src[i] when unpack_ok.
    dest/recv_ok [ep*N]: received row s*N + q goes to expert-major row dest (a permutation of
    [0, ep*N); rows that carry data map below ``total``, padding rows above).
    src [ep*N]: the inverse of dest; out_ok [ep*N]: expert-major row p < total.
    """
    pack_src: torch.Tensor
    pack_ok: torch.Tensor
    unpack_src: torch.Tensor
    unpack_ok: torch.Tensor
    dest: torch.Tensor
    recv_ok: torch.Tensor
    src: torch.Tensor
    out_ok: torch.Tensor


def _exclusive_cumsum(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return t.cumsum(dim) - t


def padded_layout(plan: torch.Tensor, n: int) -> PaddedLayout:
    """The gathers that turn per-peer padded chunks into expert-major rows and back, from ``plan``."""
    send, recv = plan[0], plan[1]                      # [ep, E_local] each
    ep, e_local = send.shape
    dev = plan.device
    q = torch.arange(n, device=dev)
    # sender: the rows for rank r are xp[send_start[r] : send_start[r] + send_rows[r]]
    send_rows = send.sum(1)
    send_start = _exclusive_cumsum(send_rows, 0)
    pack_ok = q.unsqueeze(0) < send_rows.unsqueeze(1)                                  # [ep, N]
    pack_src = (send_start.unsqueeze(1) + q).clamp(max=max(n - 1, 0))
    owner = torch.searchsorted(send_start + send_rows, q, right=True)                  # [N] in [0, ep]
    unpack_ok = owner < ep
    owner_c = owner.clamp(max=ep - 1)
    unpack_src = torch.where(unpack_ok, owner_c * n + q - send_start[owner_c], 0)
    # receiver: chunk s holds recv_rows[s] rows sorted by local expert, then padding
    recv_rows = recv.sum(1)
    in_chunk_end = recv.cumsum(1)                                                      # [ep, E_local]
    expert = torch.searchsorted(in_chunk_end, q.expand(ep, n).contiguous(), right=True)  # [ep, N]
    recv_ok = expert < e_local
    expert_c = expert.clamp(max=e_local - 1)
    block_start = _exclusive_cumsum(recv.t().reshape(-1), 0).view(e_local, ep).t()    # (expert, source) blocks
    total = recv_rows.sum()
    pos = block_start.gather(1, expert_c) + q - (in_chunk_end - recv).gather(1, expert_c)
    pad_pos = total + _exclusive_cumsum(n - recv_rows, 0).unsqueeze(1) + q - recv_rows.unsqueeze(1)
    dest = torch.where(recv_ok, pos, pad_pos).reshape(-1)
    rows = torch.arange(ep * n, device=dev)
    src = torch.empty_like(dest).scatter_(0, dest, rows)  # dest is a permutation: unique indices
    return PaddedLayout(pack_src.reshape(-1), pack_ok.reshape(-1), unpack_src, unpack_ok, dest,
                        recv_ok.reshape(-1), src, rows < total)


def rows_where(ok: torch.Tensor, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t[idx] where ok, else 0 (a select, not a multiply: inf/nan in unused rows stay out)."""
    return torch.where(ok.unsqueeze(-1), t.index_select(0, idx), t.new_zeros(()))


# --------------------------------------------------------------------------- transports
class Transport(ABC):
    """Moves routed rows to the ranks owning their experts and back. One instance per (group, device)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ep = group.size()

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """recv[s, j] = send_counts[j-th local expert of mine] on rank s: one fixed-size all_to_all."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts.contiguous(), group=self.group)
        return recv

    @abstractmethod
    def dispatch(self, xp: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        """[N, H] rows sorted by global expert -> [ep*N, H] rows of the local experts, expert-major."""

    @abstractmethod
    def combine(self, y: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        """[ep*N, H2] expert-major rows -> [N, H2] back in xp's order (the adjoint of dispatch)."""


def same_rows_message(n: int) -> str:
    """The error of ranks routing different row counts (a device-side assert's message on GPUs)."""
    return (f"moe_compile.ep_dispatch: every rank of the expert-parallel group must route the same "
            f"number of rows N = tokens * top_k; this rank has N={n} (pad the batch to a common size)")


class PaddedAllToAll(Transport):
    """Every rank sends each peer one worst-case [N, H] chunk (``all_to_all_single``, equal splits);
    device-side gathers pack, compact and expand using the counts in ``plan``. No host sync; ep x
    the bytes of a variable-split all-to-all on the wire. Works on gloo (CPU) and NCCL."""

    check_rows = True  # one tiny all_to_all per dispatch: every rank must have the same N

    def _exchange(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv

    def _check_same_rows(self, n: int, device: torch.device) -> None:
        mine = torch.full((self.ep,), n, dtype=torch.int64, device=device)
        theirs = self._exchange(mine)
        same = (theirs == n).all()
        msg = same_rows_message(n)
        if same.device.type == "cpu":
            if not bool(same):
                raise ValueError(f"{msg}, others have {sorted(set(theirs.tolist()))}")
        else:
            device_assert(same, msg)  # device-side: no host sync

    def dispatch(self, xp, plan):
        n = xp.shape[0]
        if self.check_rows:
            self._check_same_rows(n, xp.device)
        if n == 0:
            return xp.new_zeros(0, xp.shape[1])
        lay = padded_layout(plan, n)
        received = self._exchange(rows_where(lay.pack_ok, xp.contiguous(), lay.pack_src))
        return rows_where(lay.out_ok, received, lay.src)

    def combine(self, y, plan):
        n = y.shape[0] // self.ep
        if n == 0:
            return y.new_zeros(0, y.shape[1])
        lay = padded_layout(plan, n)
        returned = self._exchange(rows_where(lay.recv_ok, y.contiguous(), lay.dest))
        return rows_where(lay.unpack_ok, returned, lay.unpack_src)


class SymmetricMemoryPeerCopy(Transport):
    """EXTENSION POINT (not implemented): NVLink peer copies through torch symmetric memory.

    Plan: a symmetric receive buffer [ep*N, H] per rank (allocated once per shape); rank s writes
    its block for (expert j of rank r) at r's expert-major offset block_start[j, s] (computed on
    each rank from the exchanged counts, as in ``padded_layout``); a barrier on the symmetric-memory
    handle; combine reads back the same blocks. Sync-free and CUDA-graph safe (torchtitan's minimal
    async EP does this with static capacity)."""

    def __init__(self, group):
        raise NotImplementedError("moe_compile.ep_transport: SymmetricMemoryPeerCopy is an extension point")

    def dispatch(self, xp, plan):  # pragma: no cover
        raise NotImplementedError

    def combine(self, y, plan):  # pragma: no cover
        raise NotImplementedError


class DeepEPStatic(Transport):
    """EXTENSION POINT (not implemented): DeepEP ``Buffer.dispatch(..., num_worst_tokens=ep*T)``.

    Static-shape intranode mode (no host sync). Token-level: it takes x [T, H], topk_idx [T, K] and
    topk_weights, de-duplicates tokens per destination rank and reduces on combine, so a lowering
    that picks it replaces permute_rows + ep_dispatch and ep_combine + unpermute_combine together.
    DeepEP is installed from source by the user (DeepSeek's repository, its V1 API), never vendored."""

    def __init__(self, group):
        raise NotImplementedError("moe_compile.ep_transport: DeepEPStatic is an extension point")

    def dispatch(self, xp, plan):  # pragma: no cover
        raise NotImplementedError

    def combine(self, y, plan):  # pragma: no cover
        raise NotImplementedError


_TRANSPORTS: dict[tuple[str, str], Transport] = {}


def select_transport(group: dist.ProcessGroup, device: torch.device) -> Transport:
    """The transport for ``group`` on ``device``: the one place where the choice is made.

    Today: PaddedAllToAll everywhere. When the extension points exist: SymmetricMemoryPeerCopy for
    CUDA groups inside one NVLink domain, DeepEPStatic when the lowering asks for token-level
    movement and deep_ep imports."""
    key = (group.group_name, torch.device(device).type)
    t = _TRANSPORTS.get(key)
    if t is None or t.group is not group:   # a process group made again under a destroyed one's name (helper-115)
        t = _TRANSPORTS[key] = PaddedAllToAll(group)
    return t
