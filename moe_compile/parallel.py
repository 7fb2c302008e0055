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
  Parameter object (its ``.data``, and a ``.grad`` if any, cut to those rows), still registered
  as ``name`` (its FQN unchanged: optimizer state dicts and torch.distributed.checkpoint's
  ``state_dict`` utilities key it as the unsharded model does). An optimizer built before therefore still
  steps the experts, unless it already holds state for them (Adam's full-size ``exp_avg`` after a
  step: its next step fails on the shapes): build optimizers after ``parallelize_experts``. A
  Parameter also held by a module outside the expert containers (tied) raises: it would read the rows;
* the module's class becomes a subclass whose *property* ``name`` (which attribute reads find before
  the Parameter: ``module.name`` is the property, ``module._parameters[name]`` the shard) returns
  ``torch.ops.moe_compile.ep_experts(self._parameters[name], E, group_name)``: Dynamo traces it, so
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

import sys
import weakref

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from moe_compile.kernels import ep as _ep_ops  # noqa: F401  (registers torch.ops.moe_compile.ep_*)
from moe_compile.ep_containers import (_check_not_tied, _module_list_experts, expert_parameters,  # noqa: F401
                                       find_expert_containers)
from moe_compile.ep_info import (_MESHES, _ROOTS, EPInfo, _global_view, _viewed, ep_info,  # noqa: F401
                                 ep_infos)                                         # (ep_info, ep_infos: re-exported)
from moe_compile.ep_fsdp import (check_fsdp_composition, fsdp_ignored_params, fully_shard_experts,  # noqa: F401
                                 replicate_experts)                                # (re-exported)
from moe_compile.grad_norm import clip_grad_norm_  # noqa: F401  (re-exported: moe_compile.parallel.clip_grad_norm_)
from moe_compile.stacking import StackedExperts, stack_experts  # noqa: F401  (re-exported: the EP recipe's first step)

__all__ = ["EPInfo", "ExpertParallel", "StackedExperts", "check_fsdp_composition", "clip_grad_norm_", "ep_info", "ep_infos",
           "fsdp_ignored_params", "fully_shard_experts", "parallelize_experts", "replicate_experts", "stack_experts"]

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
            def get(self):
                if not torch.compiler.is_dynamo_compiling():   # eager code, or Dynamo's guards (hasattr): no op
                    return self._parameters[name] if _from_torch_distributed() else OUTSIDE_COMPILE
                rows = self._parameters[name]   # the Parameter, under the name the property shadows
                rows = rows.to_local() if isinstance(rows, DTensor) else rows   # kept out of FSDP: _keep_local
                divisor = self._moe_grad_divisor
                if divisor is not None and torch.is_grad_enabled():  # kept out of FSDP: FSDP's division, traced
                    dp_group = self._moe_dp_group        # replicas over dp (replicate_experts): summed first
                    rows = _ReduceGrad.apply(rows, divisor, dp_group) if dp_group else _DivideGrad.apply(rows, divisor)
                return torch.ops.moe_compile.ep_experts(rows, num_experts, group_name, max_tokens)
            get.__name__ = name
            return property(get, doc=f"[E={num_experts}, ...] expert-parallel view of _parameters[{name!r}] (marker op)")

        ns = {n: marker(n) for n in names}
        ns["__module__"] = cls.__module__
        ns["_moe_grad_divisor"] = None      # the divide factor once fully_shard_experts keeps the experts local
        ns["_moe_dp_group"] = None          # replicate_experts: the dp group their gradients are summed over
        _EP_CLASSES[key] = type(f"ExpertParallel{cls.__name__}", (cls,), ns)
    return _EP_CLASSES[key]


def _from_torch_distributed() -> bool:
    """The property's caller is torch.distributed's own code: FSDP2 reads ``getattr(module, name)`` to
    find the Parameter it manages (``reset_sharded_param``; experts it must not shard, which the compile
    then refuses, naming the fix), DCP's ``_get_fqns`` walks names with getattr. They get the Parameter."""
    return sys._getframe(2).f_globals.get("__name__", "").startswith("torch.distributed.")


def _state_dict_post_hook(module, state_dict, prefix, local_metadata):
    info = module._moe_ep_info
    for name in info.names:
        local = state_dict.pop(prefix + name, None)
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
        held = module._parameters[name]
        if _viewed(module, name):        # kept out of FSDP
            rows = _global_view(rows.to(held.device), info)
        elif isinstance(held, DTensor):  # FSDP-sharded over dp ranks, which all hold these rows
            rows = distribute_tensor(rows.to(held.device), held.device_mesh, held.placements)
        state_dict[prefix + name] = rows


def _held_by_a_live_graph(param: nn.Parameter, rows: int) -> bool:
    """An autograd graph still alive holds ``param``'s gradient node, which keeps the shape it had when that
    graph was built: cut to ``rows`` rows (as ``_shard`` cuts it), the node's shape would no longer match
    (torch keeps one node per leaf while a graph holds it, and makes a new one, of the current shape,
    otherwise). The Parameter is left as it was."""
    if not param.requires_grad or rows == param.shape[0]:
        return False
    full = param.data
    try:
        param.data = full[:rows]
        meta = getattr(torch.autograd.graph.get_gradient_edge(param).node, "_input_metadata", None)
        return bool(meta) and tuple(meta[0].shape) != tuple(param.shape)
    finally:
        param.data = full


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
        module.register_parameter(name, param)
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
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize_experts: expected the model (an nn.Module) first, got {type(model).__name__}")
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
    for path, module, num_experts, names in found:   # every container checked before any is sharded
        where = f"parallelize_experts: '{path or type(module).__name__}'"
        if num_experts % mesh.size():
            hint = ("" if not path else " If it holds no experts (a [N, ...] weight of another kind, e.g. per-head "
                    "projections), name the expert containers instead: torch.distributed.tensor.parallel."
                    "parallelize_module(model, mesh, {\"<path of the experts>\": ExpertParallel()})")   # not when named
            raise ValueError(f"{where} has {num_experts} experts, not divisible by the ep mesh size {mesh.size()}; "
                             f"nothing was sharded.{hint}")
        if any(isinstance(module._parameters[n], DTensor) for n in names):   # FSDP's (or a DTensor plan's)
            raise ValueError(f"{where}: its expert weights are DTensors already (fully_shard, or another "
                             "DTensor sharding such as a tensor-parallel plan over the expert linears, came first); "
                             "call parallelize_experts on the plain model, then fully_shard_experts and fully_shard "
                             "(README, expert parallelism); tensor-parallel experts are not supported: leave the "
                             "experts out of parallelize_module's plan (tensor parallelism elsewhere composes, README); "
                             "nothing was sharded")
        held = next((n for n in names if _held_by_a_live_graph(module._parameters[n], num_experts // mesh.size())), None)
        if held is not None:
            raise ValueError(f"{where}: an autograd graph of an earlier forward still holds '{held}' at its full "
                             f"[{num_experts}, ...] shape (a loss or an output kept from a step before sharding, or "
                             "the Parameter's gradient accumulator held by a hook: DDP's, or one registered with "
                             "param.view_as(param).grad_fn.next_functions): that backward and the next one would "
                             "fail with a shape error; drop those references (del loss, remove the hooks, or wrap "
                             "with DDP after parallelize_experts and replicate_experts, README) first; nothing was sharded")
    _check_not_tied(model, found)
    _MESHES[mesh.get_group().group_name] = mesh
    _ROOTS.setdefault(mesh.get_group().group_name, weakref.WeakSet()).add(model)
    for path, module, num_experts, names in found:
        _shard(path, module, num_experts, names, mesh, max_tokens)
    from . import ep_optim_state

    ep_optim_state.install()   # the optimizer state of the shards, in checkpoints (ep_optim_state.py)
    return model


class ExpertParallel(ParallelStyle):
    """``parallelize_module(model, mesh, {"layers.*.mlp.experts": ExpertParallel()})``: the same as
    ``parallelize_experts`` on each matched module (EPInfo.path is then "", the plan names it);
    ``ExpertParallel(max_tokens=N)`` as its ``max_tokens``."""

    def __init__(self, *, max_tokens: int | None = None):
        super().__init__()
        self.max_tokens = max_tokens

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        out = parallelize_experts(module, device_mesh, max_tokens=self.max_tokens)
        model = _plan_root()
        if model is not None:   # the whole model too: its tensor-parallel Parameters (ep_info.tensor_parallel_over)
            for info in ep_infos(out).values():
                _ROOTS[info.group_name].add(model)
        return out


def _plan_root() -> nn.Module | None:
    """The module given to the outermost ``parallelize_module`` call running this plan style, or None
    (the style applied some other way): the plan's style sees only the expert container."""
    import sys

    frame, root = sys._getframe(2), None
    while frame is not None:
        if frame.f_code.co_name == "parallelize_module" and isinstance(frame.f_locals.get("module"), nn.Module):
            root = frame.f_locals["module"]
        frame = frame.f_back
    return root
