"""Expert parallelism under DistributedDataParallel: what DDP must leave alone, checked when the
compiled model first runs (DDP's forward is then the active one).

DDP broadcasts rank 0's Parameters to every rank when it is built and averages every gradient over
its ranks; the experts sharded by ``parallelize_experts`` differ per rank, so DDP must ignore them
(``replicate_experts`` registers them with DDP's ignore list of the model it is given), and their
gradients (sums over the tokens of every ep rank) must be divided to the mean DDP takes of the
others (``replicate_experts``' divisor, ep * dp). ``check_ddp_composition`` raises where either is
missing, before the compiled step runs:

    mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))   # dp = 1: ep spans every rank
    moe_compile.parallelize_experts(model, mesh["ep"])
    moe_compile.replicate_experts(model, mesh["dp"])     # before DDP(model)
    torch._dynamo.config.optimize_ddp = False            # DDP's buckets would split MoE layers
    model = torch.compile(DDP(model), backend="moe")
"""
from __future__ import annotations

from moe_compile.ep_info import _ep_containers

RECIPE = ("call moe_compile.replicate_experts(model, mesh['dp']) after parallelize_experts and before DDP(model) "
          "(mesh['dp']: the ranks holding the same experts, a dimension of size 1 when ep spans every rank): it "
          "keeps the experts out of DDP and divides their gradients as DDP divides the others; or compose with "
          "FSDP2 instead (README, expert parallelism)")


def ep_groups(gm) -> tuple[str, ...]:
    """The expert-parallel groups of the regions rewritten in ``gm`` (its subgraphs too)."""
    from moe_compile.kernels import ep_traceable

    return tuple(sorted({n.args[1] for m in gm.modules() if hasattr(m, "graph") for n in m.graph.nodes
                         if n.op == "call_function" and n.target is ep_traceable.scatter_tokens}))


class CheckedUnderDDP:
    """A compiled graph with expert-parallel regions: ``check_ddp_composition`` whenever the DDP module
    whose forward runs it changes. The compile-time check runs only when Dynamo traces: a graph compiled
    before the model was wrapped in DDP serves DDP's calls from Dynamo's cache (no guard reads DDP), and
    trained a wrong model silently (review helper-81). One class-attribute read per call."""

    def __init__(self, fn, groups: tuple[str, ...]):
        from torch.nn.parallel import DistributedDataParallel

        self.fn, self.groups, self.checked, self.ddp_class = fn, groups, None, DistributedDataParallel
        if getattr(fn, "_boxed_call", False):
            self._boxed_call = True

    def __call__(self, *args, **kwargs):
        ddp = self.ddp_class._active_ddp_module
        if ddp is not self.checked:
            if ddp is not None:
                for group in self.groups:
                    check_ddp_composition(group)
            self.checked = ddp
        return self.fn(*args, **kwargs)

    def __getattr__(self, name):  # anything else Dynamo or Inductor read from the compiled function
        return getattr(self.__dict__["fn"], name)


def active_ddp():
    """The DistributedDataParallel module whose forward is running (Dynamo traces inside it), or None."""
    from torch.nn.parallel import DistributedDataParallel

    getter = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    return getter() if getter is not None else None


def check_ddp_composition(group_name: str) -> None:
    """Raise if the running DDP module holds an expert Parameter sharded over ``group_name`` (it
    overwrote each rank's experts with rank 0's when it was built, and would average the gradients of
    different experts), or leaves such experts out while nothing divides their gradients (ep times
    too large against DDP's means)."""
    ddp = active_ddp()
    if ddp is None:
        return
    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    for path, module, info, names in _ep_containers(ddp.module):
        if info.group_name != group_name:
            continue
        held = [fqn for fqn in (f"{path}.{n}" if path else n for n in names) if fqn not in ignored]
        if held:
            raise ValueError(
                f"parallelize_experts: DistributedDataParallel holds the expert-parallel Parameters {held} "
                f"(each rank holds other experts of '{info.path or type(module).__name__}'): DDP copied rank 0's "
                "experts to every rank when it was built and would average the gradients of different experts. "
                + _held_fix(ddp, module, held))
        if module._moe_grad_divisor is None:
            raise ValueError(
                f"parallelize_experts: DistributedDataParallel leaves the experts of "
                f"'{info.path or type(module).__name__}' out, but nothing divides their gradients: each sums the "
                f"tokens of every expert-parallel rank, {info.ep} times DDP's mean of the others. Instead of "
                f"ignoring them by hand, {RECIPE}")
        _check_ranks(ddp, module, info)


def _held_fix(ddp, module, held: list[str]) -> str:
    """The fix for experts DDP holds: the recipe, or why the recipe's ignore list missed them."""
    if module._moe_grad_divisor is None:
        return f"Build the model again and {RECIPE}"
    if any(n.startswith("_orig_mod.") for n in held):
        return ("replicate_experts listed them in DDP's ignore list by the model's own names, but DDP wraps the "
                "compiled module (DDP(torch.compile(model))), whose names start with '_orig_mod.'. Build the model "
                "again and compile the DDP module instead: torch.compile(DDP(model), backend=\"moe\") (or "
                "model.compile(backend=\"moe\") before DDP(model))")
    return (f"replicate_experts listed them in the ignore list of the module it was given, but DDP wraps another "
            f"module ({type(ddp.module).__name__}, which names them {held}) and reads that module's list. Build "
            "the model again and give replicate_experts the module you wrap in DDP")


def _check_ranks(ddp, module, info) -> None:
    """DDP must average the dense gradients over every rank whose tokens the experts saw (the ep ranks
    and the dp replicas: ``replicate_experts``' divisor): over fewer, the ep ranks' dense Parameters drift
    apart; over another count, experts and dense Parameters train on differently scaled gradients."""
    import torch.distributed as dist

    from moe_compile.kernels.ep_transport import resolve_group

    ranks = set(dist.get_process_group_ranks(ddp.process_group))
    ep_ranks = set(dist.get_process_group_ranks(resolve_group(info.group_name)))
    if not ep_ranks <= ranks or len(ranks) != module._moe_grad_divisor:
        raise ValueError(
            f"parallelize_experts: DistributedDataParallel averages gradients over ranks {sorted(ranks)}, but the "
            f"experts of '{info.path or type(module).__name__}' see the tokens of {int(module._moe_grad_divisor)} "
            f"ranks (expert-parallel ranks {sorted(ep_ranks)} times the replicas given to replicate_experts): "
            + ("the dense Parameters of the expert-parallel ranks would drift apart" if not ep_ranks <= ranks else
               "experts and dense Parameters would train on differently scaled gradients")
            + "; fix: DDP over every rank (its default process group), replicate_experts over the ranks holding "
              "the same experts (mesh['dp'] of an init_device_mesh(..., (dp, ep)) spanning every rank)")


def ddp_split_note() -> str:
    """A sentence for errors of a graph cut at DDP's gradient buckets (Dynamo's DDPOptimizer), or ''."""
    import torch

    if active_ddp() is None or not torch._dynamo.config.optimize_ddp:
        return ""
    return (" This model runs under DistributedDataParallel, and Dynamo's DDPOptimizer (torch._dynamo.config."
            "optimize_ddp, on by default) splits its graph at DDP's gradient buckets, between the router and the "
            "experts; fix: torch._dynamo.config.optimize_ddp = False before the first call (DDP then reduces the "
            "gradients after the compiled backward).")


def ignore_in_ddp(model, names: list[str]) -> None:
    """Add ``names`` (Parameter names under ``model``) to the ignore list DDP reads from the module it wraps."""
    from torch.nn.parallel import DistributedDataParallel

    known = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, known + [n for n in names if n not in known])
