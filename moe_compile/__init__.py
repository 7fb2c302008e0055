"""moe_compile: a torch.compile backend for Mixture-of-Experts models.

    model = torch.compile(model, backend="moe")          # no import needed (entry point)
    report = moe_compile.explain(model, inputs)          # what was matched / rewritten / refused
    with moe_compile.compiled_backward(): loss.backward()  # one compiled backward (ModuleList experts)
    moe_compile.parallelize_experts(model, mesh)         # expert parallelism over an "ep" mesh (parallel.py)
    moe_compile.compile_blocks(model)                    # one compile per decoder layer (blocks.py)

Importing this package is cheap: it initialises neither CUDA nor Triton and changes no global
torch configuration.
"""
from .config import MoEConfig

__all__ = ["ExpertParallel", "MoEConfig", "Report", "compile_blocks", "compiled_backward", "counters", "explain", "moe_backend",
           "fsdp_ignored_params", "fully_shard_experts", "parallelize_experts", "replicate_experts", "stack_experts"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: keep `import moe_compile` light
    if name == "moe_backend":
        from .backend import moe_backend
        return moe_backend
    if name == "counters":  # rewritten / refused region counts, process-wide
        from .records import counters
        return counters
    if name == "compile_blocks":
        from .blocks import compile_blocks
        return compile_blocks
    if name == "compiled_backward":
        from .autograd import compiled_backward
        return compiled_backward
    if name in ("parallelize_experts", "ExpertParallel", "stack_experts", "fully_shard_experts", "replicate_experts",
                "fsdp_ignored_params"):  # imports torch.distributed
        from . import parallel
        return getattr(parallel, name)
    if name in ("explain", "Report"):
        from . import report
        return getattr(report, name)
    raise AttributeError(f"module 'moe_compile' has no attribute {name!r}")
