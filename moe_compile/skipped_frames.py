"""Frames Dynamo gave up on (skipped) while a ``backend="moe"`` compile ran: the ones in MoE code become
refused records (finds and reports; never edits a graph).

``report_skipped_frames(session, since_us)`` reads Dynamo's compilation metrics after a call of the
compiled model (``backend._Scope``): a frame in MoE code (``passes/moe_source.in_moe_code``) that Dynamo
gave up on ran eagerly, MoE layer included, and gets a record with its reason code and fix
(``passes/unclaimed.classify_break``); so does a frame that hit Dynamo's recompile limit where its graphs,
or those of a frame it resumes into, held an MoE region (``session.moe_frames``). ``_skipped`` keeps them
for ``explain()``, which reports them for a model whose frames an earlier compile left skipped.
"""
from __future__ import annotations

import re


# Dynamo's fail type for a frame whose fake-tensor run raised (a shape or dtype the user's inputs get wrong):
# if the call then raises too, eager raised it, and with Dynamo's suppress_errors (the capture scope) the
# frame would also be left to run eagerly for good, rewrite included; stock torch.compile raises instead
# and compiles the frame on the next call
INPUT_ERROR_FAIL_TYPES = ("TorchRuntimeError",)


def lift_input_error_skips(since_us: int) -> set[tuple]:
    """After a call that raised: lift Dynamo's run-eagerly mark from each frame whose compile failed on
    the call's inputs since ``since_us`` (the next call compiles it, as stock torch.compile would), and
    return them as (file, first line, name): not a frame Dynamo gave up on, an error the user sees."""
    failed = _failed_since(since_us, lambda m: getattr(m, "fail_type", None) in INPUT_ERROR_FAIL_TYPES)
    for code in _codes_at(failed):
        compile_again(code)
    return failed


def raised_frames(since_us: int, exc: BaseException) -> set[tuple]:
    """Frames whose compile since ``since_us`` failed with ``exc``'s type, as (file, first line, name), when
    ``exc`` left the call: Dynamo raised that failure (``moe.strict``, an Inductor error on the unrewritten
    graph too), so the frame did not run eagerly, and the next call compiles it again (review helper-95)."""
    raised = str(exc)
    return _failed_since(since_us, lambda m: getattr(m, "fail_type", None) == type(exc).__name__
                         and _first_line(getattr(m, "fail_reason", None)) in raised)   # that failure, not another of its type


def _failed_since(since_us: int, failed) -> set[tuple]:
    """(file, first line, name) of each frame whose compile since ``since_us`` Dynamo's metrics record as
    ``failed(metric)``."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:  # pragma: no cover - torch without these
        return set()
    return {(m.co_filename, m.co_firstlineno, m.co_name) for m in get_compilation_metrics()
            if failed(m) and getattr(m, "co_filename", None) and (getattr(m, "start_time_us", None) or since_us) >= since_us}


def _first_line(text) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0].strip() if lines else "\0"   # no reason recorded: matches nothing


def lift_earlier_skips(before_us: int) -> set[tuple]:
    """At a ``backend="moe"`` session's first call: lift Dynamo's run-eagerly mark from each frame in MoE
    code that an earlier compile gave up on before ``before_us`` (stock torch.compile of the same class
    graph-breaks on the expert loop's data-dependent shapes, which this backend's capture scope traces;
    Dynamo's mark is per code object and process-wide, so the MoE layer would run eagerly here too, and
    the compile would say no MoE layer was found). The frame is traced again under this session; if it
    fails again, its record is this session's. Not lifted: a backend's own failure, a recompile limit
    hit (the frame's cache is full whatever the backend). Returns the frames lifted, as (file, first
    line, name)."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:  # pragma: no cover - torch without these
        return set()
    from .passes.unclaimed import Frame, in_moe_code

    lifted = set()
    for m in get_compilation_metrics():
        kind, reason = getattr(m, "fail_type", None), (getattr(m, "fail_reason", None) or "")
        if not kind or kind == "BackendCompilerFailed" or "recompile limit" in reason.lower() \
                or not getattr(m, "co_filename", None) or (getattr(m, "start_time_us", None) or before_us) >= before_us:
            continue
        co = (m.co_filename, m.co_firstlineno, m.co_name)
        file, line = getattr(m, "fail_user_frame_filename", None), getattr(m, "fail_user_frame_lineno", None)
        if co not in lifted and in_moe_code([Frame(*co)] + ([Frame(file, line, "")] if file and line else [])):
            lifted.add(co)
    for code in _codes_at(lifted):
        compile_again(code)
    return lifted


def compile_again(code) -> None:
    """Lift Dynamo's run-eagerly mark from ``code``: its next call is compiled (its cache entries stay)."""
    import torch._C._dynamo.eval_frame as ef

    if hasattr(ef, "set_code_exec_strategy") and hasattr(ef, "_FrameExecStrategy"):
        ef.set_code_exec_strategy(code, ef._FrameExecStrategy(ef._FrameAction.DEFAULT, ef._FrameAction.DEFAULT))


def report_skipped_frames(session, since_us: int, exclude: set = frozenset()) -> tuple[str, ...]:
    """Publish a record for each frame in MoE code that Dynamo gave up on since ``since_us`` (from
    Dynamo's compilation metrics: the frame then ran eagerly, MoE layer included), except the frames in
    ``exclude`` ((file, first line, name)). Returns the other frames it gave up on, as `Class.method`
    (file:line) and the reason's first line."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:  # pragma: no cover - torch without compilation metrics
        return ()
    from . import records
    from .passes import reasons
    from .passes.unclaimed import Frame, break_fix, classify_break, in_moe_code

    found: dict = {}
    others: dict = {}
    metrics = list(get_compilation_metrics())
    # a frame's code, by the frame part of its compile ids ("3/1" -> "3"): the entry of a recompile limit
    # hit names no code, an earlier compile of the same frame does
    codes = {str(m.compile_id).partition("/")[0]: (m.co_filename, m.co_firstlineno, m.co_name)
             for m in metrics if getattr(m, "co_filename", None) and getattr(m, "compile_id", None)}
    for m in metrics:
        if not getattr(m, "fail_type", None) or (getattr(m, "start_time_us", None) or since_us) < since_us \
                or m.fail_type == "BackendCompilerFailed":  # our own error: raised (moe.strict) or warned
            continue
        file, line = getattr(m, "fail_user_frame_filename", None), getattr(m, "fail_user_frame_lineno", None)
        frame_id = str(getattr(m, "compile_id", "") or "").partition("/")[0]
        co = (m.co_filename, m.co_firstlineno, m.co_name) if m.co_filename else codes.get(frame_id, (None, None, None))
        if co in exclude:
            continue
        skipped = Frame(co[0] or "?", co[1] or 0, co[2] or "?")
        frames = [skipped] + ([Frame(file, line, "")] if file and line else [])
        moe_frame = "recompile limit" in (m.fail_reason or "").lower() and _holds_moe(frame_id, co, codes, session)
        if not moe_frame and not in_moe_code(frames):
            reason = (m.fail_reason or m.fail_type).strip().splitlines()[0]
            at = f", at {frames[-1].at}" if len(frames) > 1 else ""
            others.setdefault(skipped.at, f"`{_qualname(skipped)}` ({skipped.at}{at}: {reason})")
            continue
        code, detail = classify_break(frames, f"{m.fail_type}: {m.fail_reason or ''}")
        earlier = found.get((frames[-1].filename, frames[-1].lineno))
        # one line, several frames: an outer frame skipped for a break in an inlined call inside its loop gets
        # Dynamo's generic "graph break in loop" (break_other); the frame that holds the line says what it is
        if earlier is not None and not (earlier[1].code == "break_other" and code != "break_other"):
            continue
        if code == "recompile_limit":
            guard = _per_layer_guard(co)
            if guard:
                code = "recompile_limit_per_layer"
                detail["guard"] = guard
        detail.update(what="skipped frame", effect=f"; Dynamo gave up on the frame `{_qualname(skipped)}` "
                                                   f"({skipped.at}), which runs eagerly, MoE code included")
        if code.startswith("recompile_limit"):
            detail.update(effect=f" (`{_qualname(skipped)}`, {skipped.at})")
        found[(frames[-1].filename, frames[-1].lineno)] = (
            (skipped.filename, skipped.lineno, skipped.name),
            records.RegionRecord("", "skipped frame", records.REFUSED, reasons.message(code, detail), (),
                                 detail["at"], code=code, fix=break_fix(code, detail),
                                 source=frames[-1].source if detail["at"] == frames[-1].at else detail["source"]))
    if found:
        records.publish([r for _, r in found.values()], session)
        live_skips().update(found)
        _mark_epoch()
    return tuple(others.values())


# a guard on per-layer state: a KV cache's layer slot (transformers' DynamicCache.layers[i]), a layer index
# (not any name with "cache" in it: a rotary `cos_cached` size or `use_cache` is no per-layer state)
_PER_LAYER_GUARD = re.compile(r"past_key_values|\blayer_idx\b|\.layers\[\d+\]")


def _per_layer_guard(code: tuple) -> str:
    """The last guard that failed for the frame ``code`` ((file, first line, name)), from Dynamo's guard
    failure log, if it reads per-layer state; else ""."""
    try:
        from torch._dynamo.utils import guard_failures
    except ImportError:  # pragma: no cover - torch without these
        return ""
    found, layers = "", set()
    for c in _codes_at({code}):
        for failure in reversed(guard_failures.get(c, ())):
            for line in str(failure).splitlines():
                guard = line.strip().lstrip("- ").split("  #")[0].strip()
                # a guard ("0/3: L['x'].size()[0] == 2"), not a source line the failure quotes
                prefixed = re.match(r"\d+/\d+: ", guard)
                if _PER_LAYER_GUARD.search(guard) and (prefixed or re.search(r"[LG]\['", guard)):
                    found = found or (guard.split(": ", 1)[-1] if prefixed else guard)
                    layers.update(re.findall(r"\.layers\[(\d+)\]", guard) or ["idx"] * ("layer_idx" in guard))
    # one frame serving several layers fails on several layers' state (or their index); a whole-model
    # frame's failures read the cache's first layer only (a new batch size, a sliding window): another cause
    return found if len(layers) > 1 or "idx" in layers else ""


def _holds_moe(frame_id: str, code: tuple, codes: dict, session) -> bool:
    """A frame that hit the recompile limit runs MoE code: its graphs held an MoE region, or those of a
    frame Dynamo resumed it in after a graph break (``torch_dynamo_resume_in_<name>_at_<line>``, which the
    hit leaves running only the graphs compiled so far)."""
    if frame_id in session.moe_frames:
        return True
    file, _, name = code
    resumed = f"torch_dynamo_resume_in_{name}_at_"
    return any(c[0] == file and str(c[2] or "").startswith(resumed)
               for c in (codes.get(f) for f in session.moe_frames) if c is not None)


# frames Dynamo gave up on, by (file, line) of the failing user line: ((file, first line, name) of the
# skipped frame, its record). explain() reports them for a model whose frames an earlier compile left
# skipped (Dynamo never traces a skipped frame again)
_skipped: dict = {}
_epoch: list = []   # the compile-start callback that marks Dynamo's state since its last reset (``_mark_epoch``)


def live_skips() -> dict:
    """``_skipped``, emptied first where Dynamo was reset since its records were made: ``torch._dynamo.reset()``
    drops every skip mark (a frame past the recompile limit is compiled again), so a record from before it is
    stale (a test's model after another test's recompile limit, in one process: found writing a test)."""
    if _skipped and not _epoch_alive():
        _skipped.clear()
    return _skipped


def _start_callbacks():
    """Dynamo's compile-start callback handler, or None (a torch without one: records are kept)."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # pragma: no cover
        return None
    ok = hasattr(callback_handler, "register_start_callback") and hasattr(callback_handler, "start_callbacks")
    return callback_handler if ok else None


def _epoch_alive() -> bool:
    handler = _start_callbacks()
    return handler is None or bool(_epoch) and any(cb is _epoch[0] for cb in handler.start_callbacks)


def _mark_epoch() -> None:
    """Register a no-op compile-start callback unless ours is still there: ``torch._dynamo.reset()`` clears
    every callback (``callback_handler.clear``), which is how ``live_skips`` tells a reset happened."""
    handler = _start_callbacks()
    if handler is None or _epoch_alive():
        return

    def since_last_reset(*_args, **_kwargs) -> None:
        return None

    _epoch[:] = [since_last_reset]
    handler.register_start_callback(since_last_reset)


def _qualname(frame) -> str:
    """The frame's function as Class.method when Dynamo's code registry still holds its code."""
    try:
        for code in _codes_at({(frame.filename, frame.lineno, frame.name)}):
            return getattr(code, "co_qualname", code.co_name)
    except Exception:  # noqa: BLE001  (a name for a message: the plain function name will do)
        pass
    return frame.name


def _codes_at(keys) -> list:
    """The code objects Dynamo's code registry still holds whose (file, first line, name) is in ``keys``."""
    if not keys:
        return []
    try:
        from torch._dynamo.convert_frame import input_codes
    except ImportError:  # pragma: no cover - torch without the registry
        return []
    codes = (ref() for ref in list(input_codes.seen))
    return [c for c in codes if c is not None and (c.co_filename, c.co_firstlineno, c.co_name) in keys]
