"""use_runtime_ops: the differentiated graphs call each moe_compile op's twin in ``moe_compile_rt``.

A post_grad pass (``pipeline.PASSES``: ``runtime_ops``, the last one) over each forward / backward
ATen graph after AOTAutograd. Those graphs need no autograd formula any more, so each call of a
moe_compile compute op switches from the ``torch.library.custom_op`` to a plain dispatcher kernel
of the same function, ``torch.ops.moe_compile_rt.<op>`` (``kernels/runtime_ops.py``): the same
schema, fake, kernels and results, without the custom op's Python autograd and backend layers on
every call (28-69 µs per call on an H100 machine's host, 14 calls per MoE layer per training step).

Before::

    xp = torch.ops.moe_compile.permute_rows.default(x, perm, inv, offsets, 8)

After::

    xp = torch.ops.moe_compile_rt.permute_rows.default(x, perm, inv, offsets, 8)

Only the target changes (arguments, meta, order kept); ops without a twin (the expert-parallel
ones) keep theirs. Runs after every other post_grad pass, which match on op names
(``passes/normalize.canon``: both overloads are ``moe_compile::<op>``).
"""
from __future__ import annotations

import torch.fx as fx

from moe_compile.kernels.runtime_ops import RUNTIME


def use_runtime_ops(graph: fx.Graph) -> int:
    """Point every call of a moe_compile op that has a twin at the twin; returns how many."""
    n = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in RUNTIME:
            node.target = RUNTIME[node.target]
            n += 1
    return n
