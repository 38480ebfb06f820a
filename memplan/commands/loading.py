"""Loading a config for a command: memplan.config.load_config, its deprecations said once as warning lines."""
from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any


def load_config_for_command(path: str, *, before_print: Callable[[], None] | None = None, quiet: bool = False) -> Any:
    """load_config(path) with each deprecation (a top-level `memplan:` section) printed to stderr as one
    `memplan: warning: ...` line instead of Python's warning format; `before_print` clears a progress line
    first; `quiet` prints nothing (a child process whose parent already said it)."""
    from memplan.config import load_config
    from memplan.config.placement import SettingsDeprecation

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SettingsDeprecation)
        loaded = load_config(path)
    for line in () if quiet else loaded.deprecations:
        if before_print is not None:
            before_print()
        print(f"memplan: warning: {line}", file=sys.stderr)
    return loaded
