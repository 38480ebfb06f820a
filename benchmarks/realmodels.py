"""memplan on real architectures: transformers config classes and plain torch, against real CPU runs.

    python -m benchmarks.realmodels                 # every case; writes results/realmodels.{md,json}
    python -m benchmarks.realmodels --only NAME ... # some cases (add --write to write the results)

None of these models is in memplan's own zoo (benchmarks/zoo.py): they are what users bring. Each is
built from a config class at a small size (no weights, no hub access) by a zero-argument callable,
trained by a real `Trainer.fit` (benchmarks/zoo.Case + benchmarks/cpu_truth.measure: profiler
"Total Allocated" peak over build + 2 steps, in a fresh process, seeds fixed), and estimated with
`memplan.estimate(build, batch, device="cpu")` in another fresh process. A subset (`-torch` cases)
runs in a plain PyTorch loop instead (zero_grad(set_to_none=True) after the optimizer step), estimated
with `loop="torch"`.

The `-experts-peak` MoE cases have a small vocabulary and long sequences, so that the peak falls
inside the experts (not at the loss's logits) and routing decides it; they report the error with
data_dependent="balanced" and "sample".

Mixture-of-experts cases run both of transformers' experts paths. transformers 5.x picks the path
from `config._experts_implementation` (`experts_implementation=` in the config or `from_pretrained`):
None resolves to "grouped_mm" where `torch._grouped_mm` can dispatch (it can on CPU with torch >= 2.9,
in float32 too; modeling_utils.get_correct_experts_implementation), else "eager" (a Python loop over
the experts hit, with `nonzero` on the routing mask). Their routing in the truth is the random
router of a seeded initialisation; the estimate assumes balanced routing (data_dependent="balanced",
named in its notes).

wav2vec2 and HuBERT run with `layerdrop=0.0`: LayerDrop skips each layer when `torch.rand([])` falls
below it, so a real step's memory is a random draw. The estimate decides such draws as the worst case,
no layer dropped, whatever the seed (memplan.estimator.values), which is what the truth runs with
LayerDrop off.

The models and batches are in benchmarks.realmodels_models, the cases in benchmarks.realmodels_cases; this module
runs them (each side in a fresh process) and renders the report.
"""
from __future__ import annotations

import argparse
import datetime
import json
import resource
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.accuracy_cpu import _run_json
from benchmarks.realmodels_cases import CASES
from benchmarks.realmodels_models import _hf  # noqa: F401 (tests read realmodels._hf, the builder of its cases)
from benchmarks.results_io import machine, write_results
from benchmarks.zoo import SEED

GOAL_MEDIAN = 0.001
GOAL_WORST = 0.03
MiB = 1 << 20


# --------------------------------------------------------------------------------------------------
# one case, in a fresh process


def truth_one(name: str) -> dict:
    from benchmarks.cpu_truth import measure

    return measure(CASES[name])


def estimate_one(name: str, data_dependent: str = "balanced") -> dict:
    from memplan.estimator import estimate

    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    case = CASES[name]
    batch = case.make_batch(case.batch_size)
    started = time.perf_counter()
    result = estimate(
        case.build, batch, loss=case.loss, optimizer=case.optimizer, precision=case.precision,
        checkpointing=case.checkpointing, device="cpu", data_dependent=data_dependent, loop=case.loop,
    )
    return {
        "estimate": result.to_dict(),
        "wall_seconds": round(time.perf_counter() - started, 3),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def run_case(name: str) -> dict:
    truth, truth_wall, truth_error = _run_json(["benchmarks.realmodels", "--truth-one", name])
    est, est_wall, est_error = _run_json(["benchmarks.realmodels", "--estimate-one", name])
    case = CASES[name]
    row: dict[str, Any] = {
        "case": name, "family": case.family, "precision": case.precision, "checkpointing": case.checkpointing,
        "loop": case.loop,
        "truth": truth, "estimate": est["estimate"] if est else None,
        "truth_process_seconds": round(truth_wall, 2), "estimate_process_seconds": round(est_wall, 2),
    }
    if not compare(row, truth_error, est_error):
        return row
    if case.family == "moe":  # the other routing assumption, for comparison
        peak = truth["peak_allocated"]
        sample, _, sample_error = _run_json(["benchmarks.realmodels", "--estimate-one", name, "--data-dependent",
                                             "sample"])
        row["error_sample"] = (sample["estimate"]["peak_allocated"] - peak) / peak if sample else None
        row["error_sample_message"] = sample_error or None
    return row


# --------------------------------------------------------------------------------------------------
# the report


def compare(row: dict, truth_error: str | None, est_error: str | None) -> bool:
    """Fill `row` (holding "truth" and "estimate") with the estimate's error against the truth's peak, or with
    which side failed and why; whether both ran."""
    if truth_error or est_error:
        row["failed"] = "truth" if truth_error else "estimate"
        row["error_message"] = truth_error or est_error
        return False
    peak = row["truth"]["peak_allocated"]
    row["error"] = (row["estimate"]["peak_allocated"] - peak) / peak
    row["error_bytes"] = row["estimate"]["peak_allocated"] - peak
    return True


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" in r]

    def stats(subset: list[dict]) -> dict:
        magnitudes = [abs(r["error"]) for r in subset]
        return {
            "measured": len(subset),
            "median_abs_error": statistics.median(magnitudes) if magnitudes else None,
            "worst_abs_error": max(magnitudes, default=None),
        }

    moe = [r for r in ok if r["family"] == "moe"]
    torch_order = [r for r in ok if r.get("loop") == "torch"]
    summary = {"cases": len(rows), "estimated": sum(1 for r in rows if r.get("estimate")), "all": stats(ok),
               "moe": stats(moe), "torch_order": stats(torch_order),
               "failed": [r["case"] for r in rows if "failed" in r]}
    a = summary["all"]
    summary["goal_met"] = bool(
        ok and len(ok) == len(rows) and a["median_abs_error"] <= GOAL_MEDIAN and a["worst_abs_error"] <= GOAL_WORST
        and (not moe or summary["moe"]["worst_abs_error"] <= GOAL_WORST)
    )
    return summary


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.3f}%"


def render_markdown(report: dict) -> str:
    rows, s = report["rows"], report["summary"]
    m = report["machine"]
    lines = [
        "# memplan on real architectures (CPU)",
        "",
        f"{report['date']} · torch {m['torch']} · transformers {m['transformers']} · "
        f"{m['cpu']} ({m['cpu_count']} cores)",
        "",
        "Each model built from a transformers config class (small sizes, no weights) or plain torch, by a "
        "zero-argument callable. Truth: profiler \"Total Allocated\" peak over build + 2 steps in a fresh "
        "process, trained by a real Lightning `Trainer.fit` (benchmarks/cpu_truth.py, seed 0). "
        "Estimate: `memplan.estimate(build, batch, "
        "device='cpu', data_dependent='balanced')` in another fresh process. Error = (estimate - truth) / truth. "
        "Cases marked 'torch order' are trained by a plain PyTorch loop (zero_grad(set_to_none=True) after the "
        "optimizer step) and estimated with `loop='torch'`. "
        "CPU convolutions and LSTM layers: the estimate measures oneDNN's in-kernel scratch by running each op "
        "shape once on real zeros (memplan.estimator.kernels.probe; the column 'scratch at peak' is the truth's). "
        "MoE truth routes with the seeded random router; the estimate assumes balanced routing (its notes say so).",
        "",
        "| case | family | precision | params | truth MiB | memplan MiB | error | error bytes "
        "| error with data_dependent='sample' | scratch at peak MiB | truth peak in | assumptions in notes |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        t, e = r.get("truth"), r.get("estimate")
        setting = (r["precision"] + (" ckpt" if r["checkpointing"] else "")
                   + (" torch order" if r.get("loop") == "torch" else ""))
        if "error" not in r:
            message = (r.get("error_message") or "").strip().splitlines()[-1:] or [""]
            lines.append(f"| {r['case']} | {r['family']} | {setting} | | | | failed ({r.get('failed')}) | "
                         f"{message[0][:160].replace('|', '/')} | | | | |")
            continue
        assumed = "; ".join(n.split(" (in ")[0] for n in e["notes"] if "data_dependent=" in n) or "-"
        lines.append(
            f"| {r['case']} | {r['family']} | {setting} | {t['num_parameters']:,} | {t['peak_allocated'] / MiB:.2f} "
            f"| {e['peak_allocated'] / MiB:.2f} | {_pct(r['error'])} | {r['error_bytes']:+,} | "
            f"{_pct(r.get('error_sample'))} "
            f"| {t['scratch_at_peak'] / MiB:.2f} | {t['peak_phase']}: {(t['peak_op_stack'] or ['-'])[-1]} | {assumed} |"
        )
    a, moe = s["all"], s["moe"]
    lines += [
        "",
        f"{s['cases']} cases, {s['estimated']} estimated, {a['measured']} compared with a truth. "
        f"Goal: median |error| <= {GOAL_MEDIAN:.1%}, worst <= {GOAL_WORST:.0%}, MoE worst <= {GOAL_WORST:.0%}: "
        f"{'met' if s['goal_met'] else 'NOT met'}.",
        "",
        "| subset | compared | median abs error | worst abs error |",
        "|---|---:|---:|---:|",
        f"| all | {a['measured']} | {_pct(a['median_abs_error'])} | {_pct(a['worst_abs_error'])} |",
        f"| MoE (both experts paths) | {moe['measured']} | "
        f"{_pct(moe['median_abs_error'])} | {_pct(moe['worst_abs_error'])} |",
    ]
    if s.get("torch_order", {}).get("measured"):
        o = s["torch_order"]
        lines.append(f"| torch order | {o['measured']} | "
                     f"{_pct(o['median_abs_error'])} | {_pct(o['worst_abs_error'])} |")
    if s["failed"]:
        lines += ["", "Failed: " + ", ".join(s["failed"])]
    return "\n".join(lines) + "\n"


def _report(rows: list[dict]) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "rows": rows,
        "summary": summarize(rows),
    }


def _previous_rows() -> dict[str, dict]:
    """The committed rows by case name (--only --write replaces just the cases it runs)."""
    from benchmarks.results_io import RESULTS

    path = RESULTS / "realmodels.json"
    if not path.exists():
        return {}
    return {r["case"]: r for r in json.loads(path.read_text())["rows"] if r["case"] in CASES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), metavar="CASE", help="run these cases only")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/ also with --only")
    parser.add_argument("--truth-one", choices=sorted(CASES), metavar="CASE", help=argparse.SUPPRESS)
    parser.add_argument("--estimate-one", choices=sorted(CASES), metavar="CASE", help=argparse.SUPPRESS)
    parser.add_argument("--data-dependent", default="balanced", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.truth_one or args.estimate_one:
        out = truth_one(args.truth_one) if args.truth_one else estimate_one(args.estimate_one, args.data_dependent)
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0

    write = args.write or not args.only
    kept = _previous_rows() if args.only and args.write else {}
    rows = []
    for name in args.only or list(CASES):
        row = run_case(name)
        rows.append(row)
        kept[name] = row
        status = _pct(row["error"]) if "error" in row else f"FAILED ({row['failed']}): {row['error_message'][-300:]}"
        print(f"{name:36s} truth {row['truth_process_seconds']:6.1f} s  estimate "
              f"{row['estimate_process_seconds']:6.1f} s  error {status}", flush=True)
        if write:  # after every case, so an interrupted run leaves what it measured
            report = _report([kept[n] for n in CASES if n in kept])
            write_results("realmodels", report, render_markdown(report), indent=1)
    report = _report(rows)
    print(render_markdown(report))
    return 0 if all("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
