"""Run the test suite while other processes keep every CPU core busy: the suite must pass under load.

    .venv/bin/python scripts/stress_tests.py                 # the README's test command, twice in a row
    .venv/bin/python scripts/stress_tests.py --runs 1 -- -x tests/callback   # arguments after -- go to pytest

One burner per usable core (a Python loop, at the suite's own priority, like `stress --cpu N`) runs from
before the first run until the last ends; each run's wall time, exit status and the load average are
printed, and the script exits with the first failing run's status. Tests that start subprocesses name a
hang by lack of CPU progress (tests/subprocess_run.py), so a slow run under load is not a failure."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BURN = "while True:\n    pass\n"


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="how many times to run the suite in a row (default 2)")
    parser.add_argument("--burners", type=int, default=len(os.sched_getaffinity(0)),
                        help="CPU-burning processes to run beside it (default: one per usable core)")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest after `--` (default: the README's -q -n 2 tests)")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args or ["-q", "-n", "2", "tests"]
    python = ROOT / ".venv" / "bin" / "python"
    command = [str(python if python.exists() else sys.executable), "-m", "pytest", *pytest_args]

    burners = [subprocess.Popen([sys.executable, "-c", BURN], start_new_session=True) for _ in range(args.burners)]
    status = 0
    try:
        time.sleep(2)  # the burners are running before the suite starts
        print(f"stress_tests: {args.burners} CPU burners on {len(os.sched_getaffinity(0))} usable cores; "
              f"load {_load()}; running: {' '.join(command)}", flush=True)
        for run in range(1, args.runs + 1):
            started = time.monotonic()
            code = subprocess.call(command, cwd=ROOT)
            minutes = (time.monotonic() - started) / 60
            print(f"stress_tests: run {run}/{args.runs}: exit {code} in {minutes:.1f} min under load "
                  f"(load average {_load()})", flush=True)
            if code != 0 and status == 0:
                status = code
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    return status


if __name__ == "__main__":
    sys.exit(main())
