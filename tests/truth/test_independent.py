"""The truth is independent of what it checks: nothing in memplan.estimator imports memplan.truth."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

from subprocess_run import run_watched

import memplan.estimator

ESTIMATOR = Path(memplan.estimator.__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    """Every module an `import` / `from ... import` anywhere in the file names (lazy imports included),
    and every string literal naming a memplan.truth module (importlib.import_module("...") and the like)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                package = ["memplan", *path.relative_to(ESTIMATOR.parent).parent.parts]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("memplan.truth"):
            names.add(node.value)
    return names


def test_no_estimator_module_imports_the_truth():
    files = sorted(ESTIMATOR.rglob("*.py"))
    assert len(files) > 10
    offenders = {
        str(f.relative_to(ESTIMATOR.parent)): sorted(n for n in _imported_modules(f)
                                                     if n == "memplan.truth" or n.startswith("memplan.truth."))
        for f in files
    }
    assert {f: n for f, n in offenders.items() if n} == {}


def test_the_check_sees_a_lazy_import(tmp_path):
    lazy = ESTIMATOR / "_probe_lazy_import_for_test.py"
    lazy.write_text("def f():\n    from memplan.truth.measure import measure_cpu_peak\n    return measure_cpu_peak\n")
    try:
        assert "memplan.truth.measure" in _imported_modules(lazy)
    finally:
        lazy.unlink()


def test_an_estimate_loads_no_truth_module():
    code = (
        "import sys, torch\n"
        "from torch import nn\n"
        "from memplan.estimator.api import estimate\n"
        "estimate(lambda: nn.Linear(8, 2), (torch.randn(4, 8),), loss=lambda m, b: m(b[0]).sum(), device='cpu')\n"
        "print(sorted(m for m in sys.modules if m.startswith('memplan.truth')))\n"
    )
    out = run_watched([sys.executable, "-c", code], check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
