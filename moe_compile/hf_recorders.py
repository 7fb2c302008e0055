"""transformers' output recorders on MoE layers: why a layer runs unrewritten with ``output_router_logits``.

transformers 5 collects router logits (``output_router_logits=True``, for the load-balancing loss) and
other per-layer outputs with forward hooks it installs, the first time a call asks for them, on the
modules that produce them (``utils/output_capturing.py``: the router of each MoE layer). Each hook reads
the active collector from a ``ContextVar`` and appends the module's output to a list that lives outside
the module. Under torch.compile that is fine where the model's own forward is traced (a whole-model
compile: the collector is set inside the trace), but not where the layer is compiled or checkpointed on
its own:

- ``compile_blocks``: the ``ContextVar`` read is untraceable inside a block's frame: a graph break
  between the router and the experts in every layer (each refused ``ids_from_graph_input``);
- activation checkpointing (``gradient_checkpointing_enable``): Dynamo cannot keep the append to a list
  outside the checkpointed call and runs the whole checkpointed layer eagerly, unless torch's
  ``skip_fwd_side_effects_in_bwd_under_checkpoint`` lets it keep the append in the forward (where eager's
  recomputation in the backward appends nothing either: no collector is set then).

transformers installs every recorder, the routers' included, on the first call that asks for any output
(``output_hidden_states`` too). ``recorder_hooks`` finds them; ``REASON`` is the code explain() (both
cases) and compile_blocks' warning give instead of ``ids_from_graph_input`` / ``ran_eagerly``.
"""
from __future__ import annotations

import torch.nn as nn

_RECORDER_MODULE = "transformers.utils.output_capturing"
REASON = "router_logits_recorder"
# what the recorders do to the layer, in the reason (its ``how``)
UNDER_BLOCKS = ("compiled block by block (compile_blocks), each block's frame reads that ContextVar, which Dynamo "
                "cannot trace: a graph break between the router and the experts of every block")
UNDER_CHECKPOINT = ("inside activation checkpointing (gradient_checkpointing_enable) Dynamo cannot keep that append "
                    "and runs the whole checkpointed layer eagerly")


def _recorded_key(hook) -> str | None:
    """The output a transformers recorder hook collects ("router_logits"), None for any other hook."""
    if getattr(hook, "__module__", None) != _RECORDER_MODULE:
        return None
    names = getattr(getattr(hook, "__code__", None), "co_freevars", ())
    cells = getattr(hook, "__closure__", None) or ()
    for name, cell in zip(names, cells):
        if name == "key":
            try:
                return str(cell.cell_contents)
            except ValueError:   # an empty cell
                return None
    return "?"


def recorder_hooks(module: nn.Module, prefix: str = "") -> list[tuple[str, str]]:
    """(path, recorded output) of every module at or under ``module`` that carries a transformers output
    recorder other than the hidden-state one (a decoder layer's output: recorded after the layer runs)."""
    found = []
    for path, m in module.named_modules(prefix=prefix):
        for hook in getattr(m, "_forward_hooks", {}).values():
            key = _recorded_key(hook)
            if key is not None and key != "hidden_states":
                found.append((path or "<top>", key))
    return found


def describe(found: list[tuple[str, str]]) -> str:
    """``found`` (``recorder_hooks``) in a reason: the first few modules and what they record."""
    routers = [f for f in found if f[1] == "router_logits"]
    found = routers or found   # the routers' split the MoE layer; the others (attentions) are noise here
    return ", ".join(f"`{p}` ({k})" for p, k in found[:2]) + (f" and {len(found) - 2} more" if len(found) > 2 else "")


def refusal(found: list[tuple[str, str]], how: str, **detail) -> tuple[str, str]:
    """(reason, fix) of ``REASON`` for the recorders ``found`` (``recorder_hooks``), ``how`` they stop the rewrite
    (``UNDER_BLOCKS``, ``UNDER_CHECKPOINT``), and the layer's ``module``, ``cls`` and ``what``."""
    from moe_compile.passes import reasons

    detail.update(hooks=describe(found), how=how)
    return reasons.message(REASON, detail), reasons.fix(REASON)
