"""Run `memplan ARGV...` in a fresh interpreter and report which heavy modules it imported: what the
fast-start and fast-refusal tests check (a command that needs no torch must not import it)."""
import os
import sys
from pathlib import Path

from subprocess_run import run_watched

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import runpy, sys
sys.argv = ["memplan", *sys.argv[1:]]
try:
    runpy.run_module("memplan", run_name="__main__")
except SystemExit as done:
    code = done.code
print("MODULES", [m for m in {heavy!r} if m in sys.modules], "CODE", code, file=sys.stderr)
"""


def modules_imported(argv: list[str], heavy: tuple[str, ...]) -> tuple[list[str], int, str, str]:
    """(the modules of `heavy` that `memplan *argv` imported, its exit code, its stdout, its stderr)."""
    # the repository first; then what the suite gives every child (tests/child_site.py: torchmetrics, should a command
    # import Lightning, then imports no transformers, whose own modules a command would still find)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = run_watched([sys.executable, "-c", PROBE.format(heavy=heavy), *argv], env=env, cwd=ROOT)
    line = next(line for line in done.stderr.splitlines() if line.startswith("MODULES"))
    modules, code = line.removeprefix("MODULES ").rsplit(" CODE ", 1)
    return eval(modules), int(code), done.stdout, done.stderr  # noqa: S307  (our own probe's list)
