"""Wall time of `memplan suggest` on the shipped configs, CPU only (issue 12: GPT-2-small under 5 s on a
quiet 2-core machine; `memplan --help` under 0.5 s).

Each run is a fresh process of the real command line, as a user runs it (imports included):
    memplan suggest --gpus 4 --gpu A100-80GB configs/<name>.yaml --json
    python -m benchmarks.suggest_time [--repeat 3] [--configs gpt2-small] [--user-python /tmp/memplan-user/bin/python]
with the user's install made first by `python3 scripts/install.py --venv /tmp/memplan-user` (the README's
first command, without the dev extras);
writes benchmarks/results/suggest_time.json and .md. Beside the wall time it records the process's CPU
time (user + system), which other load on the machine disturbs less, the time of the imports alone
(torch, pytorch_lightning and memplan's suggest path, as the gpt2-small config needs them) and of
`memplan --help`.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from benchmarks.results_io import write_results

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("gpt2-small", "resnet", "cnn", "mlp")
GOAL_S = {"gpt2-small": 5.0}
HELP_GOAL_S = 0.5
IMPORTS = "import torch, pytorch_lightning, memplan.demos, memplan.commands.planning, memplan.estimator.api"


def run_timed(cmd: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, stdout) of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out.stdout


def time_one(config: str, python: str = sys.executable) -> tuple[float, float, dict]:
    cmd = [python, "-m", "memplan", "suggest", "--gpus", "4", "--gpu", "A100-80GB",
           str(ROOT / "configs" / f"{config}.yaml"), "--json"]
    wall, cpu, out = run_timed(cmd)
    return wall, cpu, json.loads(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--user-python", metavar="PYTHON",
                        help="also time gpt2-small with this interpreter: a venv made by the README's first command "
                             "(`python3 scripts/install.py --venv /tmp/memplan-user`), without the dev extras "
                             "(transformers, scipy), which torchmetrics imports whenever they are installed")
    args = parser.parse_args()
    rows = []
    help_s = [run_timed([sys.executable, "-m", "memplan", "--help"])[0] for _ in range(args.repeat)]
    imports = [run_timed([sys.executable, "-c", IMPORTS])[:2] for _ in range(args.repeat)]
    user_imports = [run_timed([args.user_python, "-c", IMPORTS])[:2] for _ in range(args.repeat)] if args.user_python else []
    print(f"memplan --help median {statistics.median(help_s):.2f} s; imports alone median "
          f"{statistics.median(w for w, _ in imports):.1f} s wall, {statistics.median(c for _, c in imports):.1f} s CPU",
          flush=True)
    runs = [(config, "dev", sys.executable) for config in args.configs]
    if args.user_python:
        runs.insert(1 if runs and runs[0][0] == "gpt2-small" else 0, ("gpt2-small", "user", args.user_python))
    for config, env, python in runs:
        times, cpus, plan = [], [], None
        for _ in range(args.repeat):
            seconds, cpu, plan = time_one(config, python)
            times.append(seconds)
            cpus.append(cpu)
        row = {"config": config, "environment": env, "seconds": times, "median_s": statistics.median(times),
               "cpu_seconds": cpus, "median_cpu_s": statistics.median(cpus),
               "plan": {k: plan[k] for k in ("world_size", "micro_batch_size", "accumulate_grad_batches",
                                              "precision", "gradient_checkpointing", "predicted_peak_bytes")},
               "traces": next((r for r in plan["reasons"] if "estimator trace" in r), "")}
        rows.append(row)
        print(f"{config:12s} {env:4s} median {row['median_s']:.1f} s ({row['median_cpu_s']:.1f} s CPU)  {row['plan']}", flush=True)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
              "cpu_count": __import__("os").cpu_count(), "command": "memplan suggest --gpus 4 --gpu A100-80GB CONFIG --json",
              "help_seconds": help_s, "imports": {"code": IMPORTS, "wall_seconds": [w for w, _ in imports],
                                                  "cpu_seconds": [c for _, c in imports]},
              "user_imports": {"wall_seconds": [w for w, _ in user_imports], "cpu_seconds": [c for _, c in user_imports]},
              "rows": rows}
    lines = [f"# memplan suggest wall time ({report['date']}, {report['machine']}, {report['cpu_count']} CPUs, no GPU)", "",
             f"Command: `{report['command']}` in a fresh process, {args.repeat} runs each.", "",
             f"`memplan --help`: median {statistics.median(help_s):.2f} s (goal < {HELP_GOAL_S} s). Imports alone "
             f"(`{IMPORTS}`): median {statistics.median(w for w, _ in imports):.1f} s wall, "
             f"{statistics.median(c for _, c in imports):.1f} s CPU in the dev environment"
             + (f", {statistics.median(w for w, _ in user_imports):.1f} s wall in the user's" if user_imports else "")
             + ".", "",
             "Environments: `dev` is `python3 scripts/install.py --dev` (tests and benchmarks: transformers and scipy "
             "installed, which torchmetrics, imported by Lightning, then imports too); `user` is the README's first "
             "command, `python3 scripts/install.py` (memplan's own dependencies only), the install a user plans with.", "",
             "| config | environment | median s | CPU s | runs s | plan (world x micro x accum, precision, ckpt) | goal |",
             "|---|---|---:|---:|---|---|---|"]
    for r in rows:
        p = r["plan"]
        goal = GOAL_S.get(r["config"])
        verdict = "-" if goal is None else (f"< {goal:.0f} s: {'met' if r['median_s'] < goal else 'NOT met'}")
        lines.append(f"| {r['config']} | {r.get('environment', 'dev')} | {r['median_s']:.1f} | {r['median_cpu_s']:.1f} | "
                     f"{', '.join(f'{s:.1f}' for s in r['seconds'])} | "
                     f"{p['world_size']} x {p['micro_batch_size']} x {p['accumulate_grad_batches']}, {p['precision']}, "
                     f"{'on' if p['gradient_checkpointing'] else 'off'} | {verdict} |")
    write_results("suggest_time", report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
