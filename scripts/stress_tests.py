"""Run the test suite while other processes keep every CPU core busy: the suite must pass under load.

    .venv/bin/python scripts/stress_tests.py                 # the README's test command, twice in a row
    .venv/bin/python scripts/stress_tests.py --runs 1 -- -x tests/callback   # arguments after -- go to pytest

One burner per usable core (a Python loop, at the suite's own priority, like `stress --cpu N`) runs from
before the first run until the last ends; each run's wall time, exit status and the load average are
printed (and, with --record, written to benchmarks/results/test_suite_time.json for a quiet run, `--burners 0`, or
to benchmarks/results/test_suite_stress.json under load, with the commit it ran on, rewritten after each run so an
interrupted session keeps the runs that finished; README quotes the quiet one), and
the script exits with the first failing run's status. `--burners 0` times the suite on a quiet machine. Tests that start subprocesses name a
hang by lack of CPU progress (tests/subprocess_run.py), so a slow run under load is not a failure."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "test_suite_time.json"
STRESS_RESULTS = ROOT / "benchmarks" / "results" / "test_suite_stress.json"
BURN = "while True:\n    pass\n"


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def _run(command: list[str]) -> tuple[int, dict[str, int], list[float]]:
    """Run pytest, its output passed through; its exit status, its summary's counts ("passed", "skipped",
    ...) and the 1-minute load averages read while it ran."""
    loads, counts = [_load1()], {}
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as suite:
        for line in suite.stdout:
            sys.stdout.write(line)
            loads.append(_load1())
            if re.match(r"=* ?\d+ passed", line) or re.match(r"\d+ (passed|failed)", line):
                counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line)}
    return suite.returncode, counts, loads


def _load1() -> float:
    try:
        return float(_load().split()[0])
    except ValueError:  # no /proc/loadavg
        return 0.0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _commit() -> str:
    """The commit the suite ran on (with "+changes" where the work tree differs from it), or "unknown"."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def _record(burners: int, command: list[str], runs: list[dict], *, of: int) -> None:
    """Write the finished `runs` (of `of` asked for) to RESULTS (quiet) or STRESS_RESULTS (with burners), atomically."""
    path = STRESS_RESULTS if burners else RESULTS
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": _commit(),
        "cpu_model": _cpu_model(), "usable_cores": len(os.sched_getaffinity(0)), "burners": burners,
        "command": " ".join(["python", *command[1:]]), "runs_asked": of, "runs": runs,
    }, indent=2) + "\n")
    temporary.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="how many times to run the suite in a row (default 2)")
    parser.add_argument("--burners", type=int, default=len(os.sched_getaffinity(0)),
                        help="CPU-burning processes to run beside it (default: one per usable core)")
    parser.add_argument("--record", action="store_true",
                        help=f"write the runs to {RESULTS.relative_to(ROOT)} (quiet) or "
                        f"{STRESS_RESULTS.relative_to(ROOT)} (with burners)")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest after `--` (default: the README's -q -n 2 tests)")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args or ["-q", "-n", "2", "tests"]
    python = ROOT / ".venv" / "bin" / "python"
    command = [str(python if python.exists() else sys.executable), "-m", "pytest", *pytest_args]

    burners = [subprocess.Popen([sys.executable, "-c", BURN], start_new_session=True) for _ in range(args.burners)]
    status, runs = 0, []
    try:
        time.sleep(2)  # the burners are running before the suite starts
        print(f"stress_tests: {args.burners} CPU burners on {len(os.sched_getaffinity(0))} usable cores; "
              f"load {_load()}; running: {' '.join(command)}", flush=True)
        for run in range(1, args.runs + 1):
            started, cpu_before, load_before = time.monotonic(), _children_cpu_s(), _load()
            code, counts, loads = _run(command)
            minutes = (time.monotonic() - started) / 60
            cpu_minutes = (_children_cpu_s() - cpu_before) / 60  # the suite's processes, burners apart
            print(f"stress_tests: run {run}/{args.runs}: exit {code} in {minutes:.1f} min, {cpu_minutes:.1f} "
                  f"CPU-min (load average {_load()})", flush=True)
            runs.append({"exit": code, **counts, "wall_minutes": round(minutes, 2), "cpu_minutes": round(cpu_minutes, 2),
                         "load_before": load_before, "load_after": _load(),
                         "load_range": f"{min(loads):.0f}-{max(loads):.0f}"})
            if code != 0 and status == 0:
                status = code
            if args.record:  # after every run: a session that ends before the last keeps the runs that finished
                _record(args.burners, command, runs, of=args.runs)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    return status


if __name__ == "__main__":
    sys.exit(main())
