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
from torch._dynamo.utils import counters
from helpers import WithExtra, check_compiled, make_input
import moe_compile

torch.set_num_threads(1)
model = WithExtra(lambda x: x[x.sum(-1) > 0].sum())
with moe_compile.records.recording() as graphs:   # what this compile (Inductor, the caches) published
    check_compiled(model, (make_input((2, 5, 16)),), expect_rewritten=1, inductor=True, fresh_inputs=1)
regions = [r for g in graphs for r in g]
print("RESULT " + json.dumps({"inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"]),
                              "notes": [list(r.notes) for r in regions], "ops": [list(r.ops) for r in regions]}))
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
    assert len(cold["notes"]) == 1 and warm["notes"] == cold["notes"] and warm["ops"] == cold["ops"], (cold, warm)
    assert any("host syncs left" in n for n in cold["notes"][0]), cold["notes"]


class _UserPass(CustomGraphPass):
    def __init__(self, key):
        self.key = key

    def __call__(self, graph):
        pass

    def uuid(self):
        return self.key


def test_post_grad_pass_key():
    """The key names the passes, the version and the source digest; user passes Inductor cannot run
    in a list (an older Inductor) run inside ours and add their uuids; one Inductor cannot key (plain
    callable, empty uuid) makes the key None (bypass)."""
    def hook(graph):
        pass

    hook.passes = ("wgrad_early", "runtime_ops")
    own = backend._PostGradPass(hook).uuid()
    assert own == ("moe_compile.post_grad", moe_compile.__version__, backend.source_digest(), hook.passes, ())
    assert isinstance(backend._PostGradPass(hook), CustomGraphPass)
    assert backend._PostGradPass(hook, (_UserPass("k1"),)).uuid()[-1] == ("k1",)
    assert backend._PostGradPass(hook, (_UserPass("k1"),)).uuid() != backend._PostGradPass(hook, (_UserPass("k2"),)).uuid()
    assert backend._PostGradPass(hook, (lambda graph: None,)).uuid() is None
    assert backend._PostGradPass(hook, (_UserPass(None),)).uuid() is None


def _spy_patches(monkeypatch) -> list:
    """Record the config_patches the backend hands to Inductor's compile_fx."""
    import torch._inductor.compile_fx as cfx

    seen, real = [], cfx.compile_fx

    def spy(gm, inputs, *args, config_patches=None, **kwargs):
        seen.append(dict(config_patches or {}))
        return real(gm, inputs, *args, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    return seen


def _installed(patches) -> list:
    p = patches["post_grad_custom_post_pass"]
    return list(p) if isinstance(p, (list, tuple)) else [p]


def test_key_installed_with_every_post_grad_pass_disabled(monkeypatch):
    """moe.disable naming every post_grad pass still installs the keyed pass: the source digest stays in
    the key of graphs whose fake functions and autograd formulas come from this package."""
    seen = _spy_patches(monkeypatch)
    torch._dynamo.reset()
    opts = {"moe.disable": ("wgrad_early", "ep_overlap", "runtime_ops")}
    compiled = torch.compile(make_model(spelling="index_add", e=4, k=2), backend="moe", options=opts)
    compiled(make_input((2, 5, 16))).sum().backward()
    assert seen, "compile_fx was not called"
    ours = [p for p in _installed(seen[0]) if isinstance(p, backend._PostGradPass)]
    assert len(ours) == 1 and ours[0].uuid()[2] == backend.source_digest() and ours[0].uuid()[3] == (), ours


class _CountingPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "counting"


def test_user_passes_run_from_options_lists_and_the_global_config(monkeypatch, no_compile_cache):
    """The user's post_grad_custom_post_pass runs before ours, whether it comes from the options (one
    pass or a list) or from torch._inductor.config; outputs and gradients still match eager."""
    from helpers import check_compiled

    one, a, b, glob = _CountingPass(), _CountingPass(), _CountingPass(), _CountingPass()
    model, x = make_model(spelling="index_add", e=4, k=2), make_input((2, 5, 16))
    check_compiled(model, (x,), expect_rewritten=1, inductor=True, options={"post_grad_custom_post_pass": one})
    check_compiled(model, (x,), expect_rewritten=1, inductor=True, options={"post_grad_custom_post_pass": [a, b]})
    with torch._inductor.config.patch(post_grad_custom_post_pass=glob):
        check_compiled(model, (x,), expect_rewritten=1, inductor=True)
    assert one.calls >= 2 and a.calls >= 2 and b.calls >= 2 and glob.calls >= 2, (one.calls, a.calls, b.calls, glob.calls)
    from torch._inductor import custom_graph_pass

    if hasattr(custom_graph_pass, "CustomInferenceAwareGraphPass"):   # torch >= 2.12: called with is_inference
        class Aware(custom_graph_pass.CustomInferenceAwareGraphPass):
            seen: list = []

            def __call__(self, graph, is_inference):
                self.seen.append(is_inference)

            def uuid(self):
                return "aware"

        check_compiled(model, (x,), expect_rewritten=1, inductor=True, options={"post_grad_custom_post_pass": Aware()})
        assert Aware.seen and False in Aware.seen, Aware.seen   # the training graphs: is_inference=False


def test_user_passes_run_inside_ours_where_inductor_takes_no_list(monkeypatch, no_compile_cache):
    """torch 2.11's Inductor takes one pass, not a list (no ``get_custom_graph_passes``): the user's
    passes (one or a list) then run inside ours, before it; outputs and gradients match eager."""
    from helpers import check_compiled

    monkeypatch.setattr(backend, "_inductor_takes_pass_lists", lambda: False)
    seen = _spy_patches(monkeypatch)
    a, b = _CountingPass(), _CountingPass()
    model, x = make_model(spelling="index_add", e=4, k=2), make_input((2, 5, 16))
    check_compiled(model, (x,), expect_rewritten=1, inductor=True, options={"post_grad_custom_post_pass": [a, b]})
    installed = seen[0]["post_grad_custom_post_pass"]
    assert isinstance(installed, backend._PostGradPass) and installed.user == (a, b), installed
    assert installed.uuid()[-1] == ("counting", "counting")
    assert a.calls >= 2 and b.calls >= 2, (a.calls, b.calls)


def test_user_pass_inductor_cannot_key_bypasses_the_cache(monkeypatch):
    """A plain callable as the user's pass: Inductor bypasses its FX graph cache (as it would for the
    user's pass without us); the pass still runs."""
    from torch._dynamo.utils import counters

    calls = []
    torch._dynamo.reset()
    counters["inductor"].clear()
    opts = {"post_grad_custom_post_pass": lambda graph: calls.append(1)}
    torch.compile(make_model(spelling="index_add", e=4, k=2), backend="moe", options=opts)(
        make_input((2, 5, 16))).sum().backward()
    assert calls and counters["inductor"]["fxgraph_cache_bypass"] >= 1, (calls, dict(counters["inductor"]))


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
    assert files and backend.source_digest() == backend.digest_files(files) != backend.digest_files([])


def test_host_sync_outside_the_region_is_noted():
    """A boolean-mask index outside the MoE region stays in the compiled graph: the rewritten
    region's notes name it; without it, no such note."""
    note = _sync_notes(lambda x: x[x.sum(-1) > 0].sum())
    assert note and "getitem (boolean mask) x1" in note[0], note
    assert _sync_notes(lambda x: x.sum()) == []


def _sync_notes(extra) -> list:
    from helpers import WithExtra

    rep = moe_compile.explain(WithExtra(extra), make_input((2, 5, 16)))
    assert len(rep.rewritten) == 1, str(rep)
    return [n for n in rep.rewritten[0].notes if "host syncs" in n]


def test_host_syncs_inside_checkpoint_and_repeat_interleave():
    """A boolean mask inside activation checkpointing is found in its subgraph (and named, not the
    checkpoint op); repeat_interleave with int repeats is no sync, with tensor repeats it is."""
    from torch.utils.checkpoint import checkpoint

    inside = _sync_notes(lambda x: checkpoint(lambda t: t[t.sum(-1) > 0].sum(), x, use_reentrant=False))
    assert inside and "getitem (boolean mask) x1" in inside[0] and "checkpoint" not in inside[0], inside
    assert _sync_notes(lambda x: x.repeat_interleave(2, dim=0).sum()) == []
    reps = _sync_notes(lambda x: x.flatten(0, -2).repeat_interleave((x.flatten(0, -2)[:, 0] > 0).long() + 1, dim=0).sum())
    assert reps and "repeat_interleave x1" in reps[0], reps
