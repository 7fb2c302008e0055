"""Expert parallelism, the user side: shard stacked expert weights over an "ep" device mesh.

    mesh = init_device_mesh("cuda", (ep,), mesh_dim_names=("ep",))
    moe_compile.parallelize_experts(model, mesh)            # in place; returns model
    # ranks holding different token counts (padding-free batches): a bound on any rank's count
    moe_compile.parallelize_experts(model, mesh, max_tokens=8192)
    model = torch.compile(model, backend="moe")             # rewrites each MoE layer into dispatch/combine
    # or: parallelize_module(model, mesh, {"layers.*.mlp.experts": ExpertParallel()})

Legend: E experts, ep ranks in the mesh, E_local = E / ep; rank r owns global experts
[r*E_local, (r+1)*E_local).

An *expert container* is a module (not a torch.nn built-in such as Conv1d) whose direct 3-D
Parameters share dim 0 = E: Hugging Face transformers 5 ``*Experts`` modules (``gate_up_proj
[E, 2I, H]``, ``down_proj [E, H, I]``, optional biases ``[E, N]``) or plain code alike. Its direct
2-D Parameters with E rows are per-expert biases and are sharded too (so a router weight [E, H]
must live in another module, as in every HF model; one that does not fails the
compile, named: passes/ep_markers.py). For each container, in place:

* each sharded Parameter ``name`` keeps only rows [rank*E_local, (rank+1)*E_local): the same
  Parameter object (its ``.data``, and a ``.grad`` if any, cut to those rows), registered as
  ``_ep_local_<name>``; ``name`` leaves ``_parameters``. An optimizer built before therefore still
  steps the experts, unless it already holds state for them (Adam's full-size ``exp_avg`` after a
  step: its next step fails on the shapes): build optimizers after ``parallelize_experts``. A
  Parameter also held by a module outside the expert containers (tied) raises: it would read the rows;
* the module's class becomes a subclass whose *property* ``name`` returns
  ``torch.ops.moe_compile.ep_experts(self._ep_local_<name>, E, group_name)``: Dynamo traces it, so
  the graph holds the marker with the local shard as its input, and the backend's lowering turns
  the layer into plan / dispatch / grouped GEMMs on the shard / combine (kernels/ep_traceable.py;
  the same movement as the ops of kernels/ep.py). Eager code that reads the property raises (the
  marker never computes);
* ``state_dict()`` shows ``name`` again, as a DTensor with ``Shard(0)`` and the global shape;
  ``load_state_dict`` takes such DTensors or plain full [E, ...] tensors (this rank's rows are
  kept), so torch.distributed.checkpoint saves at one ep and loads at another (or unsharded);
* ``ep_info(module)`` returns an ``EPInfo`` saying what was sharded.

Experts held as an ``nn.ModuleList`` raise with the fix: ``stack_experts`` (opt-in; state_dict keys
change). Dynamically created classes: ``copy.deepcopy`` works, pickling the whole module does not
(save state_dicts).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from moe_compile.kernels import ep as _ep_ops  # noqa: F401  (registers torch.ops.moe_compile.ep_*)
from moe_compile.ep_containers import (_check_not_tied, _module_list_experts, expert_parameters,  # noqa: F401
                                       find_expert_containers)
from moe_compile.ep_info import _MESHES, LOCAL_PREFIX, EPInfo, ep_info, ep_infos  # noqa: F401  (re-exported)
from moe_compile.grad_norm import clip_grad_norm_  # noqa: F401  (re-exported: moe_compile.parallel.clip_grad_norm_)
from moe_compile.stacking import StackedExperts, stack_experts  # noqa: F401  (re-exported: the EP recipe's first step)

__all__ = ["EPInfo", "ExpertParallel", "StackedExperts", "check_fsdp_composition", "clip_grad_norm_", "ep_info", "ep_infos",
           "fsdp_ignored_params", "fully_shard_experts", "parallelize_experts", "replicate_experts", "stack_experts"]

_ROOTS: dict[str, "weakref.WeakSet"] = {}  # group_name -> models given to parallelize_experts with it
_EP_CLASSES: dict[tuple, type] = {}


# --------------------------------------------------------------------------- sharding
def _ep_dim(mesh: DeviceMesh) -> DeviceMesh:
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names or ()
    if "ep" not in names:
        raise ValueError(f"parallelize_experts: a {mesh.ndim}-D mesh needs a dimension named 'ep', got {names}")
    return mesh["ep"]


class _DivideGrad(torch.autograd.Function):
    """Identity forward; the backward divides the gradient by ``divisor`` (as FSDP's divide factor).
    Traced by Dynamo, so it survives whatever replaces the Parameter objects (``model.to``,
    ``to_empty`` after meta init, ``load_state_dict(assign=True)``), which a tensor hook on the
    Parameter does not."""

    @staticmethod
    def forward(ctx, rows, divisor):
        ctx.divisor = divisor
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.divisor, None


class _ReduceGrad(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the process group ``group_name`` (the
    dp ranks holding replicas of these experts: ``replicate_experts``), with a functional all-reduce
    the compiler sees and schedules, then divides it by ``divisor``."""

    @staticmethod
    def forward(ctx, rows, divisor, group_name):
        ctx.divisor, ctx.group_name = divisor, group_name
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed._functional_collectives as fc

        return fc.wait_tensor(fc.all_reduce(grad, "sum", ctx.group_name)) / ctx.divisor, None, None


class _ShardedOutsideCompile:
    """What a sharded expert weight reads as outside a torch.compile trace. ``hasattr``, ``getattr(m, n,
    None)``, ``is None`` and Dynamo's HASATTR guard (built from such code, and evaluated on every call)
    see an attribute; any use of it raises the marker's error: eager code must not compute with one
    rank's rows (the ep_experts op itself raised when the property ran it outside a trace, which made
    a guard on ``hasattr`` fail the whole compile with an error naming neither)."""

    __slots__ = ()

    def _raise(self, *args, **kwargs):
        raise RuntimeError(_ep_ops.EP_EXPERTS_ERROR)

    __getattr__ = __getitem__ = __setitem__ = __call__ = __bool__ = __len__ = __iter__ = __float__ = _raise
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __matmul__ = __rmatmul__ = _raise
    __truediv__ = __rtruediv__ = __neg__ = __pow__ = __array__ = _raise

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(_ep_ops.EP_EXPERTS_ERROR)

    def __repr__(self):
        return "<expert weight sharded by moe_compile.parallelize_experts: readable only inside torch.compile>"


OUTSIDE_COMPILE = _ShardedOutsideCompile()


def _ep_class(cls: type, names: tuple[str, ...], num_experts: int, group_name: str, max_tokens: int = 0) -> type:
    """``cls`` plus one property per sharded name returning the ep_experts marker of the local shard."""
    key = (cls, names, num_experts, group_name, max_tokens)
    if key not in _EP_CLASSES:
        def marker(name):
            local = LOCAL_PREFIX + name

            def get(self):
                if not torch.compiler.is_dynamo_compiling():   # eager code, or Dynamo's guards (hasattr): no op
                    return OUTSIDE_COMPILE
                rows = getattr(self, local)
                rows = rows.to_local() if isinstance(rows, DTensor) else rows   # kept out of FSDP: _keep_local
                divisor = self._moe_grad_divisor
                if divisor is not None and torch.is_grad_enabled():  # kept out of FSDP: FSDP's division, traced
                    dp_group = self._moe_dp_group        # replicas over dp (replicate_experts): summed first
                    rows = _ReduceGrad.apply(rows, divisor, dp_group) if dp_group else _DivideGrad.apply(rows, divisor)
                return torch.ops.moe_compile.ep_experts(rows, num_experts, group_name, max_tokens)
            get.__name__ = name
            return property(get, doc=f"[E={num_experts}, ...] expert-parallel view of {local} (marker op)")

        ns = {n: marker(n) for n in names}
        ns["__module__"] = cls.__module__
        ns["_moe_grad_divisor"] = None      # the divide factor once fully_shard_experts keeps the experts local
        ns["_moe_dp_group"] = None          # replicate_experts: the dp group their gradients are summed over
        _EP_CLASSES[key] = type(f"ExpertParallel{cls.__name__}", (cls,), ns)
    return _EP_CLASSES[key]


def _global_view(rows: torch.Tensor, info: EPInfo) -> DTensor:
    """This rank's expert rows as the Shard(0) DTensor of the global [E, ...] tensor over the ep mesh."""
    shape = torch.Size((info.num_experts, *rows.shape[1:]))
    return DTensor.from_local(rows, info.mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _state_dict_post_hook(module, state_dict, prefix, local_metadata):
    info = module._moe_ep_info
    for name in info.names:
        local = state_dict.pop(prefix + LOCAL_PREFIX + name, None)
        if local is None:
            continue
        if _viewed(module, name):        # kept out of FSDP: already the view
            state_dict[prefix + name] = local
            continue
        if isinstance(local, DTensor):   # fully_shard_experts over dp > 1 ranks: FSDP's shard of this rank's rows
            local = local.full_tensor()
        state_dict[prefix + name] = _global_view(local, info)


def _local_rows(value: torch.Tensor, info: EPInfo, key: str) -> torch.Tensor | str:
    """This rank's rows of a checkpoint value (DTensor or full tensor), or an error message."""
    if isinstance(value, DTensor):
        if tuple(value.placements) == (Shard(0),) and value.device_mesh == info.mesh:
            return value.to_local()
        value = value.full_tensor()
    if value.dim() < 1 or value.shape[0] != info.num_experts:
        return (f"size mismatch for {key}: parallelize_experts expects the global [{info.num_experts}, ...] "
                f"tensor (or a Shard(0) DTensor), got {tuple(value.shape)}")
    r = info.expert_range
    return value[r.start:r.stop]


def _load_state_dict_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
    info = module._moe_ep_info
    for name in info.names:
        if prefix + name not in state_dict:
            continue
        rows = _local_rows(state_dict.pop(prefix + name), info, prefix + name)
        if isinstance(rows, str):
            error_msgs.append(rows)
            continue
        held = module._parameters[LOCAL_PREFIX + name]
        if _viewed(module, name):        # kept out of FSDP
            rows = _global_view(rows.to(held.device), info)
        elif isinstance(held, DTensor):  # FSDP-sharded over dp ranks, which all hold these rows
            rows = distribute_tensor(rows.to(held.device), held.device_mesh, held.placements)
        state_dict[prefix + LOCAL_PREFIX + name] = rows


def _shard(path: str, module: nn.Module, num_experts: int, names: tuple[str, ...], mesh: DeviceMesh,
           max_tokens: int | None) -> None:
    ep, rank = mesh.size(), mesh.get_local_rank()
    group_name = mesh.get_group().group_name
    if num_experts % ep:
        raise ValueError(f"parallelize_experts: '{path or type(module).__name__}' has {num_experts} experts, "
                         f"not divisible by the ep mesh size {ep}")
    info = EPInfo(path, names, num_experts, ep, rank, group_name, max_tokens)
    r = info.expert_range
    for name in names:
        # the user's Parameter object itself, cut to this rank's rows: an optimizer built before still
        # holds it (a new Parameter would leave that optimizer with full ones no gradient ever reaches)
        param = module._parameters.pop(name)
        if ep_info(param) is None:   # a Parameter tied to an expert container already sharded keeps its rows
            param.data = param.detach()[r.start:r.stop].clone()
            if param.grad is not None:
                param.grad = param.grad[r.start:r.stop].clone()
            param._moe_ep_info = info
        module.register_parameter(LOCAL_PREFIX + name, param)
    module.__class__ = _ep_class(type(module), names, num_experts, group_name, max_tokens or 0)
    module._moe_ep_info = info
    module.register_state_dict_post_hook(_state_dict_post_hook)
    module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)


def parallelize_experts(model: nn.Module, mesh: DeviceMesh, *, max_tokens: int | None = None) -> nn.Module:
    """Shard every expert container of ``model`` over ``mesh`` (1-D, or its "ep" dimension), in place.

    ``max_tokens``: by default every rank of the mesh must hold the same number of tokens T in each MoE
    layer (a batch of the same shape on every rank), else every rank raises a named error. With a bound
    N, ranks may hold different counts, up to N each (padding-free batches, the last batch of an
    epoch): each rank's tokens are padded to N rows before they travel (the padding rows go to no
    expert: they cost bytes on the wire, no expert GEMM), and a rank holding more than N raises. Give
    every rank the same N.

    Raises ValueError when no container is found, when E is not divisible by the mesh size, and for
    experts held as an nn.ModuleList (convert them with ``stack_experts`` first). Parameters stay on
    their device (move the model to the mesh's device type before or after)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"parallelize_experts: expected a DeviceMesh, got {type(mesh).__name__}; e.g. "
                        f"torch.distributed.device_mesh.init_device_mesh('cuda', (world_size,), mesh_dim_names=('ep',))")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"parallelize_experts: max_tokens must be a positive int (a bound on any rank's tokens per "
                         f"MoE layer) or None (every rank holds the same count), got {max_tokens!r}")
    mesh = _ep_dim(mesh)
    found = find_expert_containers(model)
    if not found:
        done = ep_infos(model)
        if done:
            raise ValueError(f"parallelize_experts: {type(model).__name__} is already expert-parallel "
                             f"({', '.join(sorted(p or '<root>' for p in done))} sharded); call it once per model")
        raise ValueError(f"parallelize_experts: {type(model).__name__} has no expert container (a module whose "
                         f"3-D parameters are stacked per expert, [E, ...])")
    for path, module, num_experts, _ in found:   # every container checked before any is sharded
        if num_experts % mesh.size():
            raise ValueError(f"parallelize_experts: '{path or type(module).__name__}' has {num_experts} experts, "
                             f"not divisible by the ep mesh size {mesh.size()}; nothing was sharded")
    _check_not_tied(model, found)
    _MESHES[mesh.get_group().group_name] = mesh
    _ROOTS.setdefault(mesh.get_group().group_name, weakref.WeakSet()).add(model)
    for path, module, num_experts, names in found:
        _shard(path, module, num_experts, names, mesh, max_tokens)
    return model


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

    * ``mesh`` of several ranks: each container becomes its own ``fully_shard`` unit over ``mesh``
      (``fsdp_kwargs`` go to it); the blocks' calls then leave it alone, and
      ``fsdp_ignored_params`` returns nothing for it.
    * ``mesh`` of one rank and no ``mp_policy`` / ``offload_policy`` in ``fsdp_kwargs``: there is
      nothing to shard, and an FSDP unit would only cost (a copy of every expert weight per step,
      hooks that break the block's compiled graph: 7-19% of a whole-model step on 2-4 H200,
      docs/benchmarks.md). The experts stay out of FSDP: ``fsdp_ignored_params`` returns them, for
      the blocks' and root's ``fully_shard`` to leave alone.

    Either way each rank's expert gradient already sums the tokens of every ep rank (the
    dispatch's backward), and it is divided by the number of ranks whose tokens reach an expert,
    ep * dp (FSDP's divide factor; out of FSDP, ``_DivideGrad`` in the traced graph): expert and
    dense gradients are both means over the global batch. Forgetting ``ignored_params`` at dp = 1 (or a
    root ``fully_shard`` without this call) would shard each rank's different experts across the
    ep ranks: the backend refuses to compile that and names the fix (``check_fsdp_composition``)."""
    done = []
    local = mesh.size() == 1 and not any(fsdp_kwargs.get(k) is not None for k in ("mp_policy", "offload_policy"))
    for _, module, info, _ in _ep_containers(model):
        factor = float(info.ep * mesh.size())
        module._moe_dp_group = None
        if local:   # a repeated call keeps the form fsdp_ignored_params gave the Parameters
            _keep_local(module, factor, view=_viewed(module, info.names[0]))
        else:
            from torch.distributed.fsdp import fully_shard

            _keep_local(module, None, view=False)
            fully_shard(module, mesh=mesh, **fsdp_kwargs)
            module.set_gradient_divide_factor(factor)
        done.append(module)
    if not done:
        raise ValueError("fully_shard_experts: no expert container sharded by parallelize_experts in "
                         f"{type(model).__name__}; call parallelize_experts(model, ep_mesh) first")
    return done


def replicate_experts(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Compose expert parallelism with FSDP2 by keeping each rank's experts whole on every rank of
    ``mesh`` (the dp ranks that hold the same experts, as for ``fully_shard_experts``) instead of
    sharding them over it: no FSDP unit on the experts, so no FSDP hooks that break the compiled
    graph. What that buys: the layer compiles inside activation checkpointing at dp > 1, where an FSDP
    unit's hooks make Dynamo run the whole checkpointed layer eagerly (an error under expert
    parallelism), and nothing is copied per step. What it costs: the experts and their optimizer state
    are not divided over dp (memory ~ E / ep experts per rank, as at dp = 1). Use it in place of
    ``fully_shard_experts``, before ``fully_shard`` on the blocks and the root, whose calls get
    ``ignored_params=moe_compile.fsdp_ignored_params(...)``, as in ``fully_shard_experts``' recipe.

    Gradients: summed over the ep ranks by the dispatch's backward, over ``mesh`` by an all-reduce in
    the traced backward (``_ReduceGrad``: a functional collective the compiler schedules), divided by
    ep * dp: the mean over the global batch, as FSDP's. The replicas start equal: the rows of ``mesh``'s
    first rank are broadcast to the others here (not for a model on the meta device: load the same
    checkpoint on every rank after ``to_empty``), and equal gradients keep them equal."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from moe_compile.kernels.ep_transport import resolve_group

    done = []
    group = mesh.get_group() if mesh.size() > 1 else None
    for path, module, info, _ in _ep_containers(model):
        where = f"replicate_experts: '{path or type(module).__name__}'"
        if isinstance(module, FSDPModule):
            raise ValueError(f"{where} is already an FSDP unit (fully_shard_experts over dp > 1, or fully_shard): "
                             "replicate_experts is the alternative to it, not an addition; build the model again and "
                             "call one of the two")
        if group is not None:
            shared = set(dist.get_process_group_ranks(group)) & set(
                dist.get_process_group_ranks(resolve_group(info.group_name)))
            if len(shared) > 1:
                raise ValueError(f"{where}: the ranks of the given mesh {sorted(dist.get_process_group_ranks(group))} "
                                 f"hold different experts (ranks {sorted(shared)} are in its expert-parallel group); "
                                 "give replicate_experts the ranks holding the SAME experts, the dp dimension "
                                 "orthogonal to 'ep' (mesh['dp'])")
        module._moe_dp_group = group.group_name if group is not None else None
        _keep_local(module, float(info.ep * mesh.size()), view=_viewed(module, info.names[0]))
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
    mesh that encloses them (the blocks and the root). Empty when there are none.

    They become (once; later calls return the same objects) DTensor Parameters of the global
    [E, ...] shape, Shard(0) over the ep mesh, as FSDP's Parameters are DTensors: optimizers
    (foreach, fused) and ``clip_grad_norm_`` take one list of DTensors on several meshes, but not
    DTensors mixed with plain tensors. Like ``fully_shard``, it replaces Parameter objects: build
    the optimizer after it (one built before holds Parameters that get no gradient)."""
    found = set()
    for _, m, _, _ in _ep_containers(module):
        if m._moe_grad_divisor is not None:
            _keep_local(m, m._moe_grad_divisor, view=True)
            found.update(_local_params(m))
    return found


def _keep_local(module: nn.Module, factor: float | None, view: bool) -> None:
    """Keep ``module``'s expert Parameters out of FSDP, their gradients divided by ``factor`` (in the
    traced graph: the marker property's ``_DivideGrad``), as local rows or (view) as the DTensor of the
    global tensor; or undo that (factor None). The marker property reads the local rows either way."""
    info = module._moe_ep_info
    for name in info.names:
        held = module._parameters[LOCAL_PREFIX + name]
        viewed = _viewed(module, name)
        if viewed != (view and factor is not None):
            value = held.detach().to_local() if viewed else _global_view(held.detach(), info)
            param = nn.Parameter(value, requires_grad=held.requires_grad)
            param.__dict__.update(held.__dict__)    # _moe_ep_info, HF's flags
            module._parameters[LOCAL_PREFIX + name] = param
    module._moe_grad_divisor = factor


def _viewed(module: nn.Module, name: str) -> bool:
    """Whether the Parameter of ``name`` is the DTensor view that fsdp_ignored_params makes."""
    held = module._parameters[LOCAL_PREFIX + name]
    return isinstance(held, DTensor) and held.device_mesh == module._moe_ep_info.mesh


def _local_params(module: nn.Module) -> list[nn.Parameter]:
    info = module._moe_ep_info
    return [module._parameters[LOCAL_PREFIX + name] for name in info.names]


def _ep_containers(model: nn.Module):
    for path, module in model.named_modules():
        info = getattr(module, "_moe_ep_info", None)
        if isinstance(info, EPInfo):
            yield path, module, info, info.names


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


class ExpertParallel(ParallelStyle):
    """``parallelize_module(model, mesh, {"layers.*.mlp.experts": ExpertParallel()})``: the same as
    ``parallelize_experts`` on each matched module (EPInfo.path is then "", the plan names it);
    ``ExpertParallel(max_tokens=N)`` as its ``max_tokens``."""

    def __init__(self, *, max_tokens: int | None = None):
        super().__init__()
        self.max_tokens = max_tokens

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return parallelize_experts(module, device_mesh, max_tokens=self.max_tokens)
