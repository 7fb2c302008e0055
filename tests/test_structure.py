"""The package's shape: no import cycle (imports inside functions count too) and no module over 500 lines.

Package directories are mapped as installed (pyproject.toml): moe_compile/ -> moe_compile,
passes/ -> moe_compile.passes, lowering/ -> moe_compile.lowering, kernels/ -> moe_compile.kernels.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"moe_compile": "moe_compile", "passes": "moe_compile.passes", "lowering": "moe_compile.lowering",
            "kernels": "moe_compile.kernels"}
MAX_LINES = 500


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for directory, package in PACKAGES.items():
        for path in sorted((ROOT / directory).glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t not in PACKAGES.values():
                found.add(t)
    return found


def test_no_import_cycle():
    mods = _modules()
    graph = {name: _imports(name, path, set(mods)) for name, path in mods.items()}
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [n, m]))
            if m not in state:
                visit(m, stack + [n])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])


def test_no_module_over_500_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
