"""Accuracy of the FSDP estimate on CPU: memplan's per-rank peak against each rank of a real FSDP2 run.

    .venv/bin/python -m benchmarks.accuracy_fsdp_cpu                      # all cases; writes results/
    .venv/bin/python -m benchmarks.accuracy_fsdp_cpu --only gpt2-b8:2

A case is a benchmarks.zoo case (model, per-rank batch, optimizer, precision, checkpointing) and a
world size. The truth is `python -m benchmarks.fsdp_truth CASE WORLD_SIZE DIR`: Lightning's
ModelParallelStrategy (fully_shard on each repeated block and the root) with gloo on CPU, every rank
profiled over build + 2 steps (the profiler's peak "Total Allocated", as benchmarks/cpu_truth.py
reads it, with the allocator counting frees on gloo's threads too). The estimate is
`memplan.estimate(..., strategy="fsdp", world_size=N, device="cpu")` in a fresh process.
Error = (estimate - truth) / truth, for every rank: the estimate is one figure per rank.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.accuracy_cpu import ROOT, TIMEOUT_S, _mib, _pct, _run_json
from benchmarks.results_io import machine, write_results

GOAL_MEDIAN, GOAL_WORST = 0.01, 0.03
CASES = (
    "gpt2-b8:2", "gpt2-b8-bf16mixed:2", "gpt2-b8-ckpt:2", "gpt2-b8-bf16mixed-ckpt:2",
    "llama-gqa-b2:2", "llama-gqa-b4-bf16mixed:2", "llama-gqa-b4-ckpt:2",
    "bert-b8:2", "vit-b16:2", "t5-b4:2", "bart-b4-bf16mixed:2", "mixtral-moe-b4:2",
    "gpt2-b8:4", "llama-gqa-b4-bf16mixed:4", "vit-b32-bf16mixed-ckpt:4",
)


def estimate_one(name: str, world_size: int) -> dict:
    import resource

    import torch

    from benchmarks.zoo import CASES as ZOO, SEED
    from memplan.estimator import estimate

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    case = ZOO[name]
    started = time.perf_counter()
    result = estimate(
        case.build, case.make_batch(case.batch_size), loss=case.loss, optimizer=case.optimizer,
        precision=case.precision, checkpointing=case.checkpointing, device="cpu", strategy="fsdp",
        world_size=world_size,
    )
    return {
        "estimate": result.to_dict(),
        "wall_seconds": round(time.perf_counter() - started, 3),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def run_case(spec: str) -> dict:
    name, world = spec.rsplit(":", 1)
    row: dict = {"case": spec, "zoo_case": name, "world_size": int(world)}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.fsdp_truth", name, world, tmp], cwd=ROOT,
                capture_output=True, text=True, timeout=TIMEOUT_S,
            )
            truth_error = "\n".join(proc.stderr.splitlines()[-6:]) if proc.returncode else ""
        except subprocess.TimeoutExpired:
            truth_error = f"timed out after {TIMEOUT_S} s"
        truth_wall = time.perf_counter() - started
        ranks = sorted(Path(tmp).glob("rank*.json"))
        truths = [json.loads(p.read_text()) for p in ranks]
    est, _, est_error = _run_json(["benchmarks.accuracy_fsdp_cpu", "--estimate-one", spec])
    row["truth_process_seconds"] = round(truth_wall, 2)
    row["truths"] = truths
    row["estimate"] = est["estimate"] if est else None
    row["estimate_max_rss_bytes"] = est["max_rss_bytes"] if est else None
    if len(truths) != int(world) or est_error:
        row["failed"] = "estimate" if est_error else "truth"
        row["error_message"] = est_error or truth_error or f"{len(truths)} of {world} ranks reported"
        return row
    predicted = row["estimate"]["peak_allocated"]
    row["errors"] = [(predicted - t["peak_allocated"]) / t["peak_allocated"] for t in truths]
    row["error_bytes"] = [predicted - t["peak_allocated"] for t in truths]
    return row


def summarize(rows: list[dict]) -> dict:
    errors = [abs(e) for r in rows for e in r.get("errors", [])]
    ok = [r for r in rows if "errors" in r]
    median = statistics.median(errors) if errors else None
    worst = max(errors, default=None)
    return {
        "cases": len(rows), "measured": len(ok), "rank_figures": len(errors),
        "median_abs_error": median, "worst_abs_error": worst,
        "goal_met": bool(ok and len(ok) == len(rows) and median <= GOAL_MEDIAN and worst <= GOAL_WORST),
    }


def render_markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        "# memplan FSDP accuracy on CPU (Lightning ModelParallelStrategy, FSDP2, gloo)",
        "",
        f"{report['date']} · torch {report['machine']['torch']} · transformers {report['machine']['transformers']}"
        f" · {report['machine']['cpu']} ({report['machine']['cpu_count']} cores)",
        "",
        "Truth: each rank's profiler peak of allocated bytes over a real run (build + 2 steps; "
        "benchmarks/fsdp_truth.py), with c10's allocator counting every thread's frees (gloo's workers free "
        "collective buffers; memplan.truth.allocator_counts_every_thread). memplan: `estimate(strategy='fsdp', world_size=N, device='cpu')`, one "
        "figure per rank. Error = (estimate - truth) / truth, per rank. MiB = 2^20 bytes.",
        "",
        "| case (zoo case : ranks) | memplan MiB | truth MiB per rank | error per rank | truth peak in | estimate s |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for r in report["rows"]:
        if "errors" not in r:
            lines.append(f"| {r['case']} | failed ({r['failed']}): {r['error_message'].splitlines()[-1:]} | | | | |")
            continue
        e = r["estimate"]
        lines.append(
            f"| {r['case']} | {_mib(e['peak_allocated'])} | {' / '.join(_mib(t['peak_allocated']) for t in r['truths'])} "
            f"| {' / '.join(_pct(x) for x in r['errors'])} "
            f"| {r['truths'][0]['peak_phase']}: {(r['truths'][0]['peak_op_stack'] or ['-'])[-1]} "
            f"| {e['trace_seconds']:.2f} |"
        )
    lines += [
        "",
        f"Measured {s['measured']} of {s['cases']} cases ({s['rank_figures']} rank figures): median |error| "
        f"{_pct(s['median_abs_error'])}, worst {_pct(s['worst_abs_error'])}. Goal: median <= {GOAL_MEDIAN:.0%}, "
        f"worst <= {GOAL_WORST:.0%}: {'met' if s['goal_met'] else 'NOT met'}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="CASE:RANKS", help="run these cases only")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/ also with --only")
    parser.add_argument("--estimate-one", metavar="CASE:RANKS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.estimate_one:
        name, world = args.estimate_one.rsplit(":", 1)
        json.dump(estimate_one(name, int(world)), sys.stdout)
        sys.stdout.write("\n")
        return 0
    rows = []
    for spec in args.only or CASES:
        row = run_case(spec)
        rows.append(row)
        status = " / ".join(_pct(e) for e in row["errors"]) if "errors" in row else f"FAILED ({row['failed']})"
        print(f"{spec:32s} truth {row['truth_process_seconds']:6.1f} s  error {status}", flush=True)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "rows": rows, "summary": summarize(rows),
    }
    markdown = render_markdown(report)
    print(markdown)
    if args.write or not args.only:
        write_results("accuracy_fsdp_cpu", report, markdown, indent=1)
    return 0 if all("errors" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
