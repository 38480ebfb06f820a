"""Where MemoryPlanner(plan=PATH) finds a plan file: a relative PATH is looked for beside the config
LightningCLI was given first, then in the working directory.

`memplan suggest --output planned.yaml` names the plan in the planned config by a path relative to
the config's folder (`plan: planned.plan.json`), so the pair can be moved or copied together. The
callback is built by LightningCLI from that config, which does not tell it where the config was: the
config files are read from the command line that started training (`fit --config FILE`, `-c FILE`,
`--config=FILE`), as LightningCLI read them. Absolute paths (plans written before) are read as they are.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

CONFIG_FLAGS = ("--config", "-c")
"""LightningCLI's flags for a config file (jsonargparse's ActionConfigFile), at any subcommand."""


def config_files(argv: Sequence[str] | None = None) -> list[Path]:
    """The config files named on the command line (`argv`, default sys.argv), last given first."""
    argv = sys.argv[1:] if argv is None else argv
    found = []
    for i, arg in enumerate(argv):
        value = None
        if arg in CONFIG_FLAGS and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
        if value and Path(value).is_file():
            found.append(Path(value))
    return found[::-1]


def plan_candidates(plan: str | os.PathLike, argv: Sequence[str] | None = None) -> list[Path]:
    """Where a plan file named `plan` may be, in the order looked at: as given when absolute; else beside
    each config on the command line, then in the working directory."""
    path = Path(plan)
    if path.is_absolute():
        return [path]
    beside = [config.parent / path for config in config_files(argv)]
    return list(dict.fromkeys([*beside, path]))


def find_plan_file(plan: str | os.PathLike, argv: Sequence[str] | None = None) -> tuple[Path, list[Path]]:
    """(the first candidate that exists, else the last; every candidate looked at)."""
    candidates = plan_candidates(plan, argv)
    return next((c for c in candidates if c.exists()), candidates[-1]), candidates
