"""compile_blocks' nothing-rewritten verdict: hooks on the modules above the blocks hold it while a call of
one of them runs (``NothingAfterModelCall``). Split from blocks.py."""
from __future__ import annotations

import sys
import weakref

import torch
import torch.nn as nn


class NothingAfterModelCall:
    """Hooks on the (eager) modules above the blocks (the root and each module on the way down to the blocks'
    container: ``lm``, ``lm.model``): while a call of one of them runs, the nothing-rewritten verdict of a
    compile_blocks session waits for the call's end (a dense first block, as in DeepSeek-V3's
    ``first_k_dense_replace`` or Qwen3-MoE's ``mlp_only_layers``, rewrote nothing before any MoE block had
    compiled: the warning said the model rewrote nothing; reviews helper-90, helper-93). Blocks called by user
    code outside such a call (a loop over ``model.layers``) decide at once, as a whole-model compile's call does.
    The hooks remove themselves once the session rewrote a region or warned, and an earlier compile_blocks call's
    on the same blocks go (their session sees no more calls). A deep copy of the model gets no-op hooks (the
    session holds a lock). Under a trace of those modules (explain(), a whole-model compile) they do nothing."""

    _ON: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()

    def __init__(self, model: nn.Module, session, blocks: list[nn.Module], names: tuple[str, ...]):
        self.session, self.blocks, self.depth = session, {id(b) for b in blocks}, 0
        earlier = self._ON.setdefault(model, [])
        for hook in [h for h in earlier if h.blocks <= self.blocks]:
            hook.remove()
            earlier.remove(hook)
        earlier.append(self)
        self.handles = [handle for m in _above(model, names) for handle in (
            m.register_forward_pre_hook(_Hook(self.enter)), m.register_forward_hook(_Hook(self.leave), always_call=True))]

    def enter(self, module, args):
        if not torch.compiler.is_compiling():
            self.depth += 1
            self.session.defer_nothing = True

    def leave(self, module, args, output):
        if torch.compiler.is_compiling() or self.depth == 0:
            return
        self.depth -= 1
        if self.depth:
            return
        session = self.session
        session.defer_nothing = False
        session.flush_problems()   # the refusals first (also when the call raised): the verdict says "logged above"
        if sys.exc_info()[1] is not None:   # the call raised (always_call): its verdict waits for a call that ends
            return
        session.flush_nothing()
        if session.rewritten or ("nothing",) in session.warned:
            self.remove()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _above(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """``model`` and the modules every block (by its qualified ``names``) lies under (``lm.model``,
    ``lm.model.layers``), not the blocks."""
    paths = [n.split(".") for n in names]
    common = []
    for parts in zip(*(p[:-1] for p in paths)) if paths else ():
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return [model] + [model.get_submodule(".".join(common[:i])) for i in range(1, len(common) + 1)]


class _Hook:
    """One hook of ``NothingAfterModelCall``; deep-copied or pickled it is a no-op."""

    __slots__ = ("call",)

    def __init__(self, call):
        self.call = call

    def __call__(self, *args):
        return self.call(*args)

    def __reduce__(self):
        return _no_op_hook, ()


def _no_op_hook():
    return _no_op


def _no_op(*args):
    return None
