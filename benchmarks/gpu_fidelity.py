"""memplan's emulated H200 estimates against the first GPU campaign's truths, re-estimated on this CPU.

The GPU campaign (benchmarks.gpu_campaign, raw results in benchmarks/results/gpu_campaign_raw/, an H200 with
torch 2.11.0+cu130) recorded for every case the truth (torch.cuda.max_memory_allocated / max_memory_reserved,
NVML's per-process peak) and memplan's estimates, among them the "emulated" one: traced on CPU fake tensors
with MEMPLAN_TRACE_ON_CPU=1, what a CPU-only machine computes. This benchmark estimates the same cases again
with the tree it runs in (device "H200", emulated), so a change to the CUDA model is measured against the
GPU's figures without a GPU: part 1's zoo rows and part 3's ViT-L/16 and autocast-cache rows. Cases whose
truth or emulated estimate failed on the GPU are skipped (an emulated failure there is re-estimated here).

    .venv/bin/python -m benchmarks.gpu_fidelity [--only NAME ...]

writes benchmarks/results/gpu_fidelity.{json,md} (with --only: prints, writes nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks.processes import environment_variable
from benchmarks.results_io import RESULTS, machine, write_results

RAW = RESULTS / "gpu_campaign_raw"
MiB = 1 << 20
QUANTITIES = (("allocated", "peak_allocated", "max_allocated"), ("reserved", "peak_reserved", "max_reserved"),
              ("nvml", "device_total", "nvml_process_peak"))
"""(label, the estimate's field, the truth's field)."""
RNN = ("lstm", "gru", "autocast-cache-lstm")
"""cuDNN RNNs are not emulated (memplan.estimator.cuda.semantics): reported, left out of the summary."""


def recorded() -> dict[str, dict]:
    """Case name -> {"truth", "emulated" (None where it failed on the GPU), "part"}, for every case with a truth."""
    out = {}
    zoo = json.loads((RAW / "part1.json").read_text())["sections"]["accuracy_zoo"]["rows"]
    gaps = json.loads((RAW / "part3.json").read_text())["sections"]["memory_gaps"]["rows"]
    for row in zoo:
        out[row["case"]] = {"part": 1, "truth": row["truth"], "emulated": row["emulated"]}
    for name, row in gaps.items():
        if name.startswith(("vit-", "autocast-")):
            out[name] = {"part": 3, "truth": row["truth"], "emulated": row.get("emulated", {})}
    return {k: {**v, "emulated": None if "error" in v["emulated"] else v["emulated"]}
            for k, v in out.items() if "error" not in v["truth"]}


def estimate_now(name: str, part: int) -> dict:
    """This tree's emulated H200 estimate of one case."""
    from memplan.estimator import estimate

    if part == 1:
        from benchmarks.accuracy_gpu import all_cases

        case = all_cases()[name]
        est = estimate(case.build, case.make_batch(case.batch_size), loss=case.loss, optimizer=case.optimizer,
                       precision=case.precision, checkpointing=case.checkpointing, device="H200")
    else:
        from benchmarks.gpu_extra import _zoo_case, gap_cases
        from benchmarks.published_gpu import _vit

        gap = gap_cases()[name]
        if gap.kind == "vit":
            est = _vit(gap.precision, gap.batch, device="H200")(False)
        else:
            case = _zoo_case(gap.zoo)
            est = estimate(case.build, case.make_batch(case.batch_size), loss=case.loss, optimizer=case.optimizer,
                           precision="bf16-mixed", loop="torch", device="H200")
    return {"peak_allocated": est.peak_allocated, "peak_reserved": est.peak_reserved,
            "device_total": est.device_total}


def _err(est: dict | None, field: str, truth: dict, truth_field: str) -> float | None:
    if not est or not truth.get(truth_field) or est.get(field) is None:
        return None
    return (est[field] - truth[truth_field]) / truth[truth_field]


def summarize(rows: list[dict], key: str, *, both: bool = False) -> dict:
    """Median |error| and worst error per quantity (with `both`: only the cases the campaign recorded too)."""
    out = {}
    for label, _, _ in QUANTITIES:
        errs = [r[f"{key}_err_{label}"] for r in rows
                if r[f"{key}_err_{label}"] is not None and not r["case"].startswith(RNN)
                and not (both and r["recorded_err_" + label] is None)]
        if errs:
            worst = max(errs, key=abs)
            out[label] = {"n": len(errs), "median_abs": statistics.median(abs(e) for e in errs), "worst": worst}
    return out


def _pct(e: float | None) -> str:
    return "-" if e is None else f"{100 * e:+.2f}%"


def render(report: dict) -> str:
    lines = ["# memplan's emulated H200 estimates against the first GPU campaign's truths", "",
             "`.venv/bin/python -m benchmarks.gpu_fidelity` (benchmarks/gpu_fidelity.py). Truth: an H200, torch "
             "2.11.0+cu130 (benchmarks/results/gpu_campaign_raw/). 'recorded': the emulated estimate the campaign "
             "recorded (this repository at the campaign's commit); 'now': this tree's, re-estimated on this CPU "
             f"(torch {report['machine']['torch']}). Errors are (estimate - truth) / truth; cuDNN RNN cases "
             "(not emulated) are listed but left out of the summary.", ""]
    for key, title in (("recorded", "recorded"), ("now_on_recorded", "now, the same cases"),
                       ("now", "now, every case (some failed to estimate on the GPU)")):
        parts = [f"{label} median |error| {100 * s['median_abs']:.2f}%, worst {_pct(s['worst'])} (n={s['n']})"
                 for label, s in report["summary"][key].items()]
        lines.append(f"- **{title}**: " + "; ".join(parts))
    lines += ["", "| case | truth allocated MiB | recorded | now | truth reserved MiB | recorded | now | NVML MiB "
              "| recorded | now |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        cells = [r["case"]]
        for label, field, truth_field in QUANTITIES:
            truth = r["truth"].get(truth_field)
            cells.append("-" if truth is None else f"{truth / MiB:,.1f}")
            for key in ("recorded", "now"):
                est = r[key] or {}
                value = est.get(field)
                cells.append("-" if value is None else f"{value / MiB:,.1f} ({_pct(r[f'{key}_err_{label}'])})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(names: list[str] | None = None) -> dict:
    """The report (rows and summaries) for these cases (all with a truth when None); prints a line per case."""
    cases = recorded()
    rows = []
    for name in names or list(cases):
        case = cases[name]
        # no calibration file (the null device is no regular file): the sourced constants, as on the GPU run
        with environment_variable("MEMPLAN_TRACE_ON_CPU", "1"), environment_variable("MEMPLAN_CALIBRATION", os.devnull):
            now = estimate_now(name, case["part"])
        row = {"case": name, "part": case["part"], "truth": case["truth"], "recorded": case["emulated"], "now": now}
        for label, field, truth_field in QUANTITIES:
            for key in ("recorded", "now"):
                row[f"{key}_err_{label}"] = _err(row[key], field, case["truth"], truth_field)
        rows.append(row)
        print(f"{name:30s} allocated recorded {_pct(row['recorded_err_allocated'])} now {_pct(row['now_err_allocated'])}"
              f"  reserved recorded {_pct(row['recorded_err_reserved'])} now {_pct(row['now_err_reserved'])}"
              f"  nvml recorded {_pct(row['recorded_err_nvml'])} now {_pct(row['now_err_nvml'])}", flush=True)
    return {"machine": machine(), "rows": rows, "summary": summaries(rows)}


def summaries(rows: list[dict]) -> dict:
    return {"recorded": summarize(rows, "recorded"), "now_on_recorded": summarize(rows, "now", both=True),
            "now": summarize(rows, "now")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these cases; print, write nothing")
    args = parser.parse_args(argv)
    report = run(args.only)
    print(json.dumps(report["summary"]))
    if not args.only:
        write_results("gpu_fidelity", report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
