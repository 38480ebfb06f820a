"""`memplan report` and `memplan watch` on a long run's logs: wall time and peak RSS of `report` on
10^6 log lines, and the bytes one `watch` refresh reads after a line is appended.

The log is generated here (8 ranks, `sample` records as MemoryPlanner writes them, a change every
10,000 steps, an OOM retry now and then, summary and end at the close) into a temporary folder;
`memplan report` runs in a fresh process, its peak RSS taken from wait4. Run from the repository root:

    .venv/bin/python -m benchmarks.logs_at_scale [--lines 1000000] [--write]

--write stores the figures in benchmarks/results/logs_at_scale.json. Times depend on the machine
and its load; say which CPU gave them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANKS = 8
REFRESHES = 21
"""Refreshes timed, one line appended before each: the median time and the most bytes read are kept."""
SHORT_LINES = 10_000
"""A second, short log: a watch refresh should cost the same on it as on the long one."""
GiB = 1 << 30
RUN = "20261125-120000-abcdef"
LAYOUT = {"loader_batch_size": 8, "micro_batch_size": 8, "accumulate_grad_batches": 1, "world_size": RANKS,
          "gradient_checkpointing": False, "micro_batches_per_step": 1, "global_batch_size": 64}


def generate(folder: Path, lines: int) -> int:
    """Write `lines` records over RANKS rank logs; returns the bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    steps = lines // RANKS
    start = time.time() - steps
    total = 0
    for rank in range(RANKS):
        rows = [{"event": "apply", "step": 0, "rank": rank, "run": RUN, "time": round(start, 3), "source": "plan",
                 "layout": LAYOUT, "plan": {"device_budget_bytes": 70 * GiB, "micro_batch_size": 8}}]
        for step in range(1, steps - 1):
            used = 40 * GiB + (step * 7919 + rank * 104729) % (20 * GiB)
            rows.append({"event": "sample", "step": step, "rank": rank, "run": RUN, "time": round(start + step, 3),
                         "process_bytes": used - GiB, "device_used_bytes": used, "device_total_bytes": 80 * GiB,
                         "allocated_bytes": used - 3 * GiB, "reserved_bytes": used - 2 * GiB,
                         "peak_bytes": used - 2 * GiB + step % 1000, "headroom_bytes": 70 * GiB - used,
                         "micro_batch_size": 8, "loader_batch_size": 8, "accumulate_grad_batches": 1,
                         "trainer_accumulate_grad_batches": 1, "gradient_checkpointing": False,
                         "global_batch_size": 64, "oom_retries": 0, "guarded": True})
            if step % 10_000 == 0:
                rows.append({"event": "change", "step": step, "rank": rank, "run": RUN, "time": round(start + step, 3),
                             "cause": "grow", "ranks": [rank], "reason": "room to grow", "before": LAYOUT,
                             "after": LAYOUT})
        rows.append({"event": "summary", "step": steps, "rank": rank, "run": RUN, "time": round(start + steps, 3),
                     "peak_process_bytes": 60 * GiB, "min_headroom_bytes": 10 * GiB, "oom_retries": 0,
                     "dropped_lines": 0, "layout": LAYOUT})
        rows.append({"event": "end", "step": steps, "rank": rank, "run": RUN, "time": round(start + steps, 3),
                     "status": "finished", "dropped_lines": 0})
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        (folder / f"rank{rank}.jsonl").write_bytes(data)
        total += len(data)
    return total


def run_report(folder: Path, png: Path, code: str | None = None) -> dict:
    """`memplan report` in a fresh process (memplan from the checkout `code`, default this one): wall
    seconds, CPU seconds (user + system, its worker processes included: what the wall time comes to
    on an idle machine with as many cores as it uses), peak RSS, exit code."""
    checkout = Path(code or Path(__file__).parents[1]).resolve()
    env = dict(os.environ, PYTHONPATH=str(checkout))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(folder), str(png)], capture_output=True, env=env,
                          cwd=checkout)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)  # its workers' too (reaped by it)
    err = proc.stderr.decode()
    peaks = [int(line.split()[1]) for line in err.splitlines() if line.startswith("VmHWM:")]
    children = [int(line.split()[1]) for line in err.splitlines() if line.startswith("children_maxrss:")]
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_mib": round(peaks[-1] / 1024, 1) if peaks else None,
            "worker_peak_rss_mib": round(children[-1] / 1024, 1) if children and children[-1] else None,
            "exit_code": proc.returncode, "stdout_tail": proc.stdout.decode()[-400:], "stderr_tail": err[-400:]}


# The report process's own peak RSS (VmHWM: since its exec, unlike ru_maxrss of a forked child, which
# counts the parent's pages) and its worker processes' largest peak, printed on its stderr.
_CHILD = """
import resource, sys
import memplan
from memplan.commands.cli import main
sys.stderr.write(f"memplan from {memplan.__file__}\\n")
try:
    code = main(["report", sys.argv[1], "--output", sys.argv[2]])
finally:
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
    sys.stderr.write(hwm[0] if hwm else "")
    sys.stderr.write(f"children_maxrss: {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss} kB\\n")
sys.exit(code)
"""


def watch_refresh(folder: Path) -> dict:
    """Bytes a `watch` refresh reads, and its time: the whole log at its first view, then one appended
    line at each of REFRESHES refreshes (the median time, the most bytes)."""
    from memplan.commands import log_reader, run_logs

    read = []
    real_pread = os.pread

    def counting_pread(fd, n, offset):
        data = real_pread(fd, n, offset)
        read.append(len(data))
        return data

    log_reader.os.pread = counting_pread
    try:
        watcher = run_logs.RunWatcher(folder)
        t0 = time.perf_counter()
        watcher.logs()
        first_s = time.perf_counter() - t0
        first_bytes = sum(state.offset for state in watcher._reader.files.values())  # workers read it, where parallel
        times, sizes = [], []
        for i in range(REFRESHES):  # one line appended before each refresh
            line = json.dumps({"event": "sample", "step": 10**6 + i, "rank": 0, "run": RUN, "time": time.time(),
                               "process_bytes": GiB}) + "\n"
            with open(folder / "rank0.jsonl", "a") as f:
                f.write(line)
            read.clear()
            t0 = time.perf_counter()
            logs = watcher.logs()
            times.append(time.perf_counter() - t0)
            sizes.append(sum(read))
        refresh_s, refresh_bytes = sorted(times)[len(times) // 2], max(sizes)
    finally:
        log_reader.os.pread = real_pread
    return {"first_view_s": round(first_s, 2), "first_view_bytes": first_bytes, "refreshes": REFRESHES,
            "refresh_s": round(refresh_s, 4), "refresh_bytes": refresh_bytes, "appended_bytes": len(line),
            "latest_step_seen": logs.histories[0].last_sample["step"]}


def _load() -> list[float]:
    """The load averages (1, 5, 15 min): how many processes wanted the CPUs while `report` was timed."""
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/logs_at_scale.json")
    parser.add_argument("--baseline", metavar="CHECKOUT", default=None,
                        help="also run `memplan report` from another checkout (e.g. the main branch) on the same log")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "memplan"
        size = generate(folder, args.lines)
        lines = sum(1 for p in folder.glob("rank*.jsonl") for _ in p.open("rb"))
        load_before = _load()
        report = run_report(folder, Path(tmp) / "report.png")
        baseline = run_report(folder, Path(tmp) / "baseline.png", args.baseline) if args.baseline else None
        load_after = _load()
        watch = watch_refresh(folder)
        short = Path(tmp) / "short"
        generate(short, SHORT_LINES)
        watch_short = watch_refresh(short)
    result = {"lines": lines, "log_bytes": size, "ranks": RANKS, "report": report, "watch": watch,
              "watch_on_a_short_log": {"lines": SHORT_LINES, **watch_short},
              **({"baseline": {"checkout": args.baseline, **baseline}} if baseline else {}),
              "cpu": _cpu_model() or platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "load_avg_1min": round(os.getloadavg()[0], 2),
              "load_avg_1_5_15min_before_and_after_report": [load_before, load_after]}
    print(json.dumps(result, indent=2))
    if args.write:
        out = Path(__file__).parent / "results" / "logs_at_scale.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 0 if report["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
