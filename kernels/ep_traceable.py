"""Expert-parallel movement as traceable torch code, so the compiler sees (and schedules) the collectives.

Token-level, static shapes, counts on the device, no host sync: every rank all-gathers every rank's
tokens (and their expert ids and routing weights), runs its own experts over the rows routed to them
(the single-GPU ops: ``route_permute`` over the ids mapped to its local experts, the others dropped;
``permute_rows``; the grouped GEMMs; ``unpermute_combine``), which gives each token a partial output
(the sum over this rank's experts of its top-k), and reduce-scatters the partial outputs: each rank
gets, for its own tokens, the sum over ranks, i.e. the full top-k combination. Written with functional
collectives (``torch.distributed._functional_collectives``): AOTAutograd traces them into
``_c10d_functional`` collectives + ``wait_tensor`` nodes and differentiates them (the all-gather's
backward is a reduce-scatter and the other way round), and the post_grad stage's ``ep_overlap``
pass (``lowering/overlap.py``) orders them so that work they do not feed runs while they travel.

    gather_tokens(x[T, H], ids[T, K], w[T, K] | None, E, group) -> x_all[ep*T, H], local_ids[ep*T, K], w_all
    scatter_tokens(partial[ep*T, H], group) -> [T, H]
    pad_tokens(x[T, H], ids[T, K], w[T, K] | None, N, E, group) -> [N, H], [N, K], [N, K] | None  (every rank T <= N)
    unpad_tokens(out[N, H], x[T, H]) -> out[:T]

On the wire: T rows to every peer each way, where a row-level exchange sends N = T*K rows padded to
the worst case (K times the bytes), and an all-to-all-v that syncs with the host for its split sizes
sends N*(ep-1)/ep (ep/K times these: fewer bytes than this only past ep = K). Rows are exact copies;
each token's output is its owners' partial sums added (at ep=2, one more rounding in a 16-bit dtype
than one GPU's single sum; exact to summation order in fp32).

Every rank must hold the same T: a one-element all-gather and ``ep_same_tokens`` check it before any
row leaves (the rows, ids and weights are multiplied by the check's 1, so no schedule can send them
earlier; a collective of mismatched sizes would abort or hang the ranks without a message). With
``parallelize_experts(..., max_tokens=N)`` ranks may hold different T <= N: ``pad_tokens`` pads each
rank's tokens to N rows first (zero rows, expert id E: routed to no rank's experts, weight 0), so
the collectives move N rows per rank, and ``unpad_tokens`` keeps the first T rows of the result; its
all-gather of every rank's (T, N) and ``ep_tokens_fit`` replace the same-count check (every rank
raises when any rank's T exceeds N).

Worked example (ep=2, E=4, K=2, T=2; rank 0 owns experts 0 1, rank 1 experts 2 3)::

    rank 0: tokens a b, ids [[0, 2], [1, 0]]      rank 1: tokens c d, ids [[3, 2], [1, 3]]
    x_all = a b c d; rank 0's local ids: [[0, -], [1, 0], [-, -], [1, -]] ("-": dropped, id 2)
    rank 0's partials: a: w*y0(a), b: w*y1(b) + w*y0(b), c: 0, d: w*y1(d)
    rank 1's partials: a: w*y2(a), b: 0, c: w*y3(c) + w*y2(c), d: w*y3(d)
    reduce-scatter: rank 0 gets a, b summed over both ranks; rank 1 gets c, d
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as fc

from . import ep as _ep_ops  # noqa: F401  (registers torch.ops.moe_compile.ep_same_tokens, ep_tokens_fit)
from .ep_transport import resolve_group


def gather_tokens(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor | None, num_experts: int,
                  group_name: str, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every rank's tokens [ep*T, H] (rank s's at s*T), their expert ids mapped to this rank's local
    experts ([ep*T, K]; ids of other ranks' experts become E_local: dropped by route_permute) and
    their routing weights [ep*T, K] (None stays None). ``padded``: x, ids, w come from pad_tokens,
    whose check already holds every rank to the same row count (and these wait for it)."""
    group = resolve_group(group_name)
    ep, rank = group.size(), group.rank()
    e_local = num_experts // ep
    t = x.shape[0]
    if padded:   # already multiplied by pad_tokens' check
        def checked(v):
            return v
    else:
        counts = fc.all_gather_tensor(torch.full((1,), t, dtype=torch.int64, device=x.device), 0, group_name)
        one = torch.ops.moe_compile.ep_same_tokens(counts, t)

        def checked(v):   # every gathered tensor waits for the check
            return v * one.to(v.dtype)
    x_all = fc.all_gather_tensor_autograd(checked(x).contiguous(), 0, group_name)
    ids_all = fc.all_gather_tensor(checked(ids).contiguous(), 0, group_name)
    mine = (ids_all >= rank * e_local) & (ids_all < (rank + 1) * e_local)
    local_ids = torch.where(mine, ids_all - rank * e_local, e_local)
    w_all = fc.all_gather_tensor_autograd(checked(w).contiguous(), 0, group_name) if w is not None else None
    return x_all, local_ids, w_all


def data_dependent(t) -> bool:
    """Whether the token count ``t`` is data-dependent (an unbacked symbol: tokens picked by a mask or
    nonzero inside the graph), not an int or an input's (backed) size."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(free_unbacked_symbols(t))


def pad_tokens(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor | None, max_tokens: int, num_experts: int,
               group_name: str, over: bool = False):
    """x [T, H], ids [T, K], w [T, K] | None padded to ``max_tokens`` rows: zero rows, id ``num_experts``
    (no rank's expert: gather_tokens drops it), weight 0. A T above the bound on any rank is an error on
    every rank, never a truncation: a one-element all-gather of the ranks' T and ``ep_tokens_fit`` check
    it before anything is padded or sent. ``over``: T is known above the bound when the graph compiles;
    its rows are kept as they are (T of them: this graph only gets as far as the check)."""
    t = x.shape[0]
    mine = torch.stack([torch.full((), t, dtype=torch.int64, device=x.device),
                        torch.full((), max_tokens, dtype=torch.int64, device=x.device)])
    counts = fc.all_gather_tensor(mine, 0, group_name).view(-1, 2)   # (T, N) of every rank
    one = torch.ops.moe_compile.ep_tokens_fit(counts, t, max_tokens)
    max_tokens = t if over else max_tokens
    # a data-dependent T: rows written by index; Inductor re-places a slice_scatter as a copy into
    # buffer[:T], whose Min(T, N) rows torch 2.11 cannot match to T (GuardOnDataDependentSymNode)
    rows = torch.arange(t, device=x.device) if data_dependent(t) else None

    def padded(v, fill):   # v written into a static [N, ...] buffer: a tensor of N - T rows (torch.cat)
        v = v * one.to(v.dtype)   # after the check
        buffer = v.new_full((max_tokens, *v.shape[1:]), fill)
        if rows is not None:
            return buffer.index_copy(0, rows, v)
        return torch.slice_scatter(buffer, v, 0, 0, t)  # would guard N-T != 0, 1

    return padded(x, 0), padded(ids, num_experts), (padded(w, 0) if w is not None else None)


def unpad_tokens(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first T = like.shape[0] rows of ``out`` (the rank's own tokens, without the padding)."""
    t = like.shape[0]
    if data_dependent(t):
        # a data-dependent T (tokens picked by a mask in the graph): out[:T] has Min(T, N) rows, a new
        # unbacked size that torch 2.11's AOTAutograd cannot bind (PendingUnbackedSymbolNotFound); rows
        # picked by index have T's own size (ep_tokens_fit has checked T <= N before the padding)
        return out.index_select(0, torch.arange(t, device=out.device))
    return out[:t]


def scatter_tokens(partial: torch.Tensor, group_name: str) -> torch.Tensor:
    """Each token's partial outputs summed over the ranks, back on the token's own rank: [T, H]."""
    return fc.reduce_scatter_tensor_autograd(partial.contiguous(), "sum", 0, group_name)
