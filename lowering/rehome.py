"""rehome_expert_weights: give ModuleList expert weights one buffer per linear, once, at compile time.

Runs after the rewritten graph is compiled (``backend.moe_backend``): AOTAutograd fakifies the
inputs with their storage offsets at compile time, and the compiled code does not depend on them.

Before (after ``lower_moe_region``): ``grouped_mm_list(h, [W_0, ..., W_{E-1}], offs, [], transposed=True)``
where each ``W_e`` is a separately allocated nn.Linear weight [N, K]. A grouped GEMM then needs a
table of E addresses (Triton) or a stacked copy of all expert weights every step (CUTLASS).

After: the graph is unchanged, but the E parameters now live in one buffer ``B [E, N, K]``
(``W_e.data = B[e]``, same Parameter objects, same values, same shapes and strides), so the op sees
evenly spaced views of one storage and runs as one zero-copy 3-D grouped GEMM
(``ops.stack_expert_weights``). Nothing is copied per step.

Kept: Parameter identity (optimizers, hooks, state_dict and ``load_state_dict`` keep working; the
latter copies into the buffer). Skipped (recorded, never required for correctness): tensors that are
not plain leaf Parameters of one dtype/device/shape, non-contiguous or already evenly spaced ones.
A later ``model.to(...)`` allocates new storages: the op then reads the weights in place again.

Never for weights whose storage is not theirs alone (``_shared_storage``: ZeroRedundancyOptimizer's
bucket views, experts tied through ``.data``, a user's alias): those ties would be cut.

Never for weights a rewritten region reads inside a ``torch.compiler.nested_compile_region`` function that
Dynamo inlined (``nested_region_note``): the next trace of that function as a subgraph would refuse them.

Never under FSDP2 (``fully_shard``): the parameters a compiled graph reads are FSDP's unsharded
parameters, whose storage FSDP refills on every all-gather; moving their ``.data`` would leave the
experts computing with the weights of the step that compiled (``fsdp_in_use``; the graph then reads
the per-expert weights in place, as without re-homing).
"""
from __future__ import annotations

import weakref

import torch
import torch.fx as fx

from moe_compile.kernels.layout import even_step
from moe_compile.passes.normalize import arg, canon


def cast_dtype(n: fx.Node):
    """The dtype of a ``w.to(dtype)`` node (the lowering's cast of a weight under torch.autocast), else None."""
    if canon(n) == "to" and isinstance(n.args[0], fx.Node) and len(n.args) == 2 and isinstance(n.args[1], torch.dtype) \
            and not n.kwargs:
        return n.args[1]
    return None


def uncast(n: fx.Node) -> fx.Node:
    """The weight under such a cast (the node itself if it is none)."""
    return n.args[0] if cast_dtype(n) is not None else n


def _placeholder_of(n: fx.Node) -> fx.Node | None:
    n = uncast(n)
    if n.op == "placeholder":
        return n
    if canon(n) in ("t", "transpose") and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder":
        return n.args[0]
    return None


def _nk_use(node: fx.Node) -> bool:
    """The op uses nn.Linear weights [N, K] as W.T: passed as they are with ``transposed=True``,
    or as ``W.t()`` views (either one cast under autocast)."""
    ws = [uncast(w) for w in (*node.args[1], *node.args[2])]
    if arg(node, 4, "transposed", False):
        return all(w.op == "placeholder" for w in ws)
    return all(canon(w) == "t" for w in ws)


def _params(node_list, index, example_inputs) -> list[torch.Tensor] | None:
    phs = [_placeholder_of(w) for w in node_list]
    if any(p is None or p not in index or index[p] >= len(example_inputs) for p in phs):
        return None
    params = [example_inputs[index[p]] for p in phs]
    return params if plain_group(params) and len(params) > 1 else None


def plain_group(params) -> bool:
    """Plain contiguous nn.Parameters of one shape, dtype and device: a group ``_rehome`` can put side by side."""
    first = params[0]
    return all(isinstance(p, torch.nn.Parameter) and type(p.data) is torch.Tensor and p.is_contiguous()
               and p.shape == first.shape and p.dtype == first.dtype and p.device == first.device for p in params)


def _shared_storage(params) -> bool:
    """Some weight's storage is not its own alone: a view into a larger buffer (ZeroRedundancyOptimizer's
    bucket views, a user's flat buffer), a storage other tensors hold too (two experts tied through
    ``.data``, a ``p.detach()`` alias the user updates in place) or one in shared memory (other
    processes update it: ``model.share_memory()``). Moving ``.data`` would cut those ties:
    the other holders would stop being the weight (wrong values from the next update on)."""
    for p in params:
        storage = p.untyped_storage()
        if p.storage_offset() != 0 or storage.nbytes() != p.numel() * p.element_size():
            return True
        if storage.device.type == "cpu" and storage.is_shared():   # shared memory (model.share_memory():
            return True                                            # Hogwild workers update it in place;
                                                                   # is_shared() is always True on CUDA)
        # the Parameter and the ``storage`` object above hold it: any more is another tensor on it
        if torch._C._storage_Use_Count(storage._cdata) > 2:
            return True
    return False


def held_only_by(params) -> bool:
    """Every storage of ``params`` is held by them alone, each Parameter once, at disjoint places, none in shared
    memory: a layout a compile made (``_rehome``) some of whose weights were replaced since (an expert module or
    Parameter swapped, a ``.data`` assigned: review helper-85). ``_shared_storage`` calls that shared; moving
    them cuts no tie (no other tensor holds those storages), where keeping them apart stacked a copy per step."""
    storages: dict = {}
    for p in params:
        storage = p.untyped_storage()
        if not p.is_contiguous() or storage.data_ptr() == 0 or storage.device.type == "cpu" and storage.is_shared():
            return False
        storages.setdefault(storage.data_ptr(), (storage, []))[1].append(p)
        del storage   # one Python storage object per storage alive while counting: the one kept above
    for storage, held in storages.values():
        if len({id(p) for p in held}) != len(held) or torch._C._storage_Use_Count(storage._cdata) != len(held) + 1:
            return False   # one Parameter twice (tied experts), or another tensor holds the storage too
        spans = sorted((p.storage_offset(), p.storage_offset() + p.numel()) for p in held)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return False   # two Parameters on the same elements: a tie
    return True


def _rehome(groups: list[list[torch.Tensor]]) -> str:
    """Move E experts' weights of each group side by side into one [E, sum(N_g), K] buffer:
    expert e's weight of group g becomes rows [off_g, off_g + N_g) of buf[e]."""
    first = groups[0][0]
    rows = [g[0].shape[0] for g in groups]
    with torch.no_grad():
        buf = torch.empty((len(groups[0]), sum(rows), *first.shape[1:]), dtype=first.dtype, device=first.device)
        for e in range(len(groups[0])):
            off = 0
            for g, n in zip(groups, rows):
                buf[e, off:off + n].copy_(g[e])
                off += n
        for e in range(len(groups[0])):
            off = 0
            for g, n in zip(groups, rows):
                g[e].data = buf[e, off:off + n]
                off += n
    return f"re-homed {len(groups)} x {len(groups[0])} expert weights {tuple(first.shape)} into one buffer"


NESTED_REGION_NOTE = "expert weights not re-homed: the layer runs in"


def nested_region_note(gm: fx.GraphModule) -> str | None:
    """Why ``gm``'s ModuleList expert weights must stay where they are, else None: a rewritten region reading
    them runs in a ``torch.compiler.nested_compile_region`` function that Dynamo inlined into this graph. Dynamo
    traces such a function as an ``invoke_subgraph`` again on its next compile (another input shape, explain()),
    and refuses subgraph inputs that share storage (UncapturedHigherOrderOpError): re-homed weights would."""
    from moe_compile.passes.moe_source import compile_region_frame

    lists = [n for n in gm.graph.nodes if (canon(n) or "").startswith("moe_compile::grouped_mm_list")]
    frame = compile_region_frame(lists) if lists else None
    if frame is None:
        return None
    return (f"{NESTED_REGION_NOTE} `{frame.name}` ({frame.at}), a torch.compiler.nested_compile_region function, "
            "whose subgraph may not take inputs that share storage (the grouped GEMMs read the per-expert weights "
            "in place)")


def fsdp_in_use() -> bool:
    """Some module of this process is ``fully_shard``-ed (FSDP2): parameters may be FSDP's."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # a torch without FSDP2: nothing manages the parameters
        return False
    for state in list(_module_state_mapping.values()):
        if isinstance(state, weakref.ref):  # torch keeps the states by weak reference
            state = state()
        if isinstance(state, FSDPState):
            return True
    return False


def rehome_expert_weights(gm: fx.GraphModule, example_inputs) -> list[str]:
    """Re-home the per-expert weights of every grouped_mm_list (one buffer per linear) and
    grouped_mm_list_cat (one buffer for both linears, side by side) in gm; returns report notes."""
    fsdp = fsdp_in_use()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    notes = []
    for node in gm.graph.nodes:
        op = getattr(node.target, "_opname", "") if node.op == "call_function" else ""
        if op == "grouped_mm_list":
            groups = [_params(node.args[1], index, example_inputs)]
        elif op == "grouped_mm_list_cat":
            groups = [_params(node.args[1], index, example_inputs), _params(node.args[2], index, example_inputs)]
            if None not in groups and (groups[0][0].shape[1:] != groups[1][0].shape[1:]
                                       or groups[0][0].dtype != groups[1][0].dtype or not _nk_use(node)):
                continue  # side by side only works for nn.Linear weights [N, K] used as W.t()
        else:
            continue
        if None in groups or even_step([w for g in zip(*groups) for w in g]):
            continue  # unusable, or already side by side in one buffer
        if fsdp:
            notes.append("expert weights not re-homed: FSDP2 owns the storage of the parameters it gathers "
                         "(the grouped GEMMs read the per-expert weights in place)")
            continue
        if _shared_storage([w for g in groups for w in g]):
            notes.append("expert weights not re-homed: a weight shares its storage (a view into a larger buffer, "
                         "weights tied through .data, or another tensor on it); the grouped GEMMs read them in place")
            continue
        notes.append(_rehome(groups))
    return notes
