"""Expert-parallel custom ops: the marker for sharded experts, and the plan/dispatch/combine movement.

Legend: T tokens, K top-k, N = T*K routed rows per rank (the same N on every rank), E experts,
ep ranks in the expert-parallel group, E_local = E / ep (rank r owns global experts
[r*E_local, (r+1)*E_local)), H / H2 row widths. ``group_name`` is ``ProcessGroup.group_name``.

    ep_experts(local[E_local, ...], E, group_name, max_tokens=0) -> [E, ...]   marker; never runs (raises)
    ep_same_tokens(counts[ep] i64, T) -> 1 (i64, 0-dim)             every rank holds T tokens, else an error
    ep_tokens_fit(counts[ep, 2] i64, T, N) -> 1 (i64, 0-dim)        each rank's (T, N): T <= N, N the same, else an error
    ep_plan(offsets[E] i32, E, group_name) -> plan[2, ep, E_local] i64, recv_offsets[E_local] i32
    ep_dispatch(xp[N, H], plan, group_name) -> [ep*N, H]      (bwd: ep_combine of the gradient)
    ep_combine(y[ep*N, H2], plan, group_name) -> [N, H2]      (bwd: ep_dispatch of the gradient)

A lowering of one MoE layer on rank r (weights: the local shards, [E_local, ...])::

    perm, inv, offsets = route_permute(ids, E)                 # sorted by GLOBAL expert id
    xp = permute_rows(x, perm, inv, offsets, K)                # [N, H]
    plan, recv_offsets = ep_plan(offsets, E, group_name)
    xr = ep_dispatch(xp, plan, group_name)                     # [ep*N, H], local experts, expert-major
    h = grouped_mm(xr, w1_local, recv_offsets) ...             # rows past recv_offsets[-1] are zero
    yr = grouped_mm(a, w2_local, recv_offsets)
    y = ep_combine(yr, plan, group_name)                       # [N, H2] in xp's row order
    out = unpermute_combine(y, inv, weights, offsets)

Worked example (ep=2, E=4, E_local=2, this is rank 0, rank 1 has offsets [0, 2, 3, 3])::

    offsets      = [1, 2, 3, 3]         counts [1, 1, 1, 0]
    plan[0]      = [[1, 1], [1, 0]]     (to rank 0: experts 0, 1; to rank 1: its experts 0, 1)
    plan[1]      = [[1, 1], [0, 2]]     (from rank 0, from rank 1; per my local expert)
    recv_offsets = [1, 4]               (expert 0: 1 row; expert 1: 1 + 2 rows)

Rows past offsets[-1] ("dropped": ids outside [0, E)) are never sent. Every output shape is static
(the worst case: every rank sends all N rows to this rank); counts stay on the device; the
movement is a partial permutation, so results are exact and deterministic. How rows move is the
transport's business (``ep_transport.select_transport``).
"""
from __future__ import annotations

import torch

from .ep_transport import resolve_group, select_transport
from .common import check as _check
from .common import device_assert

EP_EXPERTS_ERROR = (
    "moe_compile.ep_experts: these experts are sharded over an expert-parallel mesh by "
    "moe_compile.parallelize_experts; run the model through torch.compile(model, backend=\"moe\"), which "
    "rewrites the MoE layer into expert-parallel dispatch/combine. If it already does, the code that reads "
    "these weights ran outside every graph the backend rewrote: either the layer was refused (the WARNING "
    "logged when it compiled, or moe_compile.explain(model, inputs), says why), or Dynamo ran it eagerly: "
    "under torch.compiler.disable, or, with no warning, after a graph break it could not resume from "
    "inside activation checkpointing (e.g. FSDP2's hooks on an expert container that fully_shard_experts "
    "made an FSDP unit, dp > 1 or mp_policy, inside a layer checkpointed by gradient_checkpointing_enable "
    "or torch.utils.checkpoint: use moe_compile.replicate_experts(model, mesh['dp']) in place of "
    "fully_shard_experts (no FSDP unit on the experts), train those layers without activation checkpointing, "
    "or put ep over every rank (dp = 1); README, expert parallelism, known limits)")


def _ep_size(group_name: str) -> int:
    return resolve_group(group_name).size()


# --------------------------------------------------------------------------- ep_experts (marker)
@torch.library.custom_op("moe_compile::ep_experts", mutates_args=())
def ep_experts(local: torch.Tensor, num_experts: int, group_name: str, max_tokens: int = 0) -> torch.Tensor:
    """The global [E, ...] expert tensor whose rows [rank*E_local, (rank+1)*E_local) are ``local``.
    Only its shape exists: the backend's lowering replaces it with dispatch/combine around the
    local shard (``max_tokens`` > 0: each rank's tokens padded to that many rows before they travel,
    so ranks may hold different token counts; 0: every rank holds the same count). Running it means
    the layer was not rewritten: raise, never compute wrong numbers."""
    raise RuntimeError(EP_EXPERTS_ERROR)


@ep_experts.register_fake
def _(local, num_experts, group_name, max_tokens=0):
    return local.new_empty(num_experts, *local.shape[1:])


def _ep_experts_setup(ctx, inputs, output):
    local, group_name = inputs[0], inputs[2]
    ctx.rows = local.shape[0]
    ctx.group_name = group_name


def _ep_experts_bwd(ctx, grad):
    rank = resolve_group(ctx.group_name).rank()
    return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None, None, None


ep_experts.register_autograd(_ep_experts_bwd, setup_context=_ep_experts_setup)


# --------------------------------------------------------------------------- ep_same_tokens
# the device-side assert's message: at most DEVICE_ASSERT_MAX_CHARS (common.device_assert)
SAME_TOKENS = ("moe_compile expert parallelism: every rank of the expert-parallel group must hold the same "
               "number of tokens T in the MoE layer (or set the same max_tokens on every rank)")
SAME_TOKENS_FIX = ("pad the batch to a common size, or give moe_compile.parallelize_experts(model, mesh, max_tokens=N) "
                   "a bound on any rank's T, the same N on every rank: each rank's tokens are then padded to N rows "
                   "before they travel")


@torch.library.custom_op("moe_compile::ep_same_tokens", mutates_args=())
def ep_same_tokens(counts: torch.Tensor, t: int) -> torch.Tensor:
    """1 (int64, 0-dim) when every rank's token count in ``counts`` [ep] is ``t``, else SAME_TOKENS:
    raised here on the CPU, a device-side assert on a GPU (no host sync). Callers multiply what they
    send by it, so no collective of token-sized tensors starts before the check (a size mismatch in
    a collective aborts the process (gloo) or hangs it (NCCL), with no message)."""
    same = (counts == t).all()
    if counts.device.type == "cpu":
        if not bool(same):
            raise RuntimeError(f"{SAME_TOKENS}; fix: {SAME_TOKENS_FIX}")
    else:
        device_assert(same, SAME_TOKENS)
    return same.to(torch.int64)


@ep_same_tokens.register_fake
def _(counts, t):
    return counts.new_empty((), dtype=torch.int64)


# --------------------------------------------------------------------------- ep_tokens_fit
TOO_MANY_TOKENS = ("moe_compile expert parallelism: {who} {hold} {t} tokens in the "
                   "MoE layer, more than parallelize_experts(..., max_tokens={n}) allows; give parallelize_experts a "
                   "larger max_tokens (every rank the same), or split the batch")
# the device-side assert's message (at most DEVICE_ASSERT_MAX_CHARS)
TOO_MANY_TOKENS_DEVICE = ("moe_compile expert parallelism: a rank holds more tokens in the MoE layer than "
                          "parallelize_experts(..., max_tokens) allows")


@torch.library.custom_op("moe_compile::ep_tokens_fit", mutates_args=())
def ep_tokens_fit(counts: torch.Tensor, t: int, max_tokens: int) -> torch.Tensor:
    """1 (int64, 0-dim) when every rank's (T, N) in ``counts`` [ep, 2] (all-gathered before any padding:
    its token count and its max_tokens) has T <= ``max_tokens`` and N == ``max_tokens``, else
    TOO_MANY_TOKENS or SAME_TOKENS: raised here on the CPU, a device-side assert on a GPU (no host
    sync). Every rank checks every rank's count, so all of them raise together before any token-sized
    collective (a rank raising alone left its peers waiting in the next one). On a GPU a rank over the
    bound raises on the host instead (its own T is a size: no sync), after the counts' all-gather was
    issued, so that its peers complete it and stop at their assert. pad_tokens multiplies what it pads
    by this 1, so the check runs before anything is padded or sent."""
    fits, same = (counts[:, 0] <= max_tokens).all(), (counts[:, 1] == max_tokens).all()
    if counts.device.type == "cpu":
        if not bool(same):
            raise RuntimeError(f"{SAME_TOKENS}; fix: {SAME_TOKENS_FIX}")
        if not bool(fits):
            over = (counts[:, 0] > max_tokens).nonzero().flatten().tolist()
            raise RuntimeError(TOO_MANY_TOKENS.format(
                who=f"{'rank' if len(over) == 1 else 'ranks'} {', '.join(map(str, over))} of the expert-parallel group",
                hold="holds" if len(over) == 1 else "hold", n=max_tokens,
                t=", ".join(str(int(counts[r, 0])) for r in over)))
    else:
        if t > max_tokens:   # before the asserts: this rank's process stays usable (no device-side assert)
            raise RuntimeError(TOO_MANY_TOKENS.format(who="this rank", hold="holds", t=t, n=max_tokens))
        device_assert(same, SAME_TOKENS)
        device_assert(fits, TOO_MANY_TOKENS_DEVICE)
    return (fits & same).to(torch.int64)


@ep_tokens_fit.register_fake
def _(counts, t, max_tokens):
    return counts.new_empty((), dtype=torch.int64)


# --------------------------------------------------------------------------- ep_plan
def _check_offsets(offsets: torch.Tensor, num_experts: int, ep: int) -> None:
    _check(offsets.dim() == 1 and offsets.numel() == num_experts, "ep_plan",
           f"offsets must be [E={num_experts}], got {tuple(offsets.shape)}")
    _check(offsets.dtype == torch.int32, "ep_plan", f"offsets must be int32, got {offsets.dtype}")
    _check(num_experts % ep == 0, "ep_plan", f"{num_experts} experts do not split over {ep} ranks")


@torch.library.custom_op("moe_compile::ep_plan", mutates_args=())
def ep_plan(offsets: torch.Tensor, num_experts: int, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    group = resolve_group(group_name)
    ep = group.size()
    _check_offsets(offsets, num_experts, ep)
    ends = offsets.long()
    counts = ends - torch.nn.functional.pad(ends[:-1], (1, 0))
    send = counts.view(ep, num_experts // ep)
    recv = select_transport(group, offsets.device).exchange_counts(send)
    recv_offsets = recv.sum(0).cumsum(0).to(torch.int32)
    return torch.stack([send, recv]), recv_offsets


@ep_plan.register_fake
def _(offsets, num_experts, group_name):
    ep = _ep_size(group_name)
    _check_offsets(offsets, num_experts, ep)
    e_local = num_experts // ep
    return offsets.new_empty(2, ep, e_local, dtype=torch.int64), offsets.new_empty(e_local, dtype=torch.int32)


# --------------------------------------------------------------------------- ep_dispatch / ep_combine
def _check_plan(op: str, t: torch.Tensor, plan: torch.Tensor, ep: int) -> None:
    _check(t.dim() == 2, op, f"input must be 2-D [rows, H], got {tuple(t.shape)}")
    _check(plan.dim() == 3 and plan.shape[:2] == (2, ep) and plan.dtype == torch.int64, op,
           f"plan must be int64 [2, ep={ep}, E_local] from ep_plan, got {plan.dtype} {tuple(plan.shape)}")
    if op == "ep_combine":
        _check(t.shape[0] % ep == 0, op, f"y has {t.shape[0]} rows, not ep * N for ep={ep} "
               "(pass rows in ep_dispatch's output layout)")


@torch.library.custom_op("moe_compile::ep_dispatch", mutates_args=())
def ep_dispatch(xp: torch.Tensor, plan: torch.Tensor, group_name: str) -> torch.Tensor:
    group = resolve_group(group_name)
    _check_plan("ep_dispatch", xp, plan, group.size())
    return select_transport(group, xp.device).dispatch(xp, plan)


@ep_dispatch.register_fake
def _(xp, plan, group_name):
    ep = _ep_size(group_name)
    _check_plan("ep_dispatch", xp, plan, ep)
    return xp.new_empty(ep * xp.shape[0], xp.shape[1])


@torch.library.custom_op("moe_compile::ep_combine", mutates_args=())
def ep_combine(y: torch.Tensor, plan: torch.Tensor, group_name: str) -> torch.Tensor:
    group = resolve_group(group_name)
    _check_plan("ep_combine", y, plan, group.size())
    return select_transport(group, y.device).combine(y, plan)


@ep_combine.register_fake
def _(y, plan, group_name):
    ep = _ep_size(group_name)
    _check_plan("ep_combine", y, plan, ep)
    return y.new_empty(y.shape[0] // ep, y.shape[1])


def _save_plan(ctx, inputs, output):
    _, plan, group_name = inputs
    ctx.save_for_backward(plan)
    ctx.group_name = group_name


def _dispatch_bwd(ctx, grad):
    (plan,) = ctx.saved_tensors
    return ep_combine(grad.contiguous(), plan, ctx.group_name), None, None


def _combine_bwd(ctx, grad):
    (plan,) = ctx.saved_tensors
    return ep_dispatch(grad.contiguous(), plan, ctx.group_name), None, None


ep_dispatch.register_autograd(_dispatch_bwd, setup_context=_save_plan)
ep_combine.register_autograd(_combine_bwd, setup_context=_save_plan)

