"""Expert parallelism composed with FSDP2 (the experts sharded by ``parallelize_experts``,
moe_compile/parallel.py; re-exported there): ``fully_shard_experts`` (an FSDP unit over the ranks
holding the same experts, or the experts kept out of FSDP at dp = 1), ``replicate_experts`` (kept
whole on those ranks), ``fsdp_ignored_params`` (what the dense ``fully_shard`` calls leave alone) and
``check_fsdp_composition`` (the compile-time check of what FSDP holds)."""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from moe_compile.ep_info import _ROOTS, EPInfo, _ep_containers, _global_view, _local_params, _viewed


def _check_args(op: str, model, mesh) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{op}: expected the model (an nn.Module) first, got {type(model).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{op}: expected a DeviceMesh of the ranks that hold the same experts (e.g. "
                        f"mesh[\"dp\"] of init_device_mesh(..., mesh_dim_names=(\"dp\", \"ep\"))), got "
                        f"{type(mesh).__name__}")


def _check_same_experts(where: str, group, info) -> None:
    """The ranks of ``group`` must hold the same experts: none two of them in the container's ep group."""
    import torch.distributed as dist

    from moe_compile.kernels.ep_transport import resolve_group

    ep_ranks = dist.get_process_group_ranks(resolve_group(info.group_name))
    shared = set(dist.get_process_group_ranks(group)) & set(ep_ranks)
    if len(shared) > 1:
        raise ValueError(f"{where}: the ranks of the given mesh {sorted(dist.get_process_group_ranks(group))} "
                         f"hold different experts (ranks {sorted(shared)} are in its expert-parallel group); "
                         f"give {where.split(':')[0]} the ranks holding the SAME experts, the dp dimension "
                         "orthogonal to 'ep' (mesh['dp'])")


def fully_shard_experts(model: nn.Module, mesh: DeviceMesh, **fsdp_kwargs) -> list[nn.Module]:
    """Compose expert parallelism with FSDP2, for every expert container of ``model`` (after
    ``parallelize_experts``). ``mesh`` holds the ranks that hold the SAME experts: the data-parallel
    dimension orthogonal to "ep" (torchtitan's dp_mod_ep), of size 1 when ep spans every rank.
    Call it before ``fully_shard`` on the blocks and the root, and give those calls
    ``ignored_params=moe_compile.fsdp_ignored_params(...)``::

        mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))
        flat = mesh._flatten()                                # every rank
        moe_compile.parallelize_experts(model, mesh["ep"])
        moe_compile.fully_shard_experts(model, mesh["dp"])
        for block in model.layers:                            # dense parameters over every rank
            fully_shard(block, mesh=flat, ignored_params=moe_compile.fsdp_ignored_params(block))
        fully_shard(model, mesh=flat, ignored_params=moe_compile.fsdp_ignored_params(model))
        optimizer = torch.optim.AdamW(model.parameters())     # after: the Parameters were replaced

    ``mesh`` must have one rank (ep spans every rank) and ``fsdp_kwargs`` no ``mp_policy`` /
    ``offload_policy``: the experts then stay out of FSDP (an FSDP unit would shard nothing and only
    cost: a copy of every expert weight per step, 7-19% of a whole-model step on 2-4 H200,
    docs/benchmarks.md); ``fsdp_ignored_params`` returns them, for the blocks' and root's
    ``fully_shard`` to leave alone. Anything else would make each container an FSDP unit, and FSDP2
    runs a unit's hooks outside Dynamo (torch 2.11 and 2.13): a graph break at the container's call
    leaves the router in one graph and the experts in another, which the expert-parallel rewrite
    cannot take, so that raises here with the alternatives (``replicate_experts`` over dp > 1,
    ``torch.autocast`` for mixed precision).

    Each rank's expert gradient already sums the tokens of every ep rank (the dispatch's backward);
    ``_DivideGrad`` in the traced graph divides it by ep * dp, FSDP's divide factor: expert and
    dense gradients are both means over the global batch. Forgetting ``ignored_params`` (or a
    root ``fully_shard`` without this call) would shard each rank's different experts across the
    ep ranks: the backend refuses to compile that and names the fix (``check_fsdp_composition``)."""
    _check_args("fully_shard_experts", model, mesh)
    import inspect

    from torch.distributed.fsdp import fully_shard
    known = set(inspect.signature(fully_shard).parameters) - {"module", "mesh"}
    if set(fsdp_kwargs) - known:   # accepted and dropped before (review helper-114): a misspelt keyword did nothing
        raise TypeError(f"fully_shard_experts: unknown keyword argument(s) {sorted(set(fsdp_kwargs) - known)}; "
                        f"fully_shard takes {sorted(known)} (with dp = 1 no FSDP unit is built, so they have no effect)")
    policies = [k for k in ("mp_policy", "offload_policy") if fsdp_kwargs.get(k) is not None]
    if mesh.size() > 1:   # the ep mesh given (review helper-114): say so first, as replicate_experts does
        for path, _, info, _ in _ep_containers(model):
            _check_same_experts(f"fully_shard_experts: '{path or type(model).__name__}'", mesh.get_group(), info)
    if mesh.size() > 1 or policies:
        why = f"a mesh of {mesh.size()} ranks" if mesh.size() > 1 else f"{' and '.join(policies)}"
        raise ValueError(
            f"fully_shard_experts: {why} would make each expert container an FSDP unit; FSDP2 runs a unit's hooks "
            "outside Dynamo, a graph break between the router and the experts that the expert-parallel rewrite "
            "cannot take (the sharded experts would not run). Fix: over dp > 1 ranks holding the same experts, "
            "call moe_compile.replicate_experts(model, mesh['dp']) instead (the experts whole on those ranks, "
            "their gradients all-reduced in the compiled backward; expert memory not divided over dp), or run ep "
            "over every rank (dp = 1); for mixed precision keep the experts' dtype and use torch.autocast")
    done = []
    for _, module, info, _ in _ep_containers(model):
        module._moe_dp_group = None   # a repeated call keeps the form fsdp_ignored_params gave the Parameters
        _keep_local(module, float(info.ep), view=_viewed(module, info.names[0]))
        done.append(module)
    if not done:
        raise ValueError("fully_shard_experts: no expert container sharded by parallelize_experts in "
                         f"{type(model).__name__}; call parallelize_experts(model, ep_mesh) first")
    return done


def replicate_experts(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Compose expert parallelism with FSDP2 by keeping each rank's experts whole on every rank of
    ``mesh`` (the dp ranks that hold the same experts, as for ``fully_shard_experts``) instead of
    sharding them over it: no FSDP unit on the experts, so no FSDP hooks that break the compiled
    graph (``fully_shard_experts`` raises over dp > 1 for that reason), also inside activation
    checkpointing, and nothing is copied per step. What it costs: the experts and their optimizer state
    are not divided over dp (memory ~ E / ep experts per rank, as at dp = 1). Use it in place of
    ``fully_shard_experts``, before ``fully_shard`` on the blocks and the root, whose calls get
    ``ignored_params=moe_compile.fsdp_ignored_params(...)``, as in ``fully_shard_experts``' recipe.

    Gradients: summed over the ep ranks by the dispatch's backward, over ``mesh`` by an all-reduce in
    the traced backward (``_ReduceGrad``: a functional collective the compiler schedules), divided by
    ep * dp: the mean over the global batch, as FSDP's and DDP's. Under DistributedDataParallel (over
    every rank) call it before ``DDP(model)``: it adds the experts to the ignore list DDP reads from
    ``model`` (moe_compile/ep_ddp.py has the recipe). The replicas start equal: the rows of ``mesh``'s
    first rank are broadcast to the others here (not for a model on the meta device: load the same
    checkpoint on every rank after ``to_empty``), and equal gradients keep them equal."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from moe_compile.ep_ddp import ignore_in_ddp

    _check_args("replicate_experts", model, mesh)
    done = []
    group = mesh.get_group() if mesh.size() > 1 else None
    for path, module, info, _ in _ep_containers(model):
        where = f"replicate_experts: '{path or type(module).__name__}'"
        if isinstance(module, FSDPModule):
            raise ValueError(f"{where} is already an FSDP unit (fully_shard_experts over dp > 1, or fully_shard): "
                             "replicate_experts is the alternative to it, not an addition; build the model again and "
                             "call one of the two")
        if group is not None:
            _check_same_experts(where, group, info)
        module._moe_dp_group = group.group_name if group is not None else None
        _keep_local(module, float(info.ep * mesh.size()), view=_viewed(module, info.names[0]))
        ignore_in_ddp(model, [f"{path}.{n}" if path else n for n in info.names])   # DDP(model) leaves them
        if group is not None:
            src = dist.get_global_rank(group, 0)
            for p in _local_params(module):
                rows = p.detach().to_local() if isinstance(p, DTensor) else p.detach()
                if rows.device.type != "meta":
                    dist.broadcast(rows, src=src, group=group)
        done.append(module)
    if not done:
        raise ValueError("replicate_experts: no expert container sharded by parallelize_experts in "
                         f"{type(model).__name__}; call parallelize_experts(model, ep_mesh) first")
    return done


def fsdp_ignored_params(module: nn.Module) -> set[nn.Parameter]:
    """The expert Parameters under ``module`` that ``fully_shard_experts`` kept out of FSDP (its
    mesh had one rank): pass them as ``ignored_params`` to every ``fully_shard`` over the dense
    mesh that encloses them (the blocks and the root). Empty for a module without expert containers;
    raises for a container that neither call has seen.

    They become (once; later calls return the same objects) DTensor Parameters of the global
    [E, ...] shape, Shard(0) over the ep mesh, as FSDP's Parameters are DTensors: optimizers
    (foreach, fused) and ``clip_grad_norm_`` take one list of DTensors on several meshes, but not
    DTensors mixed with plain tensors. Like ``fully_shard``, it replaces Parameter objects: build
    the optimizer after it (one built before holds Parameters that get no gradient)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fsdp_ignored_params: expected a module (a block or the model), got {type(module).__name__}")
    found = set()
    for path, m, _, _ in _ep_containers(module):
        if m._moe_grad_divisor is None:   # was an empty set (review helper-114): fully_shard then shards the experts
            raise ValueError(f"fsdp_ignored_params: the experts of '{path or type(m).__name__}' were not given to "
                             "fully_shard_experts or replicate_experts yet, so there is nothing to keep out of FSDP; "
                             "call one of them on the model first, then fsdp_ignored_params for each fully_shard")
        _keep_local(m, m._moe_grad_divisor, view=True)
        found.update(_local_params(m))
    return found


def _keep_local(module: nn.Module, factor: float | None, view: bool) -> None:
    """Keep ``module``'s expert Parameters out of FSDP, their gradients divided by ``factor`` (in the
    traced graph: the marker property's ``_DivideGrad``), as local rows or (view) as the DTensor of the
    global tensor; or undo that (factor None). The marker property reads the local rows either way."""
    info = module._moe_ep_info
    for name in info.names:
        held = module._parameters[name]
        viewed = _viewed(module, name)
        if viewed != (view and factor is not None):
            value = held.detach().to_local() if viewed else _global_view(held.detach(), info)
            param = nn.Parameter(value, requires_grad=held.requires_grad)
            param.__dict__.update(held.__dict__)    # _moe_ep_info, HF's flags
            module._parameters[name] = param
    module._moe_grad_divisor = factor


_COMPOSITION_FIX = ("Call moe_compile.fully_shard_experts(model, mesh['dp']) before fully_shard on the blocks "
                    "and the root, and give those calls ignored_params=moe_compile.fsdp_ignored_params(module), "
                    "so that each expert container is sharded only over ranks holding the same experts")


def check_fsdp_composition(group_name: str) -> None:
    """Raise if an FSDP2 unit shards experts sharded over ``group_name`` across ranks that hold other
    experts (a ``fully_shard`` over every rank without ``fully_shard_experts``, or without
    ``ignored_params=fsdp_ignored_params(...)`` where that kept the experts local): its all-gather
    would mix the experts of different ranks. Reads FSDP2's private state of the models
    given to ``parallelize_experts``; skipped where that state has another layout (torch versions)."""
    import torch.distributed as dist

    group = dist.distributed_c10d._resolve_process_group(group_name)
    ep_ranks = set(dist.get_process_group_ranks(group))
    for root in list(_ROOTS.get(group_name, ())):
        for module in root.modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            group_state = getattr(get_state(), "_fsdp_param_group", None) if get_state else None
            for fsdp_param in getattr(group_state, "fsdp_params", ()):
                owner = getattr(getattr(fsdp_param, "_module_info", None), "module", None)
                info = getattr(owner, "_moe_ep_info", None)
                if not isinstance(info, EPInfo) or info.group_name != group_name:
                    continue
                try:
                    ranks = set(fsdp_param.mesh_info.mesh.mesh.flatten().tolist())
                except AttributeError:  # another torch layout: no check
                    continue
                if len(ranks & ep_ranks) > 1:
                    raise ValueError(
                        f"parallelize_experts: the experts of '{info.path or type(owner).__name__}' (sharded over "
                        f"the expert-parallel ranks {sorted(ep_ranks)}) are also sharded by FSDP over ranks "
                        f"{sorted(ranks)}, which hold different experts: its all-gather would mix them. "
                        + _COMPOSITION_FIX)
        _check_divided(root, group_name)


def _check_divided(root: nn.Module, group_name: str) -> None:
    """Raise if FSDP2 manages ``root``'s dense Parameters (its gradients: means over the ranks) while
    an expert container under it is neither an FSDP unit nor kept out by ``fully_shard_experts`` /
    ``replicate_experts`` (the experts left out with FSDP's own ``ignored_params``): each rank's
    expert gradient sums the tokens of every ep rank, and nothing would divide it, ep times too large."""
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in root.modules()):
        return
    for _, module, info, _ in _ep_containers(root):
        if info.group_name == group_name and module._moe_grad_divisor is None and not isinstance(module, FSDPModule):
            raise ValueError(
                f"parallelize_experts: FSDP manages the dense Parameters of this model (their gradients are means "
                f"over the ranks), but the experts of '{info.path or type(module).__name__}' are in no FSDP unit "
                "and were not given to fully_shard_experts or replicate_experts: their gradients, sums over the "
                "tokens of every expert-parallel rank, would be ep times too large. " + _COMPOSITION_FIX)
