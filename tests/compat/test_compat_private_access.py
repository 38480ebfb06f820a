"""No module of memplan outside memplan/compat/ uses a private torch or Lightning name.

The scan reads memplan's source (AST, nothing imported) and reports, with file and line:
- an import from a private module (`torch._subclasses`, `torch.utils._pytree`) or of a private name;
- a private part in an attribute chain that starts at a torch/Lightning module or a name imported from
  one (`torch._C._foo`, `nn.Module._apply`, `torch.nn.modules.batchnorm._BatchNorm`);
- `obj._name` on any other object (and `getattr(obj, "_name")`), where `_name` is a private attribute of
  torch's or Lightning's objects (read from the installed packages) or one memplan does not define itself;
- a string naming a private torch module (`"torch._subclasses.fake_tensor"`), or a private attribute of
  torch's or Lightning's objects (`"_compiled_call_impl"`).
ATen operator names (`torch.ops.aten._softmax`, `"_scaled_dot_product_flash_attention"`) are the
dispatcher's operator registry, not Python private attributes; kernel rules key on them, so they stay
where the rules are.
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2] / "memplan"
COMPAT = ROOT / "compat"
PACKAGES = frozenset({"torch", "pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics"})
ALLOWED = {
    "_fields": "namedtuple's documented API (the underscore keeps it apart from field names), not torch's",
}
"""Private-looking names that are not torch's or Lightning's private API, with the reason."""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@cache
def foreign_private_names() -> frozenset[str]:
    """The private attribute names of the torch and Lightning objects memplan handles, as installed."""
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)
    linear = torch.nn.Linear(1, 1)
    objects = [torch.Tensor, torch.zeros(1), torch.nn.Parameter(torch.zeros(1)), linear, torch.nn.Module,
               torch.UntypedStorage, torch.ops.aten.mm, torch.ops.aten.mm.default,
               torch.optim.SGD(linear.parameters(), lr=0.1), pl.LightningModule(), trainer, trainer.fit_loop,
               trainer.fit_loop.epoch_loop, trainer.fit_loop.epoch_loop.automatic_optimization,
               trainer.strategy, DDPStrategy(), trainer._signal_connector, trainer._logger_connector]
    names = {n for o in objects for n in [*dir(o), *getattr(o, "__dict__", {})] if _private(n)}
    return frozenset(n for n in names if not hasattr(torch.ops.aten, n))  # ATen operator names stay


def own_names(files: list[Path]) -> frozenset[str]:
    """Names memplan defines: functions, classes, module and class variables, `self._x = ...`."""
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                  and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
                  and isinstance(node.args[1], ast.Constant)):
                names.add(node.args[1].value)
    return frozenset(names)


def _module_bindings(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted torch/Lightning path it stands for (imports, and `aten = torch.ops.aten`)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] in PACKAGES:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for _ in range(2):  # aliases of aliases
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                path = _dotted(node.value, bound)
                if path is not None:
                    bound[node.targets[0].id] = path
    return bound


def _dotted(node: ast.AST, bound: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in bound:
        return ".".join([bound[node.id], *reversed(parts)])
    return None


def _private_part(path: str) -> str | None:
    """The path up to its first private part, or None; an ATen operator's name (torch.ops.<ns>.<op>) is not one."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if _private(part) and not (parts[:2] == ["torch", "ops"] and i == 3):
            return ".".join(parts[:i + 1])
    return None


def scan(source: str, own: frozenset[str], foreign: frozenset[str]) -> list[tuple[int, str]]:
    """(line, what) for each private torch/Lightning name `source` uses."""
    tree = ast.parse(source)
    bound = _module_bindings(tree)
    found: set[tuple[int, str]] = set()

    def foreign_attribute(name: str) -> bool:
        if not _private(name) or name in ALLOWED or name.startswith("_memplan"):  # memplan marks objects with _memplan_*
            return False
        return name in foreign or name not in own

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES and _private_part(alias.name):
                    found.add((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] in PACKAGES:
            for alias in node.names:
                hit = _private_part(f"{node.module}.{alias.name}")
                if hit:
                    found.add((node.lineno, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            path = _dotted(node, bound)
            if path is not None:
                hit = _private_part(path)
                if hit:
                    found.add((node.lineno, hit))
            elif not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") and node.attr in own) \
                    and foreign_attribute(node.attr) and _dotted(node.value, bound) is None \
                    and not _rooted_elsewhere(node.value, tree):
                found.add((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and foreign_attribute(node.args[1].value)):
            found.add((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text.split(".")[0] in PACKAGES and "." in text and " " not in text and _private_part(text):
                found.add((node.lineno, repr(text)))
            elif text in foreign and text not in own:
                found.add((node.lineno, repr(text)))
    return sorted(found)


def _rooted_elsewhere(node: ast.AST, tree: ast.AST) -> bool:
    """Whether an attribute chain starts at a module imported from outside torch/Lightning (`os._exit`)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    if not isinstance(node, ast.Name):
        return False
    return any(isinstance(n, ast.Import) and any((a.asname or a.name.split(".")[0]) == node.id for a in n.names)
               for n in ast.walk(tree))


def memplan_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if COMPAT not in p.parents)


@cache
def memplan_own_names() -> frozenset[str]:
    return own_names(memplan_files())


def test_no_private_torch_or_lightning_name_outside_compat():
    files = memplan_files()
    own, foreign = memplan_own_names(), foreign_private_names()
    found = [f"{path.relative_to(ROOT.parent)}:{line}: {what}"
             for path in files for line, what in scan(path.read_text(), own, foreign)]
    assert not found, ("private torch / Lightning names outside memplan/compat/: move each behind a name in "
                       "memplan/compat/<package>.py that says the versions it is known for\n" + "\n".join(found))


@pytest.mark.parametrize(("line", "expected"), [
    ("from torch._subclasses.fake_tensor import FakeTensor", "from torch._subclasses.fake_tensor import FakeTensor"),
    ("from torch.utils._python_dispatch import _disable_current_modes",
     "from torch.utils._python_dispatch import _disable_current_modes"),
    ("import torch\nx = torch._C._current_autograd_node()", "torch._C"),
    ("from torch import nn\nf = nn.Module._apply", "torch.nn.Module._apply"),
    ("import torch.nn as tnn\nb = tnn.modules.batchnorm._BatchNorm", "torch.nn.modules.batchnorm._BatchNorm"),
    ("def f(trainer):\n    return trainer.fit_loop._data_source", "trainer.fit_loop._data_source"),
    ("def f(m):\n    return m._parameters", "m._parameters"),
    ("def f(t):\n    return getattr(t, '_local_tensor', t)", "getattr(..., '_local_tensor')"),
    ("import logging\nlogging.getLogger('torch._subclasses.fake_tensor')", "'torch._subclasses.fake_tensor'"),
    ("DROPPED = {'_compiled_call_impl'}", "'_compiled_call_impl'"),
])
def test_the_scan_finds_each_kind_of_private_use(line, expected):
    own = memplan_own_names()
    assert [what for _, what in scan(line, own, foreign_private_names())] == [expected]


@pytest.mark.parametrize("line", [
    "import torch\nop = torch.ops.aten._softmax.default",  # an ATen operator, by name
    "import torch\naten = torch.ops.aten\nop = aten._log_softmax.default",
    "OPS = {'_scaled_dot_product_flash_attention', '_to_copy'}",
    "import os\nos._exit(1)",  # not torch's
    "def f(point):\n    return point._fields",  # namedtuple's (ALLOWED)
    "def f(m):\n    return getattr(m, '_memplan_checkpointed', False)",  # memplan's own mark
    "import torch\nv = torch.__version__",
    "from memplan.compat.torch import disable_current_modes",
])
def test_the_scan_leaves_public_and_non_torch_names_alone(line):
    assert scan(line, memplan_own_names(), foreign_private_names()) == []
