"""Accuracy on CPU: memplan's estimated peak against the measured one, for every case in the zoo.

    .venv/bin/python -m benchmarks.accuracy_cpu                    # all cases; writes benchmarks/results/
    .venv/bin/python -m benchmarks.accuracy_cpu --only gpt2-b8 mlp-b64

Each case runs twice, each time in a fresh process, one after the other (2 cores: no parallelism):
the truth (`python -m benchmarks.cpu_truth CASE`, the profiler's peak of allocated bytes over build +
2 real steps of a Lightning `Trainer.fit`, or of a plain loop for a `loop="torch"` case) and the estimate (`memplan.estimate` on the same case, device="cpu", with the trace's
wall time and the process's peak RSS). error = (estimate.peak_allocated - truth) / truth.

The issue's two rules of thumb are scored the same way:
  "4 bytes x (3 x params + 2 x activations x batch)": 12 x num_parameters + 2 x estimate.activations
      (estimate.activations is the bytes of saved activations for the whole batch, i.e. 4 bytes x
      "activations x batch" in fp32), as MemoryEstimate.rule_of_thumb() computes it;
  "4 x model size (fp32 weights)": 4 x 4 bytes x num_parameters.
"""
from __future__ import annotations

import argparse
import datetime
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from benchmarks.results_io import machine, write_results

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
TIMEOUT_S = 600
GOAL_MEDIAN, GOAL_WORST = 0.01, 0.03

RULES = {
    "rule_3p_2act": "4 B x (3 x params + 2 x activations x batch)",
    "rule_4x_weights": "4 x model size (fp32 weights)",
}


def rules_of_thumb(num_parameters: int, activations_bytes: int) -> dict[str, int]:
    """The issue's two rules of thumb, in bytes."""
    return {
        "rule_3p_2act": 4 * 3 * num_parameters + 2 * activations_bytes,
        "rule_4x_weights": 4 * 4 * num_parameters,
    }


def estimate_one(name: str) -> dict:
    """memplan.estimate for one case, in this (fresh) process: the estimate, and the process's peak RSS."""
    import torch

    from benchmarks.zoo import CASES, SEED
    from memplan.estimator import estimate

    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    case = CASES[name]
    batch = case.make_batch(case.batch_size)
    started = time.perf_counter()
    result = estimate(
        case.build, batch, loss=case.loss, optimizer=case.optimizer, precision=case.precision,
        checkpointing=case.checkpointing, device="cpu", loop=case.loop,
    )
    return {
        "estimate": result.to_dict(),
        "wall_seconds": round(time.perf_counter() - started, 3),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _run_json(args: list[str]) -> tuple[dict | None, float, str]:
    """Run `python -m ARGS` from the repository root; (its last stdout line as JSON, wall s, error)."""
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - started, f"timed out after {TIMEOUT_S} s"
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        stderr = [line for line in proc.stderr.splitlines() if not line.startswith("USDT:")]
        return None, wall, "\n".join(stderr[-6:])
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall, ""


def run_case(name: str) -> dict:
    truth, truth_wall, truth_error = _run_json(["benchmarks.cpu_truth", name])
    est, est_wall, est_error = _run_json(["benchmarks.accuracy_cpu", "--estimate-one", name])
    row: dict = {"case": name, "truth": truth, "truth_process_seconds": round(truth_wall, 2)}
    row["estimate"] = est["estimate"] if est else None
    row["estimate_process_seconds"] = round(est_wall, 2)
    row["estimate_max_rss_bytes"] = est["max_rss_bytes"] if est else None
    if truth_error or est_error:
        row["error_message"] = truth_error or est_error
        row["failed"] = "truth" if truth_error else "estimate"
        return row
    peak, step2 = truth["peak_allocated"], truth["phase_peaks"]["step2"]
    predicted = row["estimate"]["peak_allocated"]
    row["error"] = (predicted - peak) / peak
    row["error_bytes"] = predicted - peak
    row["error_vs_step2"] = (predicted - step2) / step2
    rules = rules_of_thumb(row["estimate"]["num_parameters"], row["estimate"]["activations"])
    row["rules_of_thumb"] = rules
    row["rule_errors"] = {k: (v - peak) / peak for k, v in rules.items()}
    return row


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" in r]

    def stats(errors: list[float]) -> dict:
        magnitudes = [abs(e) for e in errors]
        return {
            "median_abs_error": statistics.median(magnitudes) if magnitudes else None,
            "worst_abs_error": max(magnitudes, default=None),
        }

    summary = {"cases": len(rows), "measured": len(ok), "memplan": stats([r["error"] for r in ok])}
    summary["memplan_vs_step2"] = stats([r["error_vs_step2"] for r in ok])
    for key in RULES:
        summary[key] = stats([r["rule_errors"][key] for r in ok])
    m = summary["memplan"]
    summary["goal_met"] = bool(
        ok and len(ok) == len(rows) and m["median_abs_error"] <= GOAL_MEDIAN and m["worst_abs_error"] <= GOAL_WORST
    )
    return summary


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.3f}%"


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / MiB:.1f}"


def render_markdown(report: dict) -> str:
    rows, s = report["rows"], report["summary"]
    lines = [
        "# memplan accuracy on CPU",
        "",
        f"{report['date']} · torch {report['machine']['torch']} · transformers {report['machine']['transformers']}"
        f" · {report['machine']['cpu']} ({report['machine']['cpu_count']} cores)",
        "",
        "Truth: the profiler's peak of allocated bytes over a real run (build + 2 steps of a Lightning "
        "`Trainer.fit`, or of a plain loop for loop='torch' cases) in a fresh process "
        "(benchmarks/cpu_truth.py). Error = (estimate - truth) / truth. MiB = 2^20 bytes. "
        "Scratch = bytes allocated and freed inside one kernel (oneDNN workspaces etc.) live at the "
        "truth's peak: in the truth, invisible to fake tensors.",
        "",
        "| case | params | truth MiB | step-2 truth MiB | memplan MiB | error | error bytes | error vs step 2 "
        "| scratch at peak MiB | truth w/o scratch MiB | in-op temporaries at peak MiB | truth peak in | trace s "
        "| estimate RSS MiB "
        "| 3P+2A error | 4x weights error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, e = r.get("truth"), r.get("estimate")
        if "error" not in r:
            lines.append(f"| {r['case']} | failed ({r.get('failed')}): {r.get('error_message', '').splitlines()[-1:]} "
                         "| | | | | | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {t['num_parameters']:,} | {_mib(t['peak_allocated'])} | {_mib(t['phase_peaks']['step2'])} "
            f"| {_mib(e['peak_allocated'])} | {_pct(r['error'])} | {r['error_bytes']:+,} | {_pct(r['error_vs_step2'])} "
            f"| {_mib(t['scratch_at_peak'])} | {_mib(t['peak_without_scratch'])} | {_mib(t['op_transient_at_peak']['bytes'])} "
            f"| {t['peak_phase']}: {(t['peak_op_stack'] or ['-'])[-1]} "
            f"| {e['trace_seconds']:.2f} | {_mib(r['estimate_max_rss_bytes'])} "
            f"| {_pct(r['rule_errors']['rule_3p_2act'])} | {_pct(r['rule_errors']['rule_4x_weights'])} |"
        )
    lines += [
        "",
        f"Measured {s['measured']} of {s['cases']} cases. Goal for memplan: median |error| <= {GOAL_MEDIAN:.0%}, "
        f"worst <= {GOAL_WORST:.0%}: {'met' if s['goal_met'] else 'NOT met'}.",
        "",
        "| predictor | median abs error | worst abs error |",
        "|---|---:|---:|",
        f"| memplan | {_pct(s['memplan']['median_abs_error'])} | {_pct(s['memplan']['worst_abs_error'])} |",
        f"| memplan vs step-2 truth | {_pct(s['memplan_vs_step2']['median_abs_error'])} "
        f"| {_pct(s['memplan_vs_step2']['worst_abs_error'])} |",
    ]
    for key, label in RULES.items():
        lines.append(f"| {label} | {_pct(s[key]['median_abs_error'])} | {_pct(s[key]['worst_abs_error'])} |")
    return "\n".join(lines) + "\n"


def _report(rows: list[dict]) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "rules_of_thumb": RULES,
        "rows": rows,
        "summary": summarize(rows),
    }


def _previous_rows(cases) -> dict[str, dict]:
    """The committed rows by case name (--only --write replaces just the cases it runs)."""
    from benchmarks.results_io import RESULTS

    path = RESULTS / "accuracy_cpu.json"
    if not path.exists():
        return {}
    return {r["case"]: r for r in json.loads(path.read_text())["rows"] if r["case"] in cases}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.zoo import CASES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), metavar="CASE", help="run these cases only")
    parser.add_argument("--write", action="store_true",
                        help="with --only: replace those cases' rows in the committed benchmarks/results/ and re-summarise")
    parser.add_argument("--estimate-one", choices=sorted(CASES), metavar="CASE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.estimate_one:
        json.dump(estimate_one(args.estimate_one), sys.stdout)
        sys.stdout.write("\n")
        return 0

    rows = []
    for name in args.only or list(CASES):
        row = run_case(name)
        rows.append(row)
        status = _pct(row["error"]) if "error" in row else f"FAILED ({row['failed']})"
        print(f"{name:34s} truth {row['truth_process_seconds']:6.1f} s  estimate "
              f"{row['estimate_process_seconds']:6.1f} s  error {status}", flush=True)
    report = _report(rows)
    print(render_markdown(report))
    if args.write or not args.only:
        kept = _previous_rows(CASES) if args.only else {}
        kept.update({r["case"]: r for r in rows})
        merged = _report([kept[name] for name in CASES if name in kept])
        write_results("accuracy_cpu", merged, render_markdown(merged), indent=1)
    return 0 if all("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
