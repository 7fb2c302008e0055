"""explain()'s probe for MoE experts that ran eagerly: code Dynamo never handed to the backend.

Dynamo runs some code eagerly without a graph and without telling the backend: a graph break inside
activation checkpointing (``torch.utils.checkpoint``, ``gradient_checkpointing_enable``) runs the
whole checkpointed call eagerly, a frame Dynamo cannot resume is skipped, and ``torch.compiler.disable``
runs as written. No graph, so no record: the layer would be missing from explain's report.

While explain runs the model, ``probes(model)`` puts a forward pre-hook on every module that looks
like experts: a container of 3-D Parameters stacked per expert, [E, ...], next to a router op; an
expert-parallel one; each expert of an nn.ModuleList named ``*expert*``, or held by a module whose
class routes with a top-k and loops over experts, whatever the list is called. Traced by Dynamo, the
hook does nothing
(``torch.compiler.is_compiling()`` is constant there): only an eager call records the module. The
hooks are removed when explain returns. ``records(...)`` turns what ran eagerly into refused records
(code ``ran_eagerly``), except where a graph break in MoE code already says why.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn as nn

from .hf_recorders import REASON, UNDER_CHECKPOINT, recorder_hooks, refusal
from .records import REFUSED, RegionRecord


def _experts(model: nn.Module):
    """(path, module to probe, what it looks like) for every module that looks like experts."""
    from .ep_info import ep_info
    from .ep_containers import _module_list_experts, expert_parameters

    for path, module in model.named_modules():
        if ep_info(module) is not None:
            yield path, module, "experts sharded by parallelize_experts"
            continue
        try:
            found = expert_parameters(module)
        except ValueError:   # 3-D parameters with different E: not an expert container
            found = None
        if found is not None and _routed_near(model, path):
            yield path, module, f"3-D Parameters stacked per expert, E={found[0]}"
        elif _module_list_experts(path, module) or _routed_list(model, path, module):
            for expert in module:
                yield path, expert, f"an nn.ModuleList of {len(module)} experts"


def _routed_near(model: nn.Module, path: str) -> bool:
    """The module holding ``path`` (or one below it: its router module) has a class whose source calls a
    router op: 3-D Parameters next to a top-k are experts, per-head attention weights [H, ...] are not."""
    from .passes.moe_source import routes

    owner = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    return any(routes(cls) for cls in dict.fromkeys(type(m) for m in owner.modules()))


def _routed_list(model: nn.Module, path: str, module: nn.Module) -> bool:
    """An nn.ModuleList of two or more modules of one class with Parameters, held by a module whose class
    routes and loops over experts (``passes/moe_source.routes_per_expert``), whatever the list is called
    (``self.mlps``, ``self.ffns``)."""
    from .passes.moe_source import routes_per_expert

    if not isinstance(module, nn.ModuleList) or len(module) < 2 or len({type(m) for m in module}) != 1 \
            or not all(any(True for _ in m.parameters()) for m in module):
        return False
    owner = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    return routes_per_expert(type(owner))


@contextlib.contextmanager
def probes(model):
    """Yields {path: what it looks like} of the experts that ran eagerly inside the block."""
    eager: dict[str, str] = {}
    handles = []
    if isinstance(model, nn.Module):
        for path, module, what in _experts(model):
            listed = module is not (model.get_submodule(path) if path else model)   # one expert of a ModuleList
            handles.append(module.register_forward_pre_hook((_expert_hook if listed else _hook)(eager, path, what)))
    try:
        yield eager
    finally:
        for h in handles:
            h.remove()


def _hook(eager: dict, path: str, what: str):
    """A forward pre-hook that records ``path`` when it runs eagerly. Where the module's call is traced it is
    traced too and does nothing; where the call is not (its caller runs eagerly) Dynamo compiles the hook as a
    frame of its own, also doing nothing: the container's forward is then compiled as a frame of its own,
    and may be rewritten there (its loop and the ids it is given are in it). Only Dynamo off records it."""
    def hook(_module, _args):
        if not torch.compiler.is_compiling():
            eager[path] = what
    return hook


def _expert_hook(eager: dict, path: str, what: str):
    """``_hook`` for one expert of an nn.ModuleList, run eagerly also where Dynamo is on but does not trace the
    call (its caller is a frame Dynamo gave up on, or a break left the call outside every graph): that expert
    is outside its router's graph whatever Dynamo does next (its forward compiled as a frame of its own is
    one expert without a router: never rewritten). Dynamo still inlines the hook into a frame it traces."""
    def hook(_module, _args):
        if not torch.compiler.is_compiling():
            eager[path] = what
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # pragma: no cover - torch without per-code frame strategies
        return hook
    skip_code(hook.__code__)   # never a frame of its own: run eagerly there
    return hook


def records(model: nn.Module, eager: dict[str, str], breaks) -> list[RegionRecord]:
    """A refused record per module of ``eager``, unless a graph break record (``breaks``) sits in the
    source of its class or of a module holding it (the MoE block whose loop calls ModuleList experts):
    that record already names the cause and the fix. A record of a frame Dynamo gave up on counts also at
    the frame's first line, in the class of the module holding the experts (the MoE block whose frame it is):
    its failing line may be in torch (a BatchNorm's data-dependent check inside an expert)."""
    from .passes import reasons
    from .skipped_frames import live_skips

    frames = [f"{file.rsplit('/', 1)[-1]}:{line}" for (file, line, _), r in list(live_skips().values())
              if r in breaks]
    out = []
    for path, what in eager.items():
        module = model.get_submodule(path) if path else model
        cls = type(module[0]) if isinstance(module, nn.ModuleList) else type(module)
        parts = path.split(".") if path else []
        holders = [model.get_submodule(".".join(parts[:i])) if i else model for i in range(len(parts))]
        spans = [_span(c) for c in dict.fromkeys([cls, *(type(m) for m in holders)])]
        if any(_in(b.where, file, span) for b in breaks for file, span in spans) \
                or any(_in(site, *_span(type(holders[-1]))) for site in frames if holders):
            continue
        file, span = spans[0]
        where = f"{file.rsplit('/', 1)[-1]}:{span.start}" if file else "?"
        detail = {"module": path or "<top>", "what": what, "cls": cls.__name__}
        recorders = _recorders_near(model, parts, holders)
        code = REASON if recorders else "ran_eagerly"
        reason, fix = (refusal(recorders, UNDER_CHECKPOINT, **detail) if recorders
                       else (reasons.message(code, detail), reasons.fix(code)))
        out.append(RegionRecord(module=path, form="eager", status=REFUSED, code=code, reason=reason, fix=fix, ops=(),
                                where=where))
    return out


def _recorders_near(model: nn.Module, parts: list[str], holders: list[nn.Module]) -> list[tuple[str, str]]:
    """transformers' output recorders (``hf_recorders``) in the two modules holding the experts nearest to
    them that are not containers (the MoE block and the layer around it): what made the layer run eagerly
    under activation checkpointing with ``output_router_logits=True`` (transformers' layers say whether they
    checkpoint: ``gradient_checkpointing``; recorders elsewhere break nothing while no call asks for them)."""
    if not any(getattr(h, "gradient_checkpointing", False) is True for h in holders):
        return []
    near = [(i, m) for i, m in enumerate(holders) if not isinstance(m, (nn.ModuleList, nn.ModuleDict))][-2:]
    for i, m in reversed(near):   # the MoE block first, then the layer around it
        found = recorder_hooks(m, ".".join(parts[:i]))
        if found:
            return found
    return []


def _span(cls: type) -> tuple[str, range]:
    """(source file, line range) of ``cls`` ("", empty where it has no source)."""
    try:
        lines, first = inspect.getsourcelines(cls)
        return inspect.getsourcefile(cls) or "", range(first, first + len(lines))
    except (OSError, TypeError):
        return "", range(0)


def _in(where: str, file: str, span: range) -> bool:
    name, _, line = where.rpartition(":")
    return bool(file) and file.endswith(name) and line.isdigit() and int(line) in span
