"""Names a package exports but imports only when first used (PEP 562), so importing the package costs
nothing until a name is read: `memplan.config`, `memplan.estimator` and `memplan.compat` use it to refuse a
bad config or report a version before torch or Lightning is imported.

    _LAZY = {"estimate": "memplan.estimator.api", ...}
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, table: Mapping[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`: a name of `table` (name -> the module
    defining it) is imported from its module the first time it is read, then kept in `namespace` (the
    package's globals()), so it is looked up once."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *table])

    return __getattr__, __dir__
