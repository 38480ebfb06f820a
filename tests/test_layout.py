"""The code layout holds (issue 24's done-when): no module in memplan/ over MAX_LINES lines, nor any tracked .py
file in benchmarks/, scripts/ or tests/ (LINE_CHECKED), no function over MAX_PARAMETERS parameters (dataclass
constructors are generated, not written, and so not counted), no import back up the layers
(shared/ENGINEERING.md's layout) and no import circle. Read from the source with `ast`: nothing is imported,
and lazy imports inside functions count as imports."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from subprocess_run import run_watched

import memplan

PACKAGE = Path(memplan.__file__).resolve().parent
MAX_LINES = 400
LINE_CHECKED = ("benchmarks", "scripts", "tests")
"""The folders beside memplan/ whose tracked .py files are held to MAX_LINES too."""
MAX_PARAMETERS = 8
"""Parameters a function takes, `self` / `cls` not counted, `*args` and `**kwargs` one each."""

WIDE_BY_CONTRACT = {
    "memplan.estimator.api.estimate":
        "the public API: keyword arguments with defaults, documented one by one in its docstring",
    "memplan.callback.memory_planner.MemoryPlanner.__init__":
        "the Lightning callback's constructor: LightningCLI reads its signature to check a config's init_args; "
        "the arguments go straight into the frozen PlannerSettings",
    "memplan.estimator.cuda.sdpa.register_cpu_reference_kernels.flash_backward":
        "a CPU kernel for aten::_scaled_dot_product_flash_attention_backward: its parameters are the op's schema",
    "memplan.estimator.cuda.sdpa.register_cpu_reference_kernels.efficient_backward":
        "a CPU kernel for aten::_scaled_dot_product_efficient_attention_backward: its parameters are the op's schema",
}
"""Functions whose parameter list is fixed by a contract outside this codebase, and why."""

LAYERS = (
    {"units", "lazy", "precision", "optimizers", "checkpoint_setting", "batching", "compat", "files", "shapes", "plan"},
    {"hardware"},
    {"estimator"},
    {"truth", "analytic", "demos"},
    {"planner", "config"},
    {"callback"},
    {"commands"},
    {"train", "__main__"},
)
"""memplan's parts from the bottom up: a module imports from its own part, from a lower layer, or (in the
bottom layer only: the shared leaves) from a part beside it."""
API_USERS = {"callback", "commands", "train", "__main__"}
"""The parts that may import `memplan` itself (the public API and __version__, memplan/__init__.py), which
reaches into the layers below them and is in no layer."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _type_checking_only(tree: ast.Module) -> set[int]:
    return {id(node) for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for node in ast.walk(block)}


def _imports(name: str, path: Path) -> set[str]:
    """The memplan modules `name` imports, anywhere in the file (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped = _type_checking_only(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {_owner(m) for m in out if m == "memplan" or m.startswith("memplan.")} - {name, ""}


def _owner(module: str) -> str:
    while module and module not in MODULES:
        module = module.rpartition(".")[0]
    return module


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def _functions(name: str, tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qualified = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield f"{name}.{qualified}", node
            yield from _functions(name, node, qualified + ".")


def test_no_module_is_over_the_line_limit():
    assert len(MODULES) > 100
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concern (one idea per module, named by what it does): {long}"


def _tracked_python_files() -> list[Path]:
    """The .py files git tracks under LINE_CHECKED (as the working tree has them; one deleted there is left out);
    outside a git checkout (an unpacked archive, an sdist) every .py file under them."""
    root = PACKAGE.parent
    if not (root / ".git").exists():
        return sorted(path for folder in LINE_CHECKED for path in (root / folder).rglob("*.py"))
    listed = run_watched(["git", "ls-files", "-z", "--", *LINE_CHECKED], cwd=root, check=True).stdout
    return [root / name for name in listed.split("\0") if name.endswith(".py") and (root / name).is_file()]


def test_no_tracked_python_file_beside_memplan_is_over_the_line_limit():
    files = _tracked_python_files()
    assert {path.relative_to(PACKAGE.parent).parts[0] for path in files} == set(LINE_CHECKED)
    long = {str(path.relative_to(PACKAGE.parent)): n for path in files
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by topic (a reader finds the tests of X by the file name): {long}"


def test_no_function_takes_more_than_the_parameter_limit():
    wide = {}
    for name, path in MODULES.items():
        for qualified, fn in _functions(name, ast.parse(path.read_text(), filename=str(path))):
            if _parameters(fn) > MAX_PARAMETERS and qualified not in WIDE_BY_CONTRACT:
                wide[qualified] = _parameters(fn)
    assert wide == {}, f"pass a frozen dataclass instead: {wide}"


def test_the_contract_exceptions_still_exist_and_are_still_wide():
    found = {q: _parameters(fn) for name, path in MODULES.items()
             for q, fn in _functions(name, ast.parse(path.read_text(), filename=str(path)))}
    assert {q: found.get(q, 0) > MAX_PARAMETERS for q in WIDE_BY_CONTRACT} == dict.fromkeys(WIDE_BY_CONTRACT, True)


def test_every_part_of_memplan_has_a_layer():
    parts = {_part(name) for name in MODULES}
    assert parts - {"__init__"} <= set().union(*LAYERS), parts - set().union(*LAYERS)


def test_no_import_runs_back_up_the_layers():
    upward = {}
    for name, path in MODULES.items():
        part = _part(name)
        for imported in _imports(name, path):
            other = _part(imported)
            if other == part or part == "__init__" or (other == "__init__" and part in API_USERS):
                continue
            if other == "__init__" or (_layer(other) >= _layer(part) and not _layer(other) == _layer(part) == 0):
                upward.setdefault(name, []).append(imported)
    assert upward == {}


def test_no_import_circle():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_the_parser_loads_no_verb_module_s_heavy_work():
    """cli.py imports every verb module to register it: each keeps its own work (tables, NVML, psutil, the
    run logs; torch is checked in tests/commands/test_fast_start.py) out of import time."""
    code = ("import sys\nfrom memplan.commands.cli import build_parser\nbuild_parser()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('rich', 'psutil', 'pynvml')"
            " or m in ('memplan.commands.run_logs', 'memplan.hardware', 'memplan.commands.planning')))\n")
    done = run_watched([sys.executable, "-c", code], check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("source, imported", [
    ("def f():\n    from memplan.commands.cli import main\n", {"memplan.commands.cli"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from memplan.commands import cli\n", set()),
    ("from . import plan\n", {"memplan.plan"}),
])
def test_the_import_reader_sees_lazy_imports_and_skips_type_only_ones(tmp_path, source, imported):
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert _imports("memplan.probe", path) == imported
