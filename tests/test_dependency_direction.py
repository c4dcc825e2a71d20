"""The import rules of docs/ARCHITECTURE.md: bookkeeping imports no model code, and no production module
imports the benchmarks."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_after(module: str) -> set[str]:
    """The modules a fresh interpreter holds after `import module`."""
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(result.stdout.split())


@pytest.mark.parametrize("module", ["worker.scheduler.scheduler", "worker.lora.prefetcher",
                                    "worker.lora.slot_table", "worker.lora.host_cache", "worker.lora.targets",
                                    "worker.kv_cache.block_allocator", "worker.kv_cache.prefix_cache",
                                    "worker.batch"])
def test_bookkeeping_imports_no_model_code_and_no_torch(module):
    model_code = sorted(m for m in imported_after(module)
                        if m == "torch" or m.startswith(("worker.layers", "worker.kernels", "worker.models",
                                                         "worker.model_runner", "torch.")))
    assert model_code == []


def imports_of(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("package", ["gateway", "worker"])
def test_production_code_never_imports_the_benchmarks(package):
    offenders = [str(path.relative_to(ROOT)) for path in sorted((ROOT / package).rglob("*.py"))
                 if any(m == "bench" or m.startswith("bench.") for m in imports_of(path))]
    assert offenders == []


def package_of(module: str, root: str) -> str:
    """`worker.lora.slot_table` -> `worker.lora`; a module directly in `root` (`worker.engine`) is its own node."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def package_imports(root: str) -> dict[str, dict[str, str]]:
    """package -> {package it imports: one module that does}, for every import in the tree under `root`
    (function-level and TYPE_CHECKING imports included: a loop is a loop however it is hidden)."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted((ROOT / root).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        source = package_of(module, root)
        for imported in imports_of(path):
            if imported == root or not imported.startswith(root + "."):
                continue
            target = package_of(imported, root)
            if target != source:
                graph.setdefault(source, {}).setdefault(target, module)
    return graph


def find_loop(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One import loop of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (loop := visit(nxt)):
                return loop
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (loop := visit(node)):
            return loop
    return None


def test_find_loop_sees_a_loop_through_three_packages():
    graph = {"w.a": {"w.b": "w.a.x"}, "w.b": {"w.c": "w.b.y"}, "w.c": {"w.a": "w.c.z"}, "w.d": {"w.a": "w.d.q"}}
    assert find_loop(graph) == ["w.a", "w.b", "w.c", "w.a"]
    del graph["w.c"]
    assert find_loop(graph) is None


@pytest.mark.parametrize("root", ["worker", "gateway"])
def test_no_package_level_import_loop(root):
    graph = package_imports(root)
    loop = find_loop(graph)
    where = [f"{a} -> {b} (in {graph[a][b]})" for a, b in zip(loop, loop[1:])] if loop else []
    assert loop is None, "import loop: " + "; ".join(where)
