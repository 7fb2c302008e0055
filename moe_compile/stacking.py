"""ModuleList experts as stacked [E, ...] Parameters (``stack_experts``), the form
``parallelize_experts`` shards. Opt-in: the state_dict keys change (see ``stack_experts``)."""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["StackedExperts", "stack_experts"]

_VIEW_CLASSES: dict[tuple, type] = {}


def _stacked_name(path: str) -> str:
    return path.replace(".", "_")


def _view_class(cls: type, leaves: tuple[tuple[str, str], ...]) -> type:
    """``cls`` plus one property per (leaf, stacked name): ``owner.<stacked>[self._stack_index]``."""
    key = (cls, leaves)
    if key not in _VIEW_CLASSES:
        def view(leaf, stacked):
            def get(self):
                return getattr(self._stack_owner, stacked)[self._stack_index]
            get.__name__ = leaf
            return property(get, doc=f"view [e] of the stacked parameter {stacked}")

        ns = {leaf: view(leaf, stacked) for leaf, stacked in leaves}
        ns["__module__"] = cls.__module__
        _VIEW_CLASSES[key] = type(f"Stacked{cls.__name__}", (cls,), ns)
    return _VIEW_CLASSES[key]


def _check_distinct(experts: nn.ModuleList, names: tuple[str, ...]) -> None:
    """Stacking copies each expert's Parameters into one [E, ...] Parameter with one ``requires_grad``: experts
    that are one module, share a Parameter (tied) or differ in ``requires_grad`` (some frozen) would silently
    become independent, trainable or frozen rows (review helper-114)."""
    seen: dict[int, int] = {}
    for e, m in enumerate(experts):
        if id(m) in seen:
            raise ValueError(f"stack_experts: experts {seen[id(m)]} and {e} are the same module; stacked experts "
                             "must be distinct modules (a shared expert is one module called once)")
        seen[id(m)] = e
    for n in names:
        ps = [m.get_parameter(n) for m in experts]
        owner: dict[int, int] = {}
        for e, p in enumerate(ps):
            if id(p) in owner:
                raise ValueError(f"stack_experts: experts {owner[id(p)]} and {e} share the Parameter '{n}' (tied); "
                                 "stacking would copy it into independent rows: untie them first, or keep the "
                                 "ModuleList")
            owner[id(p)] = e
        frozen = [e for e, p in enumerate(ps) if not p.requires_grad]
        if frozen and len(frozen) < len(ps):
            raise ValueError(f"stack_experts: '{n}' is frozen (requires_grad=False) in experts {frozen} but not in "
                             "the others; a stacked [E, ...] Parameter has one requires_grad: freeze or unfreeze "
                             "every expert alike before stacking, or keep the ModuleList")


class StackedExperts(nn.Module):
    """E identical expert modules whose parameters live in stacked [E, ...] Parameters.

    Drop-in for the ModuleList it replaces: ``experts[e](x)``, ``len(experts)`` and iteration work
    as before; each expert's submodules (e.g. nn.Linear) read their parameters as views ``P[e]``
    of the stacked Parameters, so gradients land in the stacked ones. Built by ``stack_experts``.
    """

    def __init__(self, experts: nn.ModuleList):
        super().__init__()
        first = experts[0]
        shapes = {n: (p.shape, p.dtype, p.device) for n, p in first.named_parameters()}
        for e, m in enumerate(experts):
            got = {n: (p.shape, p.dtype, p.device) for n, p in m.named_parameters()}
            if type(m) is not type(first) or got != shapes:
                raise ValueError(f"stack_experts: expert {e} ({type(m).__name__}) differs from expert 0 "
                                 f"({type(first).__name__}) in type or parameters; experts must be identical")
        if not shapes:
            stacked = any(isinstance(getattr(m, "_stack_owner", None), StackedExperts) for m in experts.modules())
            raise ValueError("stack_experts: the experts are stacked already (their parameters live in a "
                             "StackedExperts): use that one" if stacked else "stack_experts: the experts have no "
                             "parameters")
        _check_distinct(experts, tuple(shapes))
        self.per_expert_names = tuple(shapes)                     # e.g. "w1.weight"
        for n in self.per_expert_names:
            ps = [m.get_parameter(n) for m in experts]
            self.register_parameter(_stacked_name(n), nn.Parameter(torch.stack([p.detach() for p in ps]),
                                                                   requires_grad=ps[0].requires_grad))
        leaves_by_module: dict[str, list[tuple[str, str]]] = {}  # "w1" -> [("weight", "w1_weight"), ...]
        for n in self.per_expert_names:
            mod_path, _, leaf = n.rpartition(".")
            leaves_by_module.setdefault(mod_path, []).append((leaf, _stacked_name(n)))
        for e, m in enumerate(experts):
            for mod_path, leaves in leaves_by_module.items():
                sub = m.get_submodule(mod_path)
                for leaf, _ in leaves:
                    del sub._parameters[leaf]
                sub.__class__ = _view_class(type(sub), tuple(leaves))
                object.__setattr__(sub, "_stack_owner", self)      # not a submodule: no cycle in modules()
                object.__setattr__(sub, "_stack_index", e)
        self._experts = experts                                    # parameter-free now; buffers stay there
        self.register_load_state_dict_pre_hook(_load_per_expert_keys)

    def __getitem__(self, e):
        return self._experts[e]

    def __len__(self):
        return len(self._experts)

    def __iter__(self):
        return iter(self._experts)


def _load_per_expert_keys(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                          error_msgs):
    """Accept a ModuleList checkpoint: stack ``{e}.<path>`` keys into ``<path with _>``."""
    n_exp = len(module)
    for n in module.per_expert_names:
        old = [f"{prefix}{e}.{n}" for e in range(n_exp)]
        if prefix + _stacked_name(n) not in state_dict and all(k in state_dict for k in old):
            state_dict[prefix + _stacked_name(n)] = torch.stack([state_dict.pop(k) for k in old])


def stack_experts(experts: nn.ModuleList) -> StackedExperts:
    """Convert a ModuleList of identical expert modules (e.g. SwiGLU of nn.Linear) into a
    ``StackedExperts`` with one [E, ...] Parameter per per-expert parameter, for
    ``parallelize_experts``. Opt-in, in place on the experts (they keep working, reading views).

    The state_dict keys change: ``<prefix>.<e>.<path>`` ([...] per expert) becomes
    ``<prefix>.<path with "." -> "_">`` ([E, ...]), e.g. ``experts.3.w1.weight`` [I, H] ->
    ``experts.w1_weight`` [E, I, H]. ``load_state_dict`` still accepts the old per-expert keys
    (it stacks them); checkpoints saved after stacking have the new keys only. Buffers, if the
    experts have any, stay per expert under ``<prefix>._experts.<e>.<path>``.
    Use: ``block.experts = moe_compile.stack_experts(block.experts)``; optimizers built before the
    conversion hold the old parameters: build them after."""
    if not isinstance(experts, nn.ModuleList) or len(experts) == 0:
        raise ValueError(f"stack_experts: expected a non-empty nn.ModuleList, got {type(experts).__name__}")
    return StackedExperts(experts)
