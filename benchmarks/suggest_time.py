"""Wall time of `memplan suggest` on the shipped configs, CPU only (issue: GPT-2-small under 15 s).

Each run is a fresh process of the real command line, as a user runs it (imports included):
    memplan suggest --gpus 4 --gpu A100-80GB configs/<name>.yaml --json
    python -m benchmarks.suggest_time [--repeat 3]
writes benchmarks/results/suggest_time.json and .md.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from benchmarks.results_io import write_results

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("gpt2-small", "resnet", "cnn", "mlp")
GOAL_S = {"gpt2-small": 15.0}


def time_one(config: str) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "memplan", "suggest", "--gpus", "4", "--gpu", "A100-80GB",
           str(ROOT / "configs" / f"{config}.yaml"), "--json"]
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return time.perf_counter() - started, json.loads(out.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for config in CONFIGS:
        times, plan = [], None
        for _ in range(args.repeat):
            seconds, plan = time_one(config)
            times.append(seconds)
        row = {"config": config, "seconds": times, "median_s": statistics.median(times),
               "plan": {k: plan[k] for k in ("world_size", "micro_batch_size", "accumulate_grad_batches",
                                              "precision", "gradient_checkpointing", "predicted_peak_bytes")},
               "traces": next((r for r in plan["reasons"] if "estimator trace" in r), "")}
        rows.append(row)
        print(f"{config:12s} median {row['median_s']:.1f} s  {row['plan']}", flush=True)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
              "cpu_count": __import__("os").cpu_count(), "command": "memplan suggest --gpus 4 --gpu A100-80GB CONFIG --json",
              "rows": rows}
    lines = [f"# memplan suggest wall time ({report['date']}, {report['machine']}, {report['cpu_count']} CPUs, no GPU)", "",
             f"Command: `{report['command']}` in a fresh process, {args.repeat} runs each.", "",
             "| config | median s | runs s | plan (world x micro x accum, precision, ckpt) | goal |", "|---|---:|---|---|---|"]
    for r in rows:
        p = r["plan"]
        goal = GOAL_S.get(r["config"])
        verdict = "-" if goal is None else (f"< {goal:.0f} s: {'met' if r['median_s'] < goal else 'NOT met'}")
        lines.append(f"| {r['config']} | {r['median_s']:.1f} | {', '.join(f'{s:.1f}' for s in r['seconds'])} | "
                     f"{p['world_size']} x {p['micro_batch_size']} x {p['accumulate_grad_batches']}, {p['precision']}, "
                     f"{'on' if p['gradient_checkpointing'] else 'off'} | {verdict} |")
    write_results("suggest_time", report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
