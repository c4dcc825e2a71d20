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
                                    "worker.lora.slot_table", "worker.lora.host_cache",
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
