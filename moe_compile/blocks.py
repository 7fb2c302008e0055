"""Per-block compilation: compile time that does not grow with depth.

``torch.compile(model, backend="moe")`` traces the whole model as one frame: Dynamo inlines every
decoder layer, so tracing, the backend's passes and Inductor all grow with the number of layers
(48 layers of a small model: ~20x the compile time of one). Compiling each repeated block on its
own instead lets Dynamo trace ONE block: every other block of the same class runs the same
compiled code (its guards check the other block's parameters by type, shape and stride, not by
identity), so a 48-layer model compiles about as fast as a 1-layer one::

    moe_compile.compile_blocks(model)            # each decoder layer: block.compile(backend="moe"),
                                                 # and model.loss_function (Hugging Face models)
    loss = model(input_ids=ids, labels=ids).loss # embeddings, final norm and LM head run eagerly
    loss.backward()

Every MoE layer is still rewritten (each block's graph holds its router and its experts), and the
outputs and gradients are those of eager (tests/test_blocks.py). What differs from a whole-model
compile: the code between blocks (embedding, final norm, LM head) runs eagerly, and blocks
whose code or static attributes differ (e.g. GPT-OSS's sliding / full attention layers) compile
once per kind.

The loss: a Hugging Face causal LM computes it in ``model.loss_function`` (the logits cast to fp32,
then cross-entropy over the whole vocabulary). Eagerly that writes and reads fp32 copies of the
logits, [tokens, vocab] (5 GB for 8192 tokens of Qwen3's 151,936-token vocabulary), in five or six
memory-bound kernels; compiled (``loss=True``, the default) it is a few fused reductions over the
bf16 logits. Same function, same values (tests/test_blocks.py); models without a settable
``loss_function`` are left as they are.

``torch.compiler.nested_compile_region`` (one whole-model graph whose blocks are one shared
subgraph) is NOT a way to get this with ``backend="moe"``: the block becomes an ``invoke_subgraph``
higher-order op whose body the backend's passes do not enter, so no MoE layer is rewritten (each
such subgraph holding an MoE layer is refused with code ``nested_region``, warned once; a region Dynamo
inlines instead is rewritten, lowering/rehome.nested_region_note).

ModuleList experts: after compiling a graph the backend re-homes the expert weights it read into
one buffer per linear (``lowering/rehome.py``), but only for the parameters that graph was
compiled with, i.e. the first block's. ``compile_blocks`` gives every other block of the same
class the same layout, once, at the start of the model's second call (the first compiles):
same Parameter objects, values, shapes and strides (``p.data`` moves, as the backend does). The
compiled graph reads each buffer as one stacked input (``lowering/expert_stack.py``), and lays out
the other blocks' weights the first time it runs with them (``expert_inputs._Feed._lay_out``: a
per-layer ``layer.compile(backend="moe")`` gets that too); every block's stack is then a view of its
own buffer.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Iterable

import torch
import torch.nn as nn

from .hf_recorders import REASON, UNDER_BLOCKS, recorder_hooks, refusal

__all__ = ["compile_blocks", "find_blocks"]

log = logging.getLogger(__name__)


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclasses.dataclass(frozen=True)
class BlocksCompile:
    """What one ``compile_blocks`` call did to a model, for explain(): the blocks it compiled, the backend's
    name ("moe" or another backend's), the compile's ``options`` and ``dynamic``."""
    names: tuple[str, ...]
    backend: str
    options: dict
    dynamic: bool | None = None
    session: object = dataclasses.field(default=None, compare=False)   # the moe backend's records.Session


# model -> its compile_blocks call (explain() says what ran eagerly and follows the call's options)
_COMPILED: "weakref.WeakKeyDictionary[nn.Module, BlocksCompile]" = weakref.WeakKeyDictionary()


def compiled_blocks(model) -> BlocksCompile | None:
    return _COMPILED.get(model) if isinstance(model, nn.Module) else None


def _items(container: nn.Module) -> list[nn.Module]:
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: the items of the ``nn.ModuleList``, ``nn.ModuleDict``
    (torchtitan) or ``nn.Sequential`` of modules (Sequential blocks too; not of ModuleLists or
    ModuleDicts: nanoGPT's ``transformer`` dict) that holds the most parameters,
    among equals the outermost (e.g. ``model.model.layers`` of a Hugging Face causal LM, not the
    experts inside each layer); its items may be of several classes (dense and MoE layers).
    Where that container lies inside a module whose class repeats (decoder layers kept as plain
    attributes, an encoder and a decoder stack of one class), the blocks are the instances of that
    class (not one layer's experts); warns where other ``ModuleList``s / ``ModuleDict``s lie outside
    the blocks (they run eagerly)."""
    best, best_name, best_size = None, "", -1
    mods = dict(model.named_modules())
    for name, module in mods.items():
        if isinstance(module, _CONTAINERS) and len(module) and not any(
                isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in _items(module)):   # Sequential items: blocks
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_name, best_size = module, name, size
    if best is None:
        raise ValueError(f"compile_blocks: {type(model).__name__} has no nn.ModuleList (ModuleDict, Sequential) of blocks; "
                         "pass blocks=[...] (the modules to compile one by one)")
    parts = best_name.split(".")
    for i in range(1, len(parts)):
        owner = mods[".".join(parts[:i])]
        if isinstance(owner, _CONTAINERS):
            continue
        twins = [(n, m) for n, m in mods.items() if type(m) is type(owner)]
        if len(twins) > 1:   # the container sits in a module whose class repeats (layers kept as plain
            blocks, taken = [], set()   # attributes, an encoder and a decoder stack): those are the blocks
            for n, m in twins:
                if not any(n.startswith(t + ".") for t in taken):
                    blocks.append(m)
                    taken.add(n)
            log.info("compile_blocks: '%s' lies inside %s, whose class repeats: compiling each %s (%d)",
                     best_name, ".".join(parts[:i]), type(owner).__name__, len(blocks))
            return blocks
    blocks = _items(best)
    if isinstance(best, nn.Sequential):   # nn.Sequential(embedding, *layers, head): the layers, not torch.nn's own
        blocks = [m for m in blocks if not type(m).__module__.startswith("torch.nn.")] or blocks
    router = _router_of(model, blocks)
    if router:
        raise ValueError(
            f"compile_blocks: the items of '{best_name or '<model>'}' look like the experts of an MoE layer ("
            f"'{router}' outside them has one output per item): compiled one by one, the router and the routing "
            f"would run eagerly and nothing would be rewritten; compile the layer whole with "
            f"torch.compile(model, backend=\"moe\"), or pass blocks=[...]")
    inside = {id(m) for b in blocks for m in b.modules()} | {id(best)}
    outside = [n for n, m in mods.items() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) > 1
               and id(m) not in inside and not any(c is best for c in m.modules())]   # nor around best
    if outside:
        log.warning("compile_blocks: compiling the items of '%s'; %s lie outside them and run eagerly (any MoE "
                    "layer there is not rewritten): pass every block, compile_blocks(model, blocks=[...])",
                    best_name or "<model>", ", ".join(outside[:4]))
    return blocks


def _router_of(model: nn.Module, blocks: list[nn.Module]) -> str:
    """The name of a weight outside ``blocks`` with one row (column) per block, as a router over experts
    has (nn.Linear(H, E), or a raw [E, H] / [H, E] Parameter); "" where there is none."""
    inside = {id(p) for b in blocks for p in b.parameters()}
    n = len(blocks)
    for name, p in model.named_parameters():
        if id(p) not in inside and p.dim() == 2 and n in p.shape and n > 1:
            return name
    return ""


def _check_blocks(model: nn.Module, blocks: list) -> None:
    subs = {id(m) for m in model.modules()}
    for b in blocks:
        if not isinstance(b, nn.Module):
            raise TypeError(f"compile_blocks: blocks must be modules of the model (or a dotted path to a ModuleList, "
                            f"ModuleDict or Sequential in it), got a {type(b).__name__}")
        if id(b) not in subs:
            raise ValueError(f"compile_blocks: block {type(b).__name__} is not a submodule of the model: compiling "
                             f"it would not change how the model runs; pass the model's own modules")


def compile_blocks(model: nn.Module, backend="moe", *, blocks: Iterable[nn.Module] | str | None = None,
                   loss: bool = True, **compile_kwargs) -> list[nn.Module]:
    """Compile each block of ``model`` separately with ``block.compile(backend=backend, **compile_kwargs)``
    (``torch.compile``'s arguments: ``options``, ``mode``, ``fullgraph``, ``dynamic``), in place.

    ``blocks``: the modules to compile; a dotted path inside ``model`` ("model.layers", a ModuleList,
    ModuleDict or Sequential); default ``find_blocks(model)``: pass them where the decoder layers are
    not the items of one container. MoE layers outside every block run eagerly: ``explain(model, x)``
    traces a whole-model compile, and for a model compiled here notes so and names such layers. ``loss``: also compile ``model.loss_function`` where the model has a
    settable one (Hugging Face models with a head), with the same backend and arguments but
    ``dynamic`` (``compile_loss``). Returns the compiled blocks. Call ``model(...)`` as before: it
    stays an eager module that calls compiled blocks. With FSDP2 (and expert parallelism), call it
    after ``fully_shard`` on the blocks and the root, as examples/train.py does: Dynamo does not
    trace FSDP's hooks, they run eagerly around each block's compiled code. With CUDA graphs
    (``mode="reduce-overhead"``, or ``options={"triton.cudagraphs": True}``) call
    ``torch.compiler.cudagraph_mark_step_begin()`` at the start of each training step, as for any
    model whose modules are CUDA-graphed one by one: otherwise CUDA graph trees cannot tell steps
    apart and torch raises "accessing tensor output of CUDAGraphs that has been overwritten"."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_blocks: expected an nn.Module (e.g. a Hugging Face model), got "
                        f"{type(model).__name__}; for a function use torch.compile(fn, backend=\"moe\")")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):   # its whole-model compile would run instead
        raise TypeError("compile_blocks: the model is already a torch.compile wrapper, whose whole-model compile "
                        "runs instead of the blocks; pass the uncompiled model (model._orig_mod)")
    if not isinstance(loss, bool):
        raise TypeError(f"compile_blocks: loss must be True or False, got {loss!r}")
    if isinstance(blocks, str):
        try:
            container = model.get_submodule(blocks)
        except AttributeError:
            found = [n for n, m in model.named_modules() if isinstance(m, _CONTAINERS) and n]
            raise ValueError(f"compile_blocks: the model has no submodule '{blocks}'; its containers: "
                             f"{found[:8]}{' ...' if len(found) > 8 else ''}") from None
        if not isinstance(container, _CONTAINERS):
            raise TypeError(f"compile_blocks: blocks='{blocks}' is {type(container).__name__}, not a ModuleList, "
                            f"ModuleDict or Sequential; pass the path of the container of the blocks, or "
                            f"blocks=[...] (modules)")
        blocks = _items(container)
    if isinstance(blocks, nn.Module) and not isinstance(blocks, _CONTAINERS):
        blocks = [blocks]
    if blocks is not None and not isinstance(blocks, Iterable):
        raise TypeError(f"compile_blocks: blocks must be a dotted path, a module or an iterable of modules, got "
                        f"{type(blocks).__name__}")
    blocks = find_blocks(model) if blocks is None else list(blocks)
    if not blocks:
        raise ValueError("compile_blocks: no blocks to compile")
    _check_blocks(model, blocks)
    names = {id(m): n for n, m in model.named_modules()}
    shared = _BlocksBackend(model) if _is_moe(backend) else backend
    for block in blocks:
        block.compile(backend=shared, **compile_kwargs)
    _COMPILED[model] = BlocksCompile(tuple(names[id(b)] for b in blocks if id(b) in names),
                                     "moe" if _is_moe(backend) else _backend_name(backend),
                                     dict(compile_kwargs.get("options") or {}), compile_kwargs.get("dynamic"),
                                     getattr(shared, "session", None))
    if loss:
        compile_loss(model, backend, **compile_kwargs)
    by_class: dict[type, list[nn.Module]] = {}
    for block in blocks:
        by_class.setdefault(type(block), []).append(block)
    groups = [g for g in by_class.values() if len(g) > 1]
    if groups:
        _MirrorOnce(model, groups)
    if isinstance(shared, _BlocksBackend):
        from .blocks_verdict import NothingAfterModelCall

        NothingAfterModelCall(model, shared.session, blocks, _COMPILED[model].names)
    return blocks


def _backend_name(backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


def _is_moe(backend) -> bool:
    from .backend import moe_backend

    return isinstance(backend, str) and backend == "moe" or backend is moe_backend


class _BlocksBackend:
    """The moe backend of one ``compile_blocks`` call: one ``records.Session`` for all its blocks, whose
    records are placed at module paths from the model's root (``layers.2.mlp``), as explain places a
    nested frame's. Each ``block.compile`` would otherwise report to a session of its own, while a graph
    one block compiled serves every block of its class: a refused region was warned once per session
    that compiled a graph (twice for four blocks where block 1 recompiles: its input requires grad),
    named from the block's frame (``mlp``). Now: once per block, with its path, and the
    nothing-rewritten warning once per model. Pickled or deep-copied it is ``moe_backend``."""

    def __init__(self, model: nn.Module):
        from .records import Session, placer

        self.session = Session()
        self.session.place = placer(model)
        self.session.blocks = True
        self.model = weakref.ref(model)

    def __call__(self, gm, example_inputs, mode=None, options=None):
        from .backend import moe_backend

        self._warn_recorders()
        return moe_backend(gm, example_inputs, mode=mode, options=options)

    def _warn_recorders(self) -> None:
        """Once per compile_blocks call: transformers' output recorders on the blocks (``output_router_logits``)
        break every block's graph between its router and its experts (``hf_recorders``): say so, with the fix,
        where the refusals themselves only say the expert ids came from another graph."""
        model = self.model()
        if ("recorders",) in self.session.warned or model is None:
            return
        found = recorder_hooks(model)
        if found:
            reason, fix = refusal(found, UNDER_BLOCKS, module="the MoE layers", cls=type(model).__name__,
                                  what="compile_blocks")
            self.session.warn_once(("recorders",), f"moe_compile: refused [{REASON}] {reason}\n    fix: {fix}")

    def moe_capture_ctx(self, options=None, mode=None):
        """The capture scope of every block (``backend._install_ctx_shim`` forwards it), with the shared session."""
        from .backend import capture_ctx

        return capture_ctx(options, mode, session=self.session)

    def __reduce__(self):
        return _moe_backend, ()


def _moe_backend():
    from .backend import moe_backend

    return moe_backend


def explain_regions(model, regions: tuple) -> tuple:
    """For ``explain()`` of a ``compile_blocks`` model: its whole-model trace sets transformers' recorder inside
    the trace, where the blocks' compiles break on it (``hf_recorders``): a region rewritten there, in a block
    that carries a recorder, is refused in the compile that runs."""
    call = compiled_blocks(model)
    if call is None or call.backend != "moe":
        return regions
    hooked = {name: found for name in call.names if (found := recorder_hooks(model.get_submodule(name), name))}
    if not hooked:
        return regions
    out = []
    for r in regions:
        block = next((n for n in hooked if r.module == n or r.module.startswith(f"{n}.")), None)
        if r.status == "rewritten" and block is not None:
            reason, fix = refusal(hooked[block], UNDER_BLOCKS, module=r.module, cls=r.form,
                                  what=f"top-{r.top_k} over {r.num_experts} experts")
            r = dataclasses.replace(r, status="refused", ops=(), code=REASON, reason=reason, fix=fix)
        out.append(r)
    return tuple(out)


def explain_notes(model, regions) -> tuple[str, ...]:
    """For ``explain()``: it traces ``model`` as one whole-model compile. Where ``compile_blocks``
    compiled the model, say so, and name the regions outside every compiled block: those run eagerly
    (not rewritten) however explain's trace reports them."""
    call = compiled_blocks(model)
    if call is None:
        return ()
    names = call.names
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    if call.backend != "moe":
        return (f"this model was compiled with compile_blocks ({len(names)} block(s): {shown}) and "
                f"backend={call.backend!r}, which rewrites no MoE region: the report shows what compile_blocks(model) "
                "(backend=\"moe\") would do",)
    out = [f"this model was compiled with compile_blocks ({len(names)} block(s): {shown}); explain traced a "
           "whole-model compile with that call's options: regions inside those blocks are rewritten as listed, the "
           "code between them runs eagerly"]
    eager = sorted({r.module or "<top>" for r in regions if r.status == "rewritten"
                    and not any(r.module == n or r.module.startswith(f"{n}.") for n in names)})
    if eager:
        out.append(f"{', '.join(eager)}: outside every block compile_blocks compiled, so it runs eagerly there "
                   "(NOT rewritten); pass the blocks holding it: compile_blocks(model, blocks=[...])")
    return tuple(out)


def compile_loss(model: nn.Module, backend="moe", **compile_kwargs) -> bool:
    """Replace ``model.loss_function`` (a property with a setter on Hugging Face's PreTrainedModel)
    by a compiled one (``_CompiledLoss``); False where there is none to set (a model without a head:
    no ``loss_type``), it is a module, or it is compiled already. ``dynamic`` is not passed on: the
    loss keeps torch.compile's default (static, then dynamic once a size or an int argument such as
    ``num_items_in_batch`` changes), whatever the blocks use. With the moe backend the loss graph
    holds no MoE region by construction: it reports to a quiet session (no nothing-rewritten
    warning) and goes to Inductor as any such graph does."""
    from .backend import moe_backend

    prop = getattr(type(model), "loss_function", None)
    if not isinstance(prop, property) or prop.fset is None:
        return False
    if "_loss_function" not in vars(model) and getattr(model, "loss_type", None) is None:
        return False   # a base model: reading the property would warn and return a loss it never computes
    fn = model.loss_function
    if not callable(fn) or isinstance(fn, (nn.Module, _CompiledLoss)):
        return False
    compile_kwargs.pop("dynamic", None)
    if backend == "moe" or backend is moe_backend:
        from .autograd import quiet_backend

        backend = quiet_backend()
    model.loss_function = _CompiledLoss(fn, torch.compile(fn, backend=backend, **compile_kwargs))
    return True


def _eager_loss(fn):
    return fn


class _CompiledLoss:
    """``model.loss_function`` compiled. Pickled or deep-copied it is the eager function again (a
    compiled function does not pickle; ``save_pretrained`` keeps no loss function either), so
    ``torch.save(model)`` works and a copy can be compiled anew."""

    __slots__ = ("eager", "compiled")

    def __init__(self, eager, compiled):
        self.eager, self.compiled = eager, compiled

    def __call__(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)

    def __reduce__(self):
        return _eager_loss, (self.eager,)


class _MirrorOnce:
    """A forward pre-hook on the (eager) root: on the model's second call, give every block the
    parameter layout the backend gave a block of its class while compiling it (the first one it
    re-homed: not a dense one), outside inference mode even under it (new storage made in it would
    make the Parameters inference tensors, which cannot train); then it removes itself. Runs outside
    every compiled frame (Dynamo never sees it)."""

    def __init__(self, model: nn.Module, groups: list[list[nn.Module]]):
        self.groups, self.calls = groups, 0
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if torch.compiler.is_compiling():   # traced with the root (explain(), a whole-model compile): not a call
            return None
        self.calls += 1
        if self.calls < 2:  # the first call compiles (and re-homes) the first block of each class
            return None
        self.handle.remove()
        moved = 0
        # outside inference mode: new storage made in it would make the Parameters inference tensors
        with torch.inference_mode(False), torch.no_grad():
            for group in self.groups:
                # the blocks the backend re-homed (compiled with MoE in them), not a dense first one
                srcs = [b for b in group if _shared_storage_groups(b)]
                for other in group:
                    for src in srcs:
                        if other is not src and (n := mirror_layout(src, other)):
                            moved += n
                            break
        if moved:
            log.debug("compile_blocks: gave %d parameters the first block's one-buffer layout", moved)
        return None


def _shared_storage_groups(block: nn.Module) -> list[list[tuple[str, torch.Tensor]]]:
    """Parameters of ``block`` that live in one storage with others (a re-homed buffer), grouped."""
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, p in block.named_parameters():
        if type(p.data) is torch.Tensor and p.device.type != "meta":
            by_storage.setdefault(p.untyped_storage().data_ptr(), []).append((name, p))
    return [g for g in by_storage.values() if len(g) > 1]


def mirror_layout(src: nn.Module, dst: nn.Module) -> int:
    """Move the parameters of ``dst`` that correspond (by name) to parameters of ``src`` sharing one
    storage into one new storage with the same layout (offsets, shapes, strides); values and
    Parameter objects are kept. Skips a group unless every counterpart is a plain Parameter of the
    same shape, stride, dtype and device, in a storage of its own alone (``rehome._shared_storage``:
    no alias such as ``p.detach()``, no view into a larger buffer, not in shared memory; moving it would
    cut those ties, as the backend's own re-homing never does). Returns how many moved."""
    from moe_compile.lowering.rehome import _shared_storage

    dst_params = dict(dst.named_parameters())
    moved = 0
    for group in _shared_storage_groups(src):
        if not _disjoint([p for _, p in group]):
            continue  # the user's tie (``w_b.data = w_a.data``), not a layout: copying it would tie dst's too
        pairs = [(p, dst_params.get(name)) for name, p in group]
        if not all(isinstance(q, nn.Parameter) and type(q.data) is torch.Tensor and q.shape == p.shape
                   and q.stride() == p.stride() and q.dtype == p.dtype and q.device == p.device
                   for p, q in pairs):
            continue
        if len({q.untyped_storage().data_ptr() for _, q in pairs}) != len(pairs) \
                or _shared_storage([q for _, q in pairs]):
            continue  # already sharing storage, or held by another tensor or process: leave it
        first = pairs[0][0]
        numel = first.untyped_storage().nbytes() // first.element_size()
        with torch.no_grad():
            flat = torch.empty(numel, dtype=first.dtype, device=first.device)
            for p, q in pairs:
                view = flat.as_strided(p.shape, p.stride(), p.storage_offset())
                view.copy_(q)
                q.data = view
        moved += len(pairs)
    return moved


def _disjoint(params: list[torch.Tensor]) -> bool:
    """No two of ``params`` (views of one storage) reach a common element: their element ranges, from
    the storage offset to the last element a stride reaches, do not overlap."""
    spans = sorted((p.storage_offset(), p.storage_offset() + sum((n - 1) * st for n, st in zip(p.shape, p.stride())))
                   for p in params if p.numel())
    return all(end < start for (_, end), (start, _) in zip(spans, spans[1:]))
