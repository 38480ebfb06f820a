"""The zoo's GPU errors with and without the CUDA reduction staging rule (memplan.estimator.cuda.reductions).

Each case with a GPU truth is estimated twice on this CPU with CUDA emulated (MEMPLAN_TRACE_ON_CPU=1, no
calibration file, as benchmarks.gpu_fidelity does): with this tree's rule, and with the rule switched off
(ReductionStaging.staging_allocations -> (), which is the tree before it). Truths: the H200's (torch 2.11.0+cu130,
benchmarks/results/gpu_campaign_raw/part1.json, device "H200") and the H100's (same torch,
benchmarks/results/gpu_campaign_raw_h100/part1.json and part1b.json, device "H100-80GB"), zoo and extra
variants. Errors are (estimate - truth) / truth, as benchmarks.gpu_fidelity computes them.

    .venv/bin/python -m benchmarks.op_transients_fidelity [--only NAME ...]

writes benchmarks/results/op_transients_fidelity.{json,md}: every case the rule moved, and a count of the rest
(with --only: prints, writes nothing).
"""
from __future__ import annotations

import argparse
import json
import sys

from benchmarks.gpu_fidelity import QUANTITIES, _err, _pct
from benchmarks.results_io import RESULTS, machine, write_results

SOURCES = (("H200", RESULTS / "gpu_campaign_raw", ("part1.json",)),
           ("H100-80GB", RESULTS / "gpu_campaign_raw_h100", ("part1.json", "part1b.json")))
MiB = 1 << 20


def truths() -> list[tuple[str, str, dict]]:
    """(device, case, truth) for every zoo / extra case with a truth, later files overriding earlier ones."""
    out: dict[tuple[str, str], dict] = {}
    for device, folder, files in SOURCES:
        for name in files:
            sections = json.loads((folder / name).read_text())["sections"]
            for section in ("accuracy_zoo", "accuracy_extra"):
                for row in sections.get(section, {}).get("rows", []) or []:
                    if "error" not in row["truth"]:
                        out[(device, row["case"])] = row["truth"]
    return [(device, case, truth) for (device, case), truth in out.items()]


def estimate_case(name: str, device: str, *, reductions: bool) -> dict:
    from benchmarks.op_transients import estimate_emulated

    est = estimate_emulated(name, device, reductions=reductions)
    return {"peak_allocated": est.peak_allocated, "peak_reserved": est.peak_reserved,
            "device_total": est.device_total}


def run(only: list[str] | None) -> dict:
    rows = []
    for device, name, truth in truths():
        if only and name not in only:
            continue
        before = estimate_case(name, device, reductions=False)
        after = estimate_case(name, device, reductions=True)
        row = {"device": device, "case": name, "truth": truth, "before": before, "after": after,
               "moved": before != after}
        for label, field, truth_field in QUANTITIES:
            for key in ("before", "after"):
                row[f"{key}_err_{label}"] = _err(row[key], field, truth, truth_field)
        rows.append(row)
        print(f"{device:10s} {name:32s} moved {row['moved']!s:5s} " + "  ".join(
            f"{label} {_pct(row[f'before_err_{label}'])} -> {_pct(row[f'after_err_{label}'])}"
            for label, _, _ in QUANTITIES), flush=True)
    return {"machine": machine(), "rows": rows}


def render(report: dict) -> str:
    moved = [r for r in report["rows"] if r["moved"]]
    lines = ["# The zoo's GPU errors before / after the CUDA reduction staging rule", "",
             "`.venv/bin/python -m benchmarks.op_transients_fidelity` (benchmarks/op_transients_fidelity.py). "
             "Emulated estimates on this CPU (torch " + report["machine"]["torch"] + ") against the H200's and the "
             "H100's truths (torch 2.11.0+cu130); 'before': the rule switched off. "
             f"{len(report['rows']) - len(moved)} of {len(report['rows'])} (device, case) pairs did not move; "
             "those that did:", "",
             "| GPU | case | truth allocated MiB | before | after | truth reserved MiB | before | after "
             "| NVML MiB | before | after |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in moved:
        cells = [r["device"], r["case"]]
        for label, field, truth_field in QUANTITIES:
            truth = r["truth"].get(truth_field)
            cells.append("-" if truth is None else f"{truth / MiB:,.1f}")
            for key in ("before", "after"):
                cells.append(f"{r[key][field] / MiB:,.1f} ({_pct(r[f'{key}_err_{label}'])})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these cases; print, write nothing")
    args = parser.parse_args(argv)
    report = run(args.only)
    if not args.only:
        write_results("op_transients_fidelity", report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
