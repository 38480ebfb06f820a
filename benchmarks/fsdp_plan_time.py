"""Wall time and peak RSS of `memplan suggest` planning FSDP: the bundled Llama-2-7B-shaped config on
1 node x 8 H100-80GB, and a Llama-2-70B-shaped one (80 layers, hidden 8192, 64 heads, 8 KV heads, MLP
28672, seq 4096) on 8 nodes x 8 H100-80GB (issue 13's goal: < 60 s, < 2 GiB RSS on a 2-core machine).

    python -m benchmarks.fsdp_plan_time [--only 70b]

Each run is a fresh process of the real command line (`/usr/bin/time -v` reads its peak RSS); the 70B
config is configs/llama-7b-fsdp.yaml with the model's init_args replaced. Writes
benchmarks/results/fsdp_plan_time.json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.results_io import machine, write_results

ROOT = Path(__file__).resolve().parent.parent
SEVENTY_B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, context=4096)
CASES = {"70b": (8, SEVENTY_B), "7b": (1, None)}
GOAL_S, GOAL_RSS = 60.0, 2 << 30


def run(name: str, tmp: Path) -> dict:
    nodes, model_args = CASES[name]
    config = ROOT / "configs" / "llama-7b-fsdp.yaml"
    if model_args is not None:
        raw = yaml.safe_load(config.read_text())
        raw["model"]["init_args"] = model_args
        raw["memplan"]["global_batch_size"] = 512
        config = tmp / f"llama-{name}-fsdp.yaml"
        config.write_text("# Llama-2-70B-shaped, for benchmarks.fsdp_plan_time\n" + yaml.safe_dump(raw, sort_keys=False))
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "memplan", "suggest", "--gpus", "8", "--gpu", "H100-80GB",
           "--nodes", str(nodes), str(config), "--json"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    cpu = sum(float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([0-9.]+)", proc.stderr))
    row = {"case": name, "nodes": nodes, "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
           "max_rss_bytes": int(rss.group(1)) * 1024 if rss else None, "returncode": proc.returncode}
    if proc.returncode == 0:
        plan = json.loads(proc.stdout)
        row["plan"] = {k: plan.get(k) for k in ("strategy", "sharding_strategy", "cpu_offload", "world_size",
                                                "micro_batch_size", "accumulate_grad_batches", "precision",
                                                "gradient_checkpointing", "predicted_peak_bytes")}
        traces = re.search(r"(\d+) estimator traces? in the search", " ".join(plan.get("reasons", [])))
        row["traces"] = int(traces.group(1)) if traces else None
    else:
        row["error"] = proc.stderr.strip().splitlines()[-3:]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(CASES))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(name, Path(tmp)) for name in args.only or CASES]
    lines = ["# memplan suggest planning FSDP: wall time and peak RSS", "",
             f"Goal (70B on 8 x 8 H100-80GB): < {GOAL_S:.0f} s, < 2 GiB RSS. Timings on a shared machine must be "
             "re-measured on a quiet one.", "",
             "| case | nodes x GPUs | wall s | CPU s (user + sys) | peak RSS MiB | traces | plan |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        plan = r.get("plan") or {}
        what = (f"{plan.get('strategy')} {plan.get('sharding_strategy') or ''} micro {plan.get('micro_batch_size')} x "
                f"accum {plan.get('accumulate_grad_batches')}, ckpt {plan.get('gradient_checkpointing')}"
                if plan else f"failed: {r.get('error')}")
        rss = f"{r['max_rss_bytes'] / (1 << 20):.0f}" if r["max_rss_bytes"] else "-"
        lines.append(f"| {r['case']} | {r['nodes']} x 8 | {r['wall_seconds']} | {r['cpu_seconds']} | {rss} | "
                     f"{r.get('traces') or '-'} | {what} |")
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "rows": rows}
    write_results("fsdp_plan_time", report, markdown)
    return 0 if all(r["returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
