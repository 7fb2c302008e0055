"""Inductor's FX graph cache and AOTAutograd's cache on rewritten graphs (``backend._PostGradPass``):
a second process with the same cache directory loads the compiled graphs instead of compiling them,
gets the same outputs and gradients as eager and the same explain() records; the cache key changes
with this package's source and with the user's own post-grad pass."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import moe_compile
from helpers import make_input, make_model
from moe_compile import backend

HERE = os.path.dirname(os.path.abspath(__file__))

# One process: compile an MoE block whose forward also has a host sync outside the MoE region
# (boolean-mask indexing), check outputs and every gradient against eager (helpers.check_compiled
# asserts), print the cache counters and the region's notes.
_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from helpers import check_compiled, make_input, make_model
import moe_compile

torch.set_num_threads(1)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mlp = make_model(spelling="index_add", e=4, k=2)

    def forward(self, x):
        return x + self.mlp(x) + x[x.sum(-1) > 0].sum()

model = Block()
check_compiled(model, (make_input((2, 5, 16)),), expect_rewritten=1, inductor=True, fresh_inputs=1)
rep = moe_compile.explain(model, make_input((2, 5, 16)))
print("RESULT " + json.dumps({"inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"]),
                              "notes": [list(r.notes) for r in rep.regions], "ops": [list(r.ops) for r in rep.regions]}))
"""


def _child(cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, HERE], capture_output=True, text=True, env=env, timeout=600)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and line, out.stdout[-3000:] + out.stderr[-6000:]
    return json.loads(line[0][len("RESULT "):])


def test_second_process_loads_rewritten_graphs_from_the_cache(tmp_path):
    """Cold: compiled and saved (no bypass). Warm: loaded (hits, no misses), outputs and every
    gradient still match eager (asserted in the child), the same records, and the note on the host
    sync outside the region is there although the post_grad passes did not run."""
    cold = _child(str(tmp_path))
    warm = _child(str(tmp_path))
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 1, cold
    assert not cold["inductor"].get("fxgraph_cache_bypass") and not cold["aot"].get("autograd_cache_bypass"), cold
    assert warm["inductor"].get("fxgraph_cache_hit", 0) + warm["aot"].get("autograd_cache_hit", 0) >= 1, warm
    assert not warm["inductor"].get("fxgraph_cache_miss") and not warm["aot"].get("autograd_cache_miss"), warm
    assert warm["notes"] == cold["notes"] and warm["ops"] == cold["ops"], (cold, warm)
    assert any("host syncs left" in n for n in cold["notes"][0]), cold["notes"]


class _UserPass(CustomGraphPass):
    def __init__(self, key):
        self.key = key

    def __call__(self, graph):
        pass

    def uuid(self):
        return self.key


def test_post_grad_pass_key():
    """The key names the passes, the version and the source digest; a user's CustomGraphPass adds its
    uuid; a user pass Inductor cannot key (plain callable, empty uuid) makes the key None (bypass)."""
    def hook(graph):
        pass

    hook.passes = ("wgrad_early", "runtime_ops")
    own = backend._PostGradPass(hook).uuid()
    assert own == ("moe_compile.post_grad", moe_compile.__version__, backend.source_digest(), hook.passes, None)
    assert isinstance(backend._PostGradPass(hook), CustomGraphPass)
    assert backend._PostGradPass(hook, _UserPass("k1")).uuid()[-1] == "k1"
    assert backend._PostGradPass(hook, _UserPass("k1")).uuid() != backend._PostGradPass(hook, _UserPass("k2")).uuid()
    assert backend._PostGradPass(hook, lambda graph: None).uuid() is None
    assert backend._PostGradPass(hook, _UserPass(None)).uuid() is None


def test_source_digest_covers_every_module_and_its_text(tmp_path):
    """Every .py file of the four packages is hashed, path and text: one changed byte changes it."""
    import importlib
    import pathlib

    files = backend.package_files()
    for name in ("moe_compile", "moe_compile.passes", "moe_compile.lowering", "moe_compile.kernels"):
        for root in importlib.import_module(name).__path__:
            for f in pathlib.Path(root).glob("*.py"):
                assert (name, f) in files, (name, f)
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    one = backend.digest_files([("p", a), ("p", b)])
    a.write_text("x = 2\n")
    assert backend.digest_files([("p", a), ("p", b)]) != one
    a.write_text("x = 1\n")
    assert backend.digest_files([("p", a), ("p", b)]) == one
    assert backend.digest_files([("q", a), ("p", b)]) != one   # the package name is part of it


def test_host_sync_outside_the_region_is_noted():
    """A boolean-mask index outside the MoE region stays in the compiled graph: the rewritten
    region's notes name it; without it, no such note."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, sync):
            super().__init__()
            torch.manual_seed(0)
            self.mlp, self.sync = make_model(spelling="index_add", e=4, k=2), sync

        def forward(self, x):
            y = x + self.mlp(x)
            return y + x[x.sum(-1) > 0].sum() if self.sync else y

    with_sync = moe_compile.explain(Block(True), make_input((2, 5, 16)))
    without = moe_compile.explain(Block(False), make_input((2, 5, 16)))
    assert len(with_sync.rewritten) == 1 and len(without.rewritten) == 1
    note = [n for n in with_sync.rewritten[0].notes if "host syncs left" in n]
    assert note and ("nonzero" in note[0] or "getitem" in note[0]), with_sync.rewritten[0].notes
    assert not any("host syncs" in n for n in without.rewritten[0].notes), without.rewritten[0].notes
