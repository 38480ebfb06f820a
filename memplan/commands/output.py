"""`memplan suggest --output`: the planned config and its plan file, checked before anything is traced
(never over the source config, never over an existing file without --force) and written whole."""
from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from memplan.commands.args import UsageError


PIPED_WIDTH = 240
"""Columns a table may take when output is piped or redirected (there is no terminal width to fit)."""


def console() -> Any:
    """The rich Console a command prints through: on a terminal, rich's own (fitted to its width); piped or
    redirected, lines are not wrapped (a sentence stays on one line for grep and for a log file) and tables
    are laid out up to PIPED_WIDTH columns instead of rich's 80."""
    from rich.console import Console

    if sys.stdout.isatty():
        return Console()
    return Console(soft_wrap=True, width=PIPED_WIDTH)


def check_output(output: str, config: str, *, force: bool) -> None:
    """--output, before anything is traced: not the source config, not a folder, files to replace only with --force."""
    from memplan.config.write import OutputExists, existing_outputs, plan_path_for

    path = Path(output)
    if path.name.endswith(".plan.json"):
        stem = path.name[: -len(".plan.json")] or "planned"
        raise UsageError(f"--output {output} names a plan file; --output names the planned config (YAML), and the "
                         f"plan goes beside it: pass --output {path.with_name(stem + '.yaml')}")
    if path.is_dir():
        raise UsageError(f"--output {output} is a folder; name the planned config file, e.g. {path / 'planned.yaml'}")
    if Path(config).exists() and path.resolve() == Path(config).resolve():
        raise UsageError(f"--output {output} is the source config; write the planned config to another file")
    if plan_path_for(path).resolve() == Path(config).resolve():
        raise UsageError(f"--output {output} would put its plan file over the source config {config}; "
                             "choose another --output")
    existing = existing_outputs(path)
    if existing and not force:
        raise OutputExists(existing)
    folder = next(p for p in path.resolve().parents if p.exists())
    if not folder.is_dir():
        raise UsageError(f"--output {output}: {folder} is a file, not a folder; choose another --output")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--output {output}: cannot write in {folder}; choose a folder you can write to")


def write_output(loaded, plan, output: str, *, force: bool, stream) -> None:
    """Write the planned config and plan file; say so on `stream` (stderr under --json, so stdout stays JSON)."""
    from memplan.config import plan_path_for, planner_callback, torchrun_command, write_planned_config

    has_lightning = importlib.util.find_spec("pytorch_lightning") is not None
    callback = planner_callback(plan_path_for(output), config_path=output) if has_lightning else None
    try:
        write_planned_config(loaded, plan, output, callback=callback, force=force)
    except FileExistsError:
        raise
    except OSError as err:  # a folder access() let through (root, /proc, a full disk): name --output, not a temp file
        raise OSError(f"--output {output}: cannot write in {Path(output).resolve().parent} "
                      f"({err.strerror or err}); choose a folder you can write to") from err
    print(f"wrote {output} and {plan_path_for(output)}", file=stream)
    print("launch with: " + " ".join(shlex.quote(a) if "$" not in a else a
                                     for a in torchrun_command(plan, Path(output).resolve())), file=stream)
