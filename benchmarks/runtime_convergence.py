"""Where MemoryPlanner's runtime adjustment lands, on CPU with a SIMULATED device budget: two jobs.

The long-tail job: one process, a dataset whose batches have 8, 16, 12, 24, 16, 64, 20, 8 tokens per
sample (the first short, the longest 8x), a SIMULATED device on which a forward of more than 256 tokens
runs out of memory, and a SIMULATED planner that fits that budget to the batch memplan plans with
(tests/callback/test_callback_shapes.py). Run with the default scan for the heaviest batch, and with
scan_batches=0 (planning from the first batch, as before). Reported: OOM retries, the planned micro-batch,
tokens trained.

The OOM job (issue 20's held-out OOM job): Lightning DDP on CPU, gloo, 2 ranks, a loader batch of 16 per rank,
a plain MemoryPlanner() planning at fit start (16 whole fits the host), growth on (every check, patience
2, SIMULATED readings with 60 % free so growth is tried), and rank 1's SIMULATED memory failing forwards
of more than 8 samples. 12 optimizer steps. The scenario is `converge` in tests/callback/ddp_driver.py
(also run as a test, tests/callback/test_callback_ddp.py).

Reported: each rank's OOM retries (failed size -> retried size), the layout each rank ends at, the shared
changes, and whether every sample of every global batch was trained exactly once (the samples each
optimizer step saw, against the loader's). Goal: 8 x 2 on both ranks, at most 2 OOM retries in the run,
every sample once.

    python -m benchmarks.runtime_convergence
writes benchmarks/results/runtime_convergence.json and .md.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.results_io import machine, write_results

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "callback" / "ddp_driver.py"
STEPS, PER_RANK, WORLD = 12, 16, 2


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "converge"
        done = subprocess.run([sys.executable, str(DRIVER), tmp, "converge"], capture_output=True, text=True,
                              timeout=600, cwd=tmp)  # ddp_driver.py <out_root> <scenario>: writes <out_root>/converge
        if done.returncode != 0:
            raise SystemExit(f"the converge job failed:\n{done.stderr[-3000:]}")
        logs = [_jsonl(out / "memplan" / f"rank{r}.jsonl") for r in range(WORLD)]
        steps = [json.loads((out / f"samples_rank{r}.json").read_text()) for r in range(WORLD)]
    sys.path.insert(0, str(DRIVER.parent))
    from callback_sim import ddp_batches  # the samples of each step under Lightning's DistributedSampler

    expected = ddp_batches(per_rank_batch=PER_RANK, world_size=WORLD, steps=STEPS)
    trained = [sorted(set(a) | set(b)) for a, b in zip(*steps)]
    ranks = []
    for rank, log in enumerate(logs):
        final = [e for e in log if e["event"] == "sample"][-1]
        ranks.append({
            "rank": rank,
            "oom_retries": [f"{e['phase']} {e['failed_micro_batch_size']} -> {e['micro_batch_size']}"
                            for e in log if e["event"] == "oom_retry"],
            "final_micro_batch_size": final["micro_batch_size"],
            "final_micro_batches_per_step": final["accumulate_grad_batches"],
        })
    changes = [f"step {e['step']}: {e['cause']} -> micro-batch {e['after']['micro_batch_size']}"
               for e in logs[0] if e["event"] == "change"]
    return {"machine": machine(), "job": {"world_size": WORLD, "loader_batch_per_rank": PER_RANK, "steps": STEPS,
                                          "simulated_forward_limit_rank1": 8},
            "ranks": ranks, "changes": changes,
            "total_oom_retries": sum(len(r["oom_retries"]) for r in ranks),
            "every_sample_once": trained == expected,
            "samples_trained": sum(len(a) + len(b) for a, b in zip(*steps))}


def long_tail() -> list[dict]:
    import warnings

    import pytorch_lightning as pl

    sys.path.insert(0, str(DRIVER.parent))
    from test_callback_shapes import BATCH, LENGTHS, TokenModel, simulated_planner

    from memplan.callback import MemoryPlanner

    rows = []
    for scan_batches in (256, 0):
        module = TokenModel()
        planner = MemoryPlanner(planner=simulated_planner, grow=False, scan_batches=scan_batches)
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pl.Trainer(accelerator="cpu", devices=1, max_steps=len(LENGTHS), logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
                       callbacks=[planner]).fit(module)
            summary = [e for e in _jsonl(planner.log_path) if e["event"] == "summary"][-1]
        rows.append({"scan_batches": scan_batches, "planned_micro_batch_size": planner.plan.micro_batch_size,
                     "simulated_ooms": module.budget.ooms, "oom_retries": summary["oom_retries"],
                     "heavier_batches_split_ahead": summary["heavier_batches"],
                     "tokens_trained": module.tokens_seen, "tokens_in_the_epoch": BATCH * sum(LENGTHS)})
    return rows


def markdown(report: dict) -> str:
    lines = ["# Runtime convergence after an OOM (CPU, SIMULATED device budget)", "",
             "`python -m benchmarks.runtime_convergence`: Lightning DDP on CPU (gloo, 2 ranks), loader batch 16 per "
             "rank, plain `MemoryPlanner()`, growth on; rank 1's SIMULATED memory fails forwards above 8 samples. "
             f"Machine: {report['machine'].get('cpu', '?')}.", "",
             "| rank | OOM retries | final layout |", "|---|---|---|"]
    for r in report["ranks"]:
        lines.append(f"| {r['rank']} | {', '.join(r['oom_retries']) or 'none'} | "
                     f"{r['final_micro_batch_size']} x {r['final_micro_batches_per_step']} |")
    lines += ["", f"Shared changes: {'; '.join(report['changes']) or 'none'}.",
              f"OOM retries in the run: {report['total_oom_retries']} (goal: at most 2). Samples trained: "
              f"{report['samples_trained']}, every sample of every global batch exactly once: "
              f"{report['every_sample_once']}.", "",
              "## Long-tail job (one process; SIMULATED: a forward above 256 tokens runs out of memory)", "",
              "| scan_batches | planned micro-batch | OOM retries | batches split ahead | tokens trained / in the epoch |",
              "|---|---|---|---|---|"]
    for row in report["long_tail"]:
        lines.append(f"| {row['scan_batches']} | {row['planned_micro_batch_size']} | {row['oom_retries']} | "
                     f"{row['heavier_batches_split_ahead']} | {row['tokens_trained']} / {row['tokens_in_the_epoch']} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    result = {**run(), "long_tail": long_tail()}
    write_results("runtime_convergence", result, markdown(result))
    print(markdown(result))
