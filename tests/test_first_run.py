"""A fresh install's first run prints no warning: numpy is a dependency (torch warns on import without
it), and compiling and explaining an MoE model that the backend rewrites logs nothing."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import re
import textwrap

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MOE_COMPILE_DEBUG", "TORCH_LOGS", "PYTHONWARNINGS", "TORCHDYNAMO_VERBOSE")}
    env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=str(ROOT))


def test_numpy_is_a_dependency():
    """torch imports without numpy but warns on every `import torch`: numpy is declared."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.M | re.S).group(1)
    assert re.search(r"[\"']numpy[\"'<>=~! ]", deps), deps
    r = _run("""
        import sys
        sys.modules["numpy"] = None          # as on an install without numpy
        import torch
    """)
    assert r.returncode == 0, r.stderr
    assert "Failed to initialize NumPy" in r.stderr, "torch no longer warns without numpy: the dependency may go"


def test_first_run_prints_no_warning():
    r = _run("""
        import torch
        import moe_compile
        from helpers import make_model, make_input
        m = make_model(spelling="index_add", e=4, k=2)
        x = make_input((2, 5, 16))
        print(moe_compile.explain(m, x))
        cm = torch.compile(m, backend="moe")             # default options: Inductor
        y = cm(x)
        y.sum().backward()
        torch.testing.assert_close(y, m(x))
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
    # torch's own line when a CUDA build of torch compiles C++ on a machine without a GPU (the GPU
    # image's torch 2.11 run on the CPU, README): not ours, and nothing else may be printed
    ours = [line for line in r.stderr.splitlines() if line.strip() and not
            (_TORCH_CPP_EXTENSION in line and "No CUDA runtime is found" in line)]
    assert not ours, r.stderr[-3000:]


_TORCH_CPP_EXTENSION = "torch/utils/cpp_extension.py"
