"""bincount counts of the router's ids read outside the rewritten region (a load-balancing loss):
``static_counts`` (passes/static_counts.py, lowering/static_counts.py) computes them with a static length,
so the compiled graph keeps no host read of bincount's length (the region's host-sync note is gone), with
eager's values and gradients. Counts it cannot prove static (ids that may reach ``minlength``) stay, and
the note names them."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)
import moe_compile
from helpers import check_compiled, make_input, make_model
from test_grouped_forms import Experts3D, _gmm

H, I, E, K = 16, 16, 4, 2


class SortedWithAux(nn.Module):
    """A sorted / grouped_mm MoE layer plus a Switch-style load-balancing loss on ``bincount`` counts.
    ``offsets``: the grouped GEMMs' offsets from the same bincount ("bincount") or from histc ("histc": the
    bincount is read by the loss only). ``minlength``: bincount's (E: provably E counts; 1: the length
    is the largest id + 1, data-dependent). ``sentinel``: the loss counts a copy of the ids in which an id may be overwritten with E."""

    def __init__(self, offsets="bincount", minlength=E, sentinel=False, routing="random", counted=None):
        super().__init__()
        self.offsets, self.minlength, self.sentinel, self.counted = offsets, minlength, sentinel, counted
        self.gate = nn.Linear(H, E)
        if routing == "empty":   # experts 1 and E-1 never chosen
            with torch.no_grad():
                self.gate.bias[1] = self.gate.bias[E - 1] = -30.0
        self.experts = Experts3D(H, I, E)

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, H)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, K, dim=-1)
        w = w.to(x.dtype)
        flat = ids.reshape(-1)
        counted = flat if self.counted is None else self.counted(ids, flat, probs)
        if self.sentinel:
            counted = flat.clone()
            counted[probs.reshape(-1)[:flat.numel()] < 0] = E   # never true, but nothing shows it
        counts = torch.bincount(counted, minlength=self.minlength)
        aux = E * (counts[:E].float() / flat.numel() * probs.mean(0)).sum()
        _, perm = torch.sort(flat)
        if self.offsets == "bincount":
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        else:
            offs = torch.cumsum(torch.histc(flat.float(), bins=E, min=0, max=E - 1), dim=0).to(torch.int32)
        ex = self.experts
        h = _gmm(x[perm // K].to(ex.gate_up.dtype), ex.gate_up.transpose(-2, -1), offs)
        g, u = h.chunk(2, dim=-1)
        h = _gmm(F.silu(g) * u, ex.down.transpose(-2, -1), offs)
        h = h * w.reshape(-1)[perm].unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, perm // K, h.to(x.dtype))
        return out.view(shape) + aux.to(x.dtype)


def _syncs_note(model, x) -> str:
    rep = moe_compile.explain(model, x)
    assert len(rep.rewritten) == 1, str(rep)
    return " ".join(n for n in rep.rewritten[0].notes if "host syncs left" in n)


# fp32 runs transformers' fallback op, which checks the offsets' length on the host: with bincount offsets a
# graph break (break_bincount, tests/test_grouped_forms.py); bf16 (F.grouped_mm) takes them as they are
@pytest.mark.parametrize("dtype, offsets, routing", [
    (torch.bfloat16, "bincount", "random"), (torch.bfloat16, "histc", "random"), (torch.bfloat16, "bincount", "empty"),
    (torch.float32, "histc", "random"), (torch.float32, "histc", "empty")])
def test_bincount_read_by_a_loss_is_counted_with_a_static_length(dtype, offsets, routing):
    torch.manual_seed(0)
    model = SortedWithAux(offsets, routing=routing).to(dtype)
    x = make_input((2, 7, H), dtype)
    check_compiled(model, [x], expect_rewritten=1, fresh_inputs=2)
    assert "bincount" not in _syncs_note(model, x)


def test_ids_flattened_by_keyword_arguments(caplog):
    """torch.flatten(input=ids): the ids walk read args[0] of a keyword-only call, and the IndexError cost the
    graph its whole rewrite (review helper-96); a failure of this optional pass now only leaves the bincount."""
    torch.manual_seed(0)
    model = SortedWithAux("histc", counted=lambda ids, flat, probs: torch.flatten(input=ids)).to(torch.bfloat16)
    x = make_input((2, 7, H), torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        check_compiled(model, [x], expect_rewritten=1)
        _syncs_note(model, x)
    assert "failed" not in caplog.text, caplog.text


def test_static_counts_under_inductor():
    """Inductor compiles the static count (an int64 scatter_add) with the rest."""
    torch.manual_seed(0)
    model = SortedWithAux("histc").to(torch.bfloat16)
    check_compiled(model, [make_input((3, 5, H), torch.bfloat16)], expect_rewritten=1, inductor=True)


@torch.library.custom_op("moe_compile_tests::bump", mutates_args={"t"})
def _bump(t: torch.Tensor, v: int) -> None:
    """Adds v in place: written by its schema, not its name."""
    t.add_(v)


@_bump.register_fake
def _(t, v):
    return None


def _foreach_add(ids, flat, probs):
    c = flat.clone()
    torch._foreach_add_([c], E)
    return c


def _sort_out(ids, flat, probs):
    c, vals = flat.clone(), torch.empty(flat.shape, dtype=probs.dtype)
    torch.sort(probs.detach().repeat(1, K).reshape(-1)[:flat.numel()], out=(vals, c))   # positions up to T * K - 1
    return c


def _topk_out_buffer(ids, flat, probs):
    buf, vals = torch.empty(ids.shape, dtype=torch.int64), torch.empty(ids.shape, dtype=probs.dtype)
    _, again = torch.topk(probs.detach(), K, dim=-1, out=(vals, buf))
    buf.add_(E)   # a write into the buffer topk's indices are
    return again.reshape(-1)


def _custom_op(ids, flat, probs):
    c = flat.clone()
    _bump(c, E)
    return c


COUNTED_BEYOND_E = {
    "minlength_1": dict(minlength=1),
    "sentinel": dict(sentinel=True),
    "foreach_add": dict(counted=_foreach_add),                     # review helper-96: writes it did not see
    "sort_out_tuple": dict(counted=_sort_out),
    "topk_out_buffer": dict(counted=_topk_out_buffer),
    "custom_op_write": dict(counted=_custom_op),
    "dtype_view": dict(counted=lambda ids, flat, probs: ids.to(torch.uint8).view(torch.int16).reshape(-1)),
}


@pytest.mark.parametrize("kw", COUNTED_BEYOND_E.values(), ids=COUNTED_BEYOND_E.keys())
def test_bincount_of_ids_that_may_reach_its_length_keeps_the_note(kw):
    """Where an id may be >= minlength (minlength below E; E written into the ids by a sentinel, a foreach op, a
    tuple out=, a custom op that mutates; the ids' bytes read as another dtype) the length is data-dependent:
    the bincount stays (the static count raised an index error there), and the note names it."""
    torch.manual_seed(0)
    model = SortedWithAux("histc", **kw).to(torch.bfloat16)
    x = make_input((2, 7, H), torch.bfloat16)
    check_compiled(model, [x], expect_rewritten=1)
    assert "bincount" in _syncs_note(model, x)


def test_disabled_static_counts_keeps_the_note():
    """options={"moe.disable": ["static_counts"]} leaves the bincount (and its note): the test above fails
    without the pass."""
    torch.manual_seed(0)
    model = SortedWithAux("histc").to(torch.bfloat16)
    x = make_input((2, 7, H), torch.bfloat16)
    compiled = torch.compile(model, backend="moe", options={"moe.disable": ["static_counts"], "moe.inductor": False})
    rep = moe_compile.explain(compiled, x)
    assert len(rep.rewritten) == 1 and "bincount" in " ".join(rep.rewritten[0].notes), str(rep)


class LoopWithAux(nn.Module):
    """A per-expert index_add loop whose caller also squares the bincount of the router's ids (a loss)."""

    def __init__(self):
        super().__init__()
        self.moe = make_model(spelling="index_add", e=E, k=K)

    def forward(self, x):
        m = self.moe
        w, ids = m.router(x)
        counts = torch.bincount(ids.flatten(), minlength=m.e)
        out = torch.zeros_like(x)
        for e in range(m.e):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, w[tok, slot, None] * m.experts.fwd(e, x[tok]))
        return out + (counts.float() / ids.numel()).pow(2).sum()


def test_bincount_beside_an_expert_loop_is_counted_with_a_static_length():
    torch.manual_seed(0)
    model, x = LoopWithAux(), make_input((12, H))
    check_compiled(model, [x], expect_rewritten=1, fresh_inputs=2)
    assert "bincount" not in _syncs_note(model, x)


class LoopWithLenCounts(nn.Module):
    """A per-expert index_add loop that also keeps each expert's row count, ``len(tok)`` (or ``tok.shape[0]``,
    one tensor per expert), for a load-balancing loss; ``how="python"``: divided as Python numbers (a host read stays)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.moe = make_model(spelling="index_add", e=E, k=K)

    def forward(self, x):
        m = self.moe
        w, ids = m.router(x)
        out, counts = torch.zeros_like(x), []
        for e in range(m.e):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, w[tok, slot, None] * m.experts.fwd(e, x[tok]))
            if self.how in ("list", "python"):
                counts.append(len(tok))
            else:
                counts.append(torch.tensor(tok.shape[0], device=x.device))
        if self.how == "python":   # divided as Python numbers first: no tensor of sizes
            f = torch.tensor([c / ids.numel() for c in counts], device=x.device)
            return out + (f * f).sum()
        f = (torch.tensor(counts, dtype=torch.float32, device=x.device) if self.how == "list"
             else torch.stack(counts).float()) / ids.numel()
        return out + (f * f).sum()


@pytest.mark.parametrize("how", ["list", "scalar"])
@pytest.mark.parametrize("routing", ["random", "two_hot_experts"])
def test_row_counts_read_by_a_loss_leave_no_selection_behind(how, routing):
    """Review helper-111: each expert's len(tok) kept its torch.where (a nonzero: a host sync) in the graph of
    the rewritten loop; torch.tensor of those sizes is now count_nonzero of the masks."""
    torch.manual_seed(0)
    model = LoopWithLenCounts(how)
    x = make_input((12, H))
    if routing == "two_hot_experts":   # every token to experts 0 and 1: the others empty
        with torch.no_grad():
            model.moe.router.proj.bias.zero_()
            model.moe.router.proj.weight.zero_()
            model.moe.router.proj.weight[:2] = 1.0
            x = x.abs()
    check_compiled(model, [x], expect_rewritten=1, fresh_inputs=2)
    note = _syncs_note(model, x)
    assert "where x" not in note and "nonzero x" not in note, note
