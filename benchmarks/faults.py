"""Bad inputs and faults, replayed through memplan's command line and launch script, counted by outcome.

Each case runs in a fresh process (its own temporary folder, a time limit), from issue 23's list and
more of the same kinds: absurd sizes, files that are not files, bad plan files, implausible plans, run
logs at their edges, NVML going wrong (a SIMULATED NVML, tests/hardware/fake_nvml.py, with the GPUs
the case describes), SIGTERM during `suggest --output`. Each outcome is one of

    clear        refused (or answered) as expected, the message naming the input (the fragment), one
                 or two lines, no traceback
    unclear      refused, but the message does not name the input as expected
    traceback    a Python traceback reached the user
    hang         still running at the time limit
    silent wrong exit 0 where a refusal or an explanation was due, or an answer that misses what it must say
    data loss    a user's file changed, or a planned config / plan left without its partner, or a
                 temporary file left behind

Run from the repository root: `.venv/bin/python -m benchmarks.faults [--only ID ...] [--write]`
(--write stores results/faults.{json,md}). About 10 minutes on 2 CPU cores shared with other work.

The cases are in benchmarks.faults_cases, built from benchmarks.faults_setup's pieces; this module replays each
in a fresh process and sorts what it sees.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

from benchmarks.faults_cases import cases
from benchmarks.faults_setup import (  # noqa: F401 (pair_whole: tests/benchmarks reads it from here)
    CHECKOUT,
    ROOT,
    TIME_LIMIT_S,
    Case,
    _plain,
    pair_whole,
)

OUTCOMES = ("clear", "unclear", "traceback", "hang", "silent wrong", "data loss")

# The process a case runs: installs the simulated NVML the case describes (if any), then memplan's main.
RUNNER = """
import json, sys
spec = json.loads(sys.argv[1])
if spec.get("gpus") is not None:
    sys.path.insert(0, spec["fake_nvml_dir"])
    import pynvml
    from fake_nvml import SimGpu, SimulatedNvml
    from memplan.hardware import nvml
    def error(text):
        kind, _, message = text.partition(": ")
        return {"RuntimeError": RuntimeError, "OSError": OSError}[kind](message)
    gpus = []
    for g in spec["gpus"]:
        g = dict(g)
        g["failing"] = {f: getattr(pynvml, code) for f, code in g.get("failing", {}).items()}
        g["raising"] = {f: error(text) for f, text in g.get("raising", {}).items()}
        gpus.append(SimGpu(**g))
    nvml.set_backend(SimulatedNvml(gpus, raising={f: error(t) for f, t in spec.get("raising", {}).items()},
                                   failing={f: getattr(pynvml, c) for f, c in spec.get("failing", {}).items()}))
from memplan.commands.cli import main
sys.exit(main(spec["argv"]))
"""


def run_case(case: Case, folder: Path, code: Path = ROOT) -> dict:
    if case.config is not None:
        (folder / "config.yaml").write_text(yaml.safe_dump(case.config, sort_keys=False))
    if case.setup is not None:
        CHECKOUT["code"] = code
        case.setup(folder)
    argv = [a.replace("CONFIG", str(folder / "config.yaml")).replace("DIR", str(folder)) for a in case.argv]
    spec = {"argv": argv, "gpus": case.gpus, "fake_nvml_dir": str(ROOT / "tests" / "hardware"), **case.nvml}
    env = dict(os.environ, PYTHONPATH=str(code), **case.env)
    if "CUDA_VISIBLE_DEVICES" not in case.env:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    started = time.monotonic()
    argv_run = [sys.executable, "-c", RUNNER, json.dumps(spec)]
    if case.command is not None:
        argv_run = [a.replace("CONFIG", str(folder / "config.yaml")).replace("DIR", str(folder))
                    .replace("PYTHON", sys.executable).replace("ROOT", str(code)) for a in case.command]
    proc = subprocess.Popen(argv_run, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if case.sigterm_after_s is not None:
            try:
                proc.wait(timeout=case.sigterm_after_s)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIME_LIMIT_S)
        hung = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        hung = True
    return {"code": proc.returncode, "out": out, "err": err, "hung": hung, "seconds": time.monotonic() - started}


def classify(case: Case, result: dict, folder: Path) -> tuple[str, str]:
    """(outcome, what was seen)."""
    out, err, code = result["out"], result["err"], result["code"]
    text = _plain(out + " " + err)
    first = next((line for line in err.splitlines() if line.strip()), "") or next(
        (line for line in out.splitlines() if line.strip()), "")
    if result["hung"]:
        return "hang", f"still running after {TIME_LIMIT_S} s"
    if "Traceback (most recent call last)" in err:
        return "traceback", err.strip().splitlines()[-1][:200]
    if case.check is not None:
        problem = case.check(folder, out, err)
        if problem is not None:
            return problem, f"exit {code}: {first[:200]}"
    if case.expect == "signal":
        return "clear", f"exit {code} (SIGTERM at {case.sigterm_after_s} s): files whole"
    if case.expect == "answer":
        if code != 0:
            return ("unclear" if case.fragment not in text else "clear"), f"exit {code}: {first[:200]}"
        return (("clear" if case.fragment in text else "silent wrong"),
                f"exit 0: {case.fragment if case.fragment in text else first[:200]}")
    if code == 0:
        return "silent wrong", f"exit 0 where a refusal was due: {first[:200]}"
    if case.fragment in text and code == case.code and len(err.strip().splitlines()) <= 2:
        return "clear", f"exit {code}: {first[:200]}"
    return "unclear", f"exit {code}: {first[:200]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="run these case ids")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/faults.{json,md}")
    parser.add_argument("--code", metavar="CHECKOUT", type=Path, default=ROOT,
                        help="run another checkout's memplan (e.g. the main branch) on the same cases; the simulated "
                             "NVML stays this one's")
    args = parser.parse_args(argv)
    if args.write and args.code.resolve() != ROOT:
        parser.error("--write stores this checkout's figures; drop --code")
    chosen = [c for c in cases() if args.only is None or c.id in args.only]
    rows = []
    for case in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            result = run_case(case, folder, args.code.resolve())
            outcome, seen = classify(case, result, folder)
        rows.append({"id": case.id, "kind": case.kind, "outcome": outcome, "seen": seen,
                     "seconds": round(result["seconds"], 1)})
        print(f"{outcome:>12}  {case.id:<34} {seen[:150]}", flush=True)
    counts = Counter(r["outcome"] for r in rows)
    summary = {o: counts.get(o, 0) for o in OUTCOMES}
    print(f"\n{len(rows)} cases: " + ", ".join(f"{n} {o}" for o, n in summary.items()))
    if args.write:
        results = ROOT / "benchmarks" / "results"
        (results / "faults.json").write_text(json.dumps({"cases": len(rows), "counts": summary, "rows": rows},
                                                        indent=2) + "\n")
        lines = ["# Fault benchmark (`python -m benchmarks.faults`)", "",
                 f"{len(rows)} cases: " + ", ".join(f"{n} {o}" for o, n in summary.items()), "",
                 "| case | class | outcome | what was seen |", "|---|---|---|---|"]
        lines += [f"| {r['id']} | {r['kind']} | {r['outcome']} | {r['seen'].replace('|', '/')} |" for r in rows]
        (results / "faults.md").write_text("\n".join(lines) + "\n")
        print(f"wrote {results / 'faults.json'} and faults.md")
    return 0 if all(r["outcome"] == "clear" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
