"""What happened to each MoE region: one ``RegionRecord`` per region of every compiled graph.

The backend publishes the records of each graph it compiled (``publish``) when the compiled code
first runs (so a region counts as rewritten only once the code that runs contains it), and the
records of frames Dynamo gave up on in MoE code when the call that tried them returns;
``recording()`` collects them (``explain`` and tests), and ``counters`` counts them process-wide
(like ``torch._dynamo.utils.counters``: tests assert on it).

Never silent: every refused record (a region not rewritten, MoE-like code no region covers, a graph
break in MoE code) is logged once at WARNING with its reason and fix, once per ``Session`` (one
``torch.compile(..., backend="moe")`` call) and region, never per call or per recompile; a session
whose calls compiled graphs but rewrote nothing warns once. ``explain()`` uses a quiet session: it
returns the same records instead.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import threading

REWRITTEN, REFUSED = "rewritten", "refused"

counters: collections.Counter = collections.Counter()
_local = threading.local()
log = logging.getLogger("moe_compile")
# reasons already logged where they happened (with the exception): not logged twice
_WARNED_ELSEWHERE = ("matcher_error", "lowering_error", "compile_error")


@dataclasses.dataclass(frozen=True)
class RegionRecord:
    """One MoE region of one compiled graph. ``code``/``reason``/``fix`` say why it was refused
    (``passes/reasons.py``); ``ops`` are the moe_compile ops of a rewritten graph."""
    module: str
    form: str
    status: str            # REWRITTEN | REFUSED
    reason: str
    ops: tuple[str, ...]
    where: str
    num_experts: int = 0
    top_k: int = 0
    notes: tuple[str, ...] = ()
    code: str = ""
    fix: str = ""
    source: str = ""       # graph breaks: the user's source line

    @property
    def is_break(self) -> bool:
        """A graph break or a frame Dynamo gave up on, in MoE code (not a region)."""
        return self.code.startswith("break_")


class Session:
    """One ``torch.compile(..., backend="moe")`` call (or one ``explain()``, ``quiet``): what it
    rewrote, and what it has warned about (each region and the nothing-rewritten case once)."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.rewritten = 0
        self.refused = 0
        self.warned: set = set()
        self.lock = threading.Lock()
        self.graphs = 0   # graphs the backend was handed in this session
        # explain's: (records, graph inputs' attribute paths, one call's inputs) -> the records with
        # module paths from the model's root (a graph compiled for a nested frame, e.g. a decoder
        # layer's forward after a graph break, names modules from that frame and serves every layer)
        self.place = None
        # explain()'s: its graphs run without Inductor for speed but are reported as the compile's they
        # explain (explain_inductor: moe.inductor of that compile, the default's unless a compiled model's)
        self.explaining = False
        self.explain_inductor = True
        # Dynamo frame ids ("3" of compile id "3/1") whose graphs held an MoE region: a recompile limit hit
        # there runs MoE code eagerly whatever the frame's own code looks like (a model's top-level forward)
        self.moe_frames: set = set()
        # whether this session's first call has lifted the run-eagerly marks an earlier compile left on
        # frames in MoE code (skipped_frames.lift_earlier_skips)
        self.lifted_earlier_skips = False
        # compile_blocks' session, while a call of the model runs: the nothing-rewritten verdict waits for the
        # call's end (a dense first block compiles, and ends its call, before any MoE block has); what waits:
        # the frames given up on, or None when nothing does (flush_nothing). ``blocks``: compile_blocks' session
        self.blocks = False
        self.defer_nothing = False
        self.pending_nothing: tuple[str, ...] | None = None
        self.pending_problems: dict = {}   # and the refusals' warnings (one per problem: flush_problems)
        # Inductor's fallback_random when this session's compile first ran the passes (it decides which rewrites
        # keep eager's random draws): explain() of the compiled model follows it, not the value at explain time
        self.fallback_random: bool | None = None
        # rewritten regions whose compile then failed (code compile_error; run unrewritten), by (module, where):
        # explain() of the compiled model reports them so, not as the rewrite its Inductor-less trace makes
        self.compile_errors: dict = {}

    def warn_once(self, key, message: str) -> None:
        with self.lock:
            if self.quiet or key in self.warned:
                return
            self.warned.add(key)
        log.warning("%s", message)

    def count(self, records) -> None:
        # once per problem: a break per source line (every layer shares it), a refused region per code and
        # source line, naming the graph's modules that share it (48 identical layers: one warning, not 48)
        problems: dict = {}
        for r in records:
            if r.status == REWRITTEN:
                self.rewritten += 1
                self.compile_errors.pop((r.module, r.where), None)   # a later compile of it succeeded
                continue
            self.refused += 1
            if r.code == "compile_error":
                self.compile_errors[r.module, r.where] = r
            if r.code not in _WARNED_ELSEWHERE:
                problems.setdefault(("break" if r.is_break else "region", r.code, r.where), []).append(r)
        for key, same in problems.items():
            self.pending_problems.setdefault(key, []).extend(same)
        if not self.defer_nothing:   # compile_blocks, inside a call of the model: wait, the other blocks' come too
            self.flush_problems()

    def flush_problems(self) -> None:
        """One warning per problem naming every region that has it: after each compile, or under
        ``defer_nothing`` (compile_blocks) at the end of the model's call, for all its blocks' refusals."""
        from .debug import format_warning

        pending, self.pending_problems = self.pending_problems, {}
        for key, same in pending.items():
            self.warn_once(key, format_warning(same[0], [r.module for r in same[1:]]))

    def after_call(self, compiled_frames: bool, skipped: tuple[str, ...] = ()) -> None:
        """After a call of the compiled model that compiled frames: warn once if nothing was rewritten.
        ``skipped``: frames outside MoE code that Dynamo gave up on in a call that handed this session no
        graph at all (they ran eagerly, with everything they call). A ``defer_nothing`` session keeps the
        verdict for ``flush_nothing``."""
        if not compiled_frames or self.rewritten:
            return
        if self.defer_nothing:
            self.pending_nothing = tuple(dict.fromkeys((*(self.pending_nothing or ()), *skipped)))
            return
        why = (f"{self.refused} MoE region(s) or graph break(s) were refused, each logged above"
               if self.refused else "no MoE layer was found in the compiled graphs; a layer Dynamo ran "
               "eagerly, such as a checkpointed layer after a graph break in it, never reaches the backend" + (
                   "" if self.blocks else "; a dense layer compiled on its own (torch.compile per decoder layer) "
                   "has none: each torch.compile call reports on its own graphs, moe_compile.compile_blocks(model) "
                   "on the model's"))
        if skipped and not self.refused:
            why = (f"no graph reached the backend: Dynamo gave up on {'; '.join(skipped)}, which then ran "
                   "eagerly with everything it calls")
        self.warn_once(("nothing",), f"moe_compile: backend=\"moe\" rewrote no MoE region of this compiled model "
                                     f"({why}); it runs as torch.compile's default backend would run it. "
                                     "moe_compile.explain(compiled_model, *inputs) lists what was found and why.")

    def flush_nothing(self) -> None:
        """The end of a model's call: the verdict its block calls kept while ``defer_nothing`` was set."""
        pending, self.pending_nothing = self.pending_nothing, None
        if pending is not None:
            self.after_call(True, pending)


_default_session = Session()   # compiles outside a capture scope (a backend called directly)


def current_session() -> Session:
    return getattr(_local, "session", None) or _default_session


def publish(records, session: Session | None = None) -> None:
    """Count, log (once per session and region) and hand out the records of one compiled graph."""
    records = list(records)
    session = session or current_session()
    if not session.explaining:   # explain() changes nothing, the process-wide counts included
        for r in records:
            counters[r.status] += 1
    session.count(records)
    for sink in getattr(_local, "sinks", []):
        sink.append(records)


class PublishOnFirstCall:
    """The compiled graph; its region records are published when it first runs, so a region counts as
    rewritten only once the code that runs contains it (never for a graph Dynamo compiled and then
    dropped, e.g. when it failed after the backend returned). In explain's session (``place``) the
    records are published for every call whose inputs place them at other module paths: one graph
    of a nested frame serves every layer that runs it (compile_blocks' session too: one graph serves
    every block of its class)."""

    def __init__(self, fn, records, session, gm):
        from .passes.normalize import attribute_path

        self.fn, self.records, self.session = fn, tuple(records), session
        if getattr(fn, "_boxed_call", False):
            self._boxed_call = True
        self.placed: set = set()   # explain, compile_blocks: the placed records already published
        self.inputs_seen: set = set()   # and the inputs (ids of the attribute inputs) already placed
        self.attributes = () if session.place is None else tuple(
            (i, path) for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
            if (path := attribute_path(n)))

    def __call__(self, *args, **kwargs):
        if self.records is not None:   # the first call; every call in explain's session
            self._publish(args[0] if len(args) == 1 and isinstance(args[0], list) else args)
        return self.fn(*args, **kwargs)

    def _publish(self, inputs) -> None:
        """Before the call runs (a boxed call empties its input list)."""
        if self.session.place is None:
            records, self.records = self.records, None
            publish(records, self.session)
            return
        # placed already: each later call of a compiled block skips place(); up to 8 of its attribute
        # inputs tell the blocks apart (a per-step cost: a layer of 128 ModuleList experts has ~400)
        key = tuple(id(inputs[i]) for i, _ in self.attributes[::max(1, len(self.attributes) // 8)] if i < len(inputs))
        if key in self.inputs_seen:
            return
        self.inputs_seen.add(key)
        records = self.session.place(self.records, self.attributes, inputs)
        if records not in self.placed:
            self.placed.add(records)
            publish(records, self.session)

    def __getattr__(self, name):  # anything else Dynamo or Inductor read from the compiled function
        return getattr(self.__dict__["fn"], name)


def placer(model) -> "functools.partial":
    """``Session.place`` for graphs of ``model``'s modules: ``place`` with every name of each of its
    parameters and buffers (tied ones have several)."""
    names: dict = {}   # id -> every name of the tensor
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return functools.partial(place, names)


def place(names: dict, records, attributes, inputs) -> tuple[RegionRecord, ...]:
    """``records`` with module paths from the model's root, for one call of their graph (``Session.place``
    of explain and of compile_blocks, made by ``placer``).

    A graph Dynamo compiled for a nested frame (a decoder layer's forward after a graph break) names
    modules from that frame (``mlp``, or ``block.mlp`` for a local ``block``) and runs for every layer.
    Each parameter or buffer input, at ``path`` from the frame (``attributes``: (input index, path)) and
    named ``name`` in the model (``names``: every name of each tensor, tied ones included), places the
    frame's root: the common dotted tail of the two is the same attribute, and what precedes it in
    ``name`` stands for what precedes it in ``path``. An input with several names allows the prefixes of
    those with the longest common tail (its own name alone, at the top level); the root takes the first
    prefix, in the model's order, that every input of that root allows (a weight tied across layers
    allows each layer, the layer's own weights only it; a module with two names, either). A module
    under no placed root, or under one whose inputs disagree, keeps its path."""
    options: dict = {}   # the frame's root (leading parts of its paths) -> per input, the prefixes it allows
    for i, path in attributes:
        if i >= len(inputs) or id(inputs[i]) not in names:
            continue
        parts = path.split(".")
        by_tail: dict = {}
        for name in names[id(inputs[i])]:   # in the model's order
            name = name.split(".")
            tail = 0
            while tail < min(len(parts), len(name)) and parts[-1 - tail] == name[-1 - tail]:
                tail += 1
            by_tail.setdefault(tail, []).append((tuple(parts[:len(parts) - tail]), tuple(name[:len(name) - tail])))
        allowed: dict = {}
        for root, prefix in by_tail[max(by_tail)]:
            allowed.setdefault(root, []).append(prefix)
        for root, prefixes in allowed.items():
            options.setdefault(root, []).append(prefixes)
    votes: dict = {}   # root -> the first prefix (in the model's order) that every input of the root allows
    for root, allowed in options.items():
        common = set.intersection(*map(set, allowed))
        first = next((p for p in allowed[0] if p in common), None)
        if first is not None:
            votes[root] = first

    def placed_path(module: str) -> str:
        parts = tuple(module.split(".")) if module else ()
        roots = [r for r in votes if parts[:len(r)] == r]
        if not roots:
            return module
        root = max(roots, key=len)
        return ".".join(votes[root] + parts[len(root):])

    return tuple(dataclasses.replace(r, module=placed_path(r.module)) for r in records)


@contextlib.contextmanager
def recording():
    """Collect the RegionRecords of every graph compiled by the moe backend inside the block:
    a list with one list of records per graph."""
    sinks = getattr(_local, "sinks", None)
    if sinks is None:
        sinks = _local.sinks = []
    graphs: list = []
    sinks.append(graphs)
    try:
        yield graphs
    finally:
        sinks.remove(graphs)
