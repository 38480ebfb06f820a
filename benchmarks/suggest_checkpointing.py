"""`memplan suggest` on the bundled configs before and after checkpointing became a dial (issue 21 §2).

Each config is planned for 8 x H100-80GB (one node) by a fresh process of the real command line:
    python -m memplan suggest configs/<name>.yaml --gpus 8 --gpu H100-80GB --json
once with the tree under test and once with another source tree (`--before DIR`: an export of main at
4e02bf6, `git archive 4e02bf6 | tar -x -C DIR`) first on PYTHONPATH, in the same virtual environment.
For each it records the plan's checkpointing, micro-batch, accumulation, precision, strategy, predicted
peak, step time, tokens/s (or samples/s) and the one-line reason.

    .venv/bin/python -m benchmarks.suggest_checkpointing --before /tmp/memplan-4e02bf6 [--configs gpt2-small]

writes benchmarks/results/suggest_checkpointing.{json,md}. Planning runs on CPU fake tensors; the figures
are the step-time model's predictions for H100s, not measurements.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.results_io import machine, write_results

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("gpt2-small", "llama-7b-fsdp", "resnet", "cnn", "mlp", "vit-l16")
"""configs/<name>.yaml, else benchmarks/configs/<name>.yaml: configs too slow to plan in the test suite
(ViT-L/16 at micro-batches up to 512), read by both trees from this one."""
ARGS = ("--gpus", "8", "--gpu", "H100-80GB", "--json")


def suggest(config: str, source: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(source)}
    started = time.perf_counter()
    path = f"configs/{config}.yaml" if (ROOT / "configs" / f"{config}.yaml").exists() else \
        str(ROOT / "benchmarks" / "configs" / f"{config}.yaml")
    out = subprocess.run([sys.executable, "-m", "memplan", "suggest", path, *ARGS],
                         capture_output=True, text=True, cwd=source, env=env)
    seconds = round(time.perf_counter() - started, 1)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:], "seconds": seconds}
    plan = json.loads(out.stdout)
    plan = plan.get("plan", plan)
    return {"checkpointing": plan.get("checkpointing", "full" if plan["gradient_checkpointing"] else "none"),
            "micro_batch_size": plan["micro_batch_size"], "accumulate_grad_batches": plan["accumulate_grad_batches"],
            "world_size": plan["world_size"], "precision": plan["precision"],
            "strategy": plan["strategy"] + (f" {plan['sharding_strategy']}" if plan.get("sharding_strategy") else ""),
            "predicted_peak_gib": round(plan["predicted_peak_bytes"] / (1 << 30), 2),
            "step_seconds": plan.get("predicted_step_seconds"), "tokens_per_s": plan.get("tokens_per_s"),
            "samples_per_s": plan.get("samples_per_s"), "speed_reason": plan.get("speed_reason"),
            "best_other_checkpointing": _best_other_checkpointing(plan), "seconds": seconds}


def _best_other_checkpointing(plan: dict) -> dict | None:
    """The fastest fitting alternative whose checkpointing differs from the plan's: what it is, at which
    micro-batch, and its predicted speed relative to the plan's (1.0 = as fast)."""
    def setting(p: dict) -> str:  # (plans from before checkpointing was a dial: on or off)
        return p.get("checkpointing", "full" if p["gradient_checkpointing"] else "none")

    others = [a for a in plan.get("alternatives", ()) if a.get("fits") and setting(a) != setting(plan)]
    if not others:
        return None
    best = max(others, key=lambda a: a["relative_speed"])
    return {"checkpointing": setting(best), "micro_batch_size": best["micro_batch_size"],
            "relative_speed": round(best["relative_speed"], 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="source tree of the code before (main at 4e02bf6)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    args = parser.parse_args()
    earlier = ROOT / "benchmarks" / "results" / "suggest_checkpointing.json"
    kept = {r["config"]: r for r in json.loads(earlier.read_text())["rows"]} if earlier.exists() else {}
    rows = []
    for config in args.configs:
        row = {"config": config, "before": suggest(config, args.before.resolve()), "after": suggest(config, ROOT)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    rows = [r for name, r in kept.items() if name not in args.configs] + rows  # the configs not re-run: as committed
    write_results("suggest_checkpointing", {"machine": machine(), "args": list(ARGS), "rows": rows}, render(rows))
    return 0


def render(rows: list[dict]) -> str:
    """The results table, in Markdown."""
    lines = ["# memplan suggest on the bundled configs: checkpointing before and after (8 x H100-80GB, predicted)", "",
             "| config | | checkpointing | micro x accumulation | peak (GiB) | step (s) | tokens/s (samples/s) | reason "
             "| fastest other checkpointing (speed vs the plan) |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | --- | --- |"]
    for row in rows:
        for when in ("before", "after"):
            r = row[when]
            if "error" in r:
                lines.append(f"| {row['config']} | {when} | error: {' '.join(r['error'])} | | | | | | |")
                continue
            rate = r["tokens_per_s"] or r["samples_per_s"]
            other = r.get("best_other_checkpointing")
            other = (f"{other['checkpointing']} at micro-batch {other['micro_batch_size']}: "
                     f"{other['relative_speed']:.0%}" if other else "none among the alternatives" if "best_other_checkpointing" in r
                     else "")
            step = f"{r['step_seconds']:.3g}" if r["step_seconds"] else ""
            lines.append(f"| {row['config']} | {when} | {r['checkpointing']} | {r['micro_batch_size']} x "
                         f"{r['accumulate_grad_batches']} ({r['strategy']}, {r['precision']}) | {r['predicted_peak_gib']} | "
                         f"{step} | {rate:,.0f} | {r['speed_reason'] or ''} | {other} |" if rate else
                         f"| {row['config']} | {when} | {r['checkpointing']} | {r['micro_batch_size']} x "
                         f"{r['accumulate_grad_batches']} | {r['predicted_peak_gib']} | {step} | | {r['speed_reason'] or ''} | {other} |")
    lines += ["", "Before: main at 4e02bf6; after: this branch. Planned on CPU fake tensors; step times and rates are "
                  "the step-time model's predictions for H100-80GB, not measurements. The last column reads the plan's "
                  "alternatives (the runners-up suggest prints): a checkpointing setting not among them was predicted "
                  "slower than every one of them. vit-l16 is benchmarks/configs/vit-l16.yaml, whose ViT demo is newer "
                  "than 4e02bf6 (hence its 'before' error).", "",
              "    .venv/bin/python -m benchmarks.suggest_checkpointing --before DIR"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
