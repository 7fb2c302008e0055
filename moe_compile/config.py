"""MoEConfig: the backend's one configuration object.

Built from ``torch.compile(..., mode=..., options={...})``: keys starting with ``moe.`` are ours,
every other option is forwarded to Inductor. Both are validated here (a key neither ours nor an
Inductor config key, or a value of the wrong type, raises ValueError naming the key and the allowed
ones), on the compiled model's first call, before Dynamo traces anything.

    torch.compile(m, backend="moe", options={"moe.debug": True, "max_autotune": True})
    torch.compile(m, backend="moe", options={"moe.mode": "max-autotune"})   # mode + options
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Any

_INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"MoEConfig: {name}={os.environ[name]!r} is neither on (1, true, yes, on) nor off (0, false, no, "
                     "off, or unset); set one of those")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Options of the ``moe`` backend (``options={"moe.<field>": value}``).

    debug: log every MoE region's graph before/after and the pass timings (also MOE_COMPILE_DEBUG=1).
    inductor: hand the rewritten graph to Inductor; False runs it through AOTAutograd only
        (eager kernels: fast to compile, for debugging and CPU tests).
    capture_dynamic: trace where/nonzero/boolean masks into the graph (Dynamo's
        capture_dynamic_output_shape_ops), scoped to this backend's frames.
    strict: raise on an internal error of a pass instead of leaving the graph unchanged; also lets Dynamo's own
        failure on a frame raise (its suppress_errors off), where by default that frame runs eagerly, warned.
    rehome_weights: move ModuleList expert weights into one buffer per linear at compile time
        (same Parameters and values; lets the grouped GEMM read them as one 3-D tensor, no per-step
        copy). False is the same as listing "rehome_weights" in ``disable``.
    stack_expert_params: give the compiled graph each such buffer as ONE input (one autograd leaf;
        the gradient is handed to the same Parameters) instead of one input per expert weight, which
        costs host time per Parameter on every step. Single-process jobs without FSDP2 only.
        False is the same as listing "stack_expert_params" in ``disable``.
    disable: names of optional passes to skip (``moe_compile.pipeline.OPTIONAL_PASSES``).
    mode: the Inductor mode, for when torch.compile's own ``mode=`` cannot be combined with options.
    ep_overlap_chunks: an expert-parallel MoE layer's tokens are split into this many chunks, so each
        chunk's all-to-all is scheduled under another chunk's expert GEMMs (1: one chain, no overlap).
        Default 1: on 2 x H200 the all-to-all kernels did not run concurrently with the GEMMs, and
        chunks cost more than they hid (Qwen3 layer 13.0 ms at 2 chunks vs 11.2 at 1; DeepSeek-V3
        widths 46.4 vs 29.8, where each chunk's expert-weight gradient is weight-sized and summed;
        docs/benchmarks.md, expert parallelism).
    """

    debug: bool = False
    inductor: bool = True
    capture_dynamic: bool = True
    strict: bool = False
    rehome_weights: bool = True
    stack_expert_params: bool = True
    disable: tuple[str, ...] = ()
    mode: str = "default"
    ep_overlap_chunks: int = 1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "bool" and not isinstance(v, bool):
                raise ValueError(f"MoEConfig: moe.{f.name} must be a bool, got {v!r}")
        if not isinstance(self.ep_overlap_chunks, int) or isinstance(self.ep_overlap_chunks, bool) \
                or self.ep_overlap_chunks < 1:
            raise ValueError(f"MoEConfig: moe.ep_overlap_chunks must be an int >= 1, got {self.ep_overlap_chunks!r}")
        if self.mode not in _INDUCTOR_MODES:
            raise ValueError(f"MoEConfig: moe.mode={self.mode!r} is not one of {_INDUCTOR_MODES} (default 'default')")
        if isinstance(self.disable, str):
            object.__setattr__(self, "disable", (self.disable,))
        elif isinstance(self.disable, (list, set, frozenset)):
            object.__setattr__(self, "disable", tuple(self.disable))
        if not isinstance(self.disable, tuple) or not all(isinstance(p, str) for p in self.disable):
            raise ValueError(f"MoEConfig: moe.disable must be a pass name or a list of pass names, got "
                             f"{self.disable!r}")
        from .pipeline import OPTIONAL_PASSES, PASS_NAMES

        unknown = [p for p in self.disable if p not in OPTIONAL_PASSES]
        if unknown:
            required = [p for p in unknown if p in PASS_NAMES]
            raise ValueError(f"MoEConfig: moe.disable names {'passes that cannot be disabled' if required else 'unknown passes'} "
                             f"{unknown}; optional passes: {list(OPTIONAL_PASSES)}")
        for name in ("rehome_weights", "stack_expert_params"):
            if not getattr(self, name) and name not in self.disable:
                object.__setattr__(self, "disable", (*self.disable, name))

    @classmethod
    def allowed_keys(cls) -> list[str]:
        return [f"moe.{f.name}" for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, mode: str | None = None, options: dict[str, Any] | None = None
                     ) -> tuple["MoEConfig", dict[str, Any]]:
        """Split torch.compile options into (our config, options for Inductor)."""
        ours: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)}
        if options is not None and not isinstance(options, dict):
            raise ValueError(f"MoEConfig: options must be a dict of option names to values, got "
                             f"{type(options).__name__}; allowed moe keys: {cls.allowed_keys()}")
        for key, value in (options or {}).items():
            if not isinstance(key, str):
                raise ValueError(f"MoEConfig: option names are strings, got {key!r}; allowed: {cls.allowed_keys()}")
            if key.startswith("moe."):
                name = key[len("moe."):]
                if name not in names:
                    close = difflib.get_close_matches(key, cls.allowed_keys(), n=2, cutoff=0.75)
                    raise ValueError(f"MoEConfig: unknown option {key!r}"
                                     + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else "")
                                     + f"; allowed: {cls.allowed_keys()}")
                ours[name] = value
            else:
                rest[key] = value
        rest = inductor_options(rest)
        if mode is not None and mode != "default":
            if "mode" in ours and ours["mode"] != mode:
                raise ValueError(f"MoEConfig: mode={mode!r} conflicts with moe.mode={ours['mode']!r}")
            if mode not in _INDUCTOR_MODES:   # torch.compile(mode=...): name that argument, not moe.mode
                raise ValueError(f"MoEConfig: torch.compile's mode={mode!r} is not one of {_INDUCTOR_MODES}")
            ours["mode"] = mode
        if "debug" not in ours and _env_flag("MOE_COMPILE_DEBUG"):
            ours["debug"] = True
        _check_contradictions(ours, rest)
        return cls(**ours), rest


def _check_contradictions(ours: dict[str, Any], rest: dict[str, Any]) -> None:
    """Options that would silently undo each other (review helper-95) raise, naming both."""
    if ours.get("inductor") is False:
        moot = [k for k in rest if k != "fallback_random"] + (["mode"] if ours.get("mode", "default") != "default" else [])
        if moot:
            raise ValueError(f"MoEConfig: moe.inductor=False compiles without Inductor (AOTAutograd, eager kernels), "
                             f"so {moot} would have no effect; drop them, or leave moe.inductor at True")
    disable = ours.get("disable", ())
    disable = (disable,) if isinstance(disable, str) else tuple(disable) if isinstance(disable, (list, tuple, set)) else ()
    for name in ("rehome_weights", "stack_expert_params"):
        if ours.get(name) is True and name in disable:
            raise ValueError(f"MoEConfig: moe.{name}=True and moe.disable lists {name!r}; keep one of them")
    if ours.get("stack_expert_params") is True and (ours.get("rehome_weights") is False or "rehome_weights" in disable):
        raise ValueError("MoEConfig: moe.stack_expert_params=True stacks the buffers moe.rehome_weights makes, which "
                         "is off, so it would have no effect; drop one of them")
    chunks = ours.get("ep_overlap_chunks", 1)
    if isinstance(chunks, int) and chunks > 1 and "ep_overlap" in disable:
        raise ValueError(f"MoEConfig: moe.ep_overlap_chunks={chunks} splits each expert-parallel layer for the "
                         "ep_overlap pass, which moe.disable turns off: the chunks would only cost time; drop one")


def inductor_options(options: dict[str, Any]) -> dict[str, Any]:
    """The non-``moe.*`` options checked against Inductor's config as torch.compile checks them for
    backend="inductor" (known key, value of the declared type; ``-`` may stand for ``_``), with
    normalised keys. Raises ValueError naming the bad key, close matches and the allowed keys."""
    if not options:
        return {}
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    out: dict[str, Any] = {}
    for key, value in options.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name not in known:
            close = difflib.get_close_matches(str(name), [*known, *MoEConfig.allowed_keys()], n=3, cutoff=0.75)
            raise ValueError(
                f"MoEConfig: unknown option {key!r}: neither a moe.* option nor an Inductor config key"
                + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else "")
                + f". moe options: {MoEConfig.allowed_keys()}; Inductor's {len(known)} options: "
                "torch._inductor.list_options()")
        if "custom" in name and name.endswith("pass") and not _custom_pass(value):
            raise ValueError(f"MoEConfig: Inductor option {key!r} must be None, a callable taking an fx.Graph (a "
                             f"torch._inductor.custom_graph_pass.CustomGraphPass), or a list of those; got "
                             f"{type(value).__name__} {value!r}")
        get_type = getattr(inductor_config, "get_type", None)
        expected = get_type(name) if get_type is not None else None
        if isinstance(expected, type) and typing.get_origin(expected) is None and not isinstance(value, expected):
            raise ValueError(f"MoEConfig: Inductor option {key!r} must be a {expected.__name__}, got "
                             f"{type(value).__name__} {value!r} (its default is {known[name]!r})")
        out[name] = value
    return out


def _custom_pass(value) -> bool:
    """An Inductor ``*_custom_*pass`` value: None, a callable, or a list / tuple of callables."""
    return value is None or callable(value) or isinstance(value, (list, tuple)) and all(map(callable, value))
