"""CPU seconds per test and per test file: the suite's cost measured in CPU time, which other jobs on the
machine do not inflate the way they inflate wall time.

As a pytest plugin it writes one JSON line per test (CPU seconds of the test process and of the child
processes it waited for, wall seconds) to a file per process under CPU_PER_TEST_OUT (default
./cpu-per-test); run on its own it sums a folder of those files by test file and lists the costliest tests:

    PYTHONPATH=scripts CPU_PER_TEST_OUT=/tmp/cpu .venv/bin/python -m pytest -q -n 2 -p cpu_per_test tests
    .venv/bin/python scripts/cpu_per_test.py /tmp/cpu [--top 40]

A test's time includes its fixtures' setup (a module-scoped fixture counts in the first test that uses it)
and the imports it is first to make in its process."""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections import defaultdict
from pathlib import Path

_out = None


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _write(record: dict) -> None:
    global _out
    if _out is None:
        folder = Path(os.environ.get("CPU_PER_TEST_OUT", "cpu-per-test"))
        folder.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _out = (folder / f"{worker}-{os.getpid()}.jsonl").open("a")
    _out.write(json.dumps(record) + "\n")
    _out.flush()


def pytest_sessionfinish(session) -> None:  # noqa: ARG001 -- a pytest hook's signature
    own, children = _cpu()
    _write({"event": "end", "own": own, "children": children})


try:
    import pytest
except ImportError:  # the report alone needs no pytest
    pytest = None

if pytest is not None:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 -- a pytest hook's signature
        own0, children0 = _cpu()
        started = time.monotonic()
        yield
        own1, children1 = _cpu()
        _write({"event": "test", "id": item.nodeid, "own": own1 - own0, "children": children1 - children0,
                "wall": time.monotonic() - started})


def report(folder: Path, top: int) -> str:
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    tests, processes = [], 0.0
    paths = sorted(folder.glob("*.jsonl"))
    workers = any(path.name.startswith("gw") for path in paths)
    for path in paths:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["event"] == "end":
                # xdist's controller waited for its workers: their CPU time is in its children's, and in their files
                controller = workers and path.name.startswith("main-")
                processes += record["own"] + (0.0 if controller else record["children"])
                continue
            row = files[record["id"].split("::", 1)[0]]
            row[0] += record["own"]
            row[1] += record["children"]
            row[2] += record["wall"]
            row[3] += 1
            tests.append((record["own"] + record["children"], record["id"]))
    in_tests = sum(own + children for own, children, _, _ in files.values())
    lines = [f"{len(tests)} tests: {in_tests / 60:.2f} CPU-minutes in tests, {processes / 60:.2f} in the test "
             "processes in all (with collection and imports)", "", "CPU s (own + children)   wall s   tests  file"]
    for name, (own, children, wall, count) in sorted(files.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]:
        lines.append(f"{own + children:7.1f} ({own:6.1f} + {children:6.1f}) {wall:8.1f} {count:7d}  {name}")
    lines += ["", "CPU s  test"] + [f"{cpu:6.1f}  {nodeid}" for cpu, nodeid in sorted(tests, reverse=True)[:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="CPU_PER_TEST_OUT of a run")
    parser.add_argument("--top", type=int, default=40, help="files and tests to list (default 40)")
    args = parser.parse_args()
    print(report(args.folder, args.top))


if __name__ == "__main__":
    main()
