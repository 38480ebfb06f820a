"""The conv zoo cases re-estimated on this CPU (CUDA emulated) against BOTH GPU campaigns' truths: the H200's
(benchmarks/results/gpu_campaign_raw/, session 4, through benchmarks.gpu_fidelity) and the H100's
(benchmarks/results/gpu_campaign_raw_h100/, session 5: part 1's zoo rows and the extra variants of part1 / part1b).

    python -m benchmarks.conv_fidelity estimate OUT.json        this tree's estimates of the conv cases
    python -m benchmarks.conv_fidelity compare BEFORE.json AFTER.json [--write]

`estimate` takes the tree it runs in (run it in a worktree of the base commit for "before", with that tree first
on PYTHONPATH); `compare` prints the errors per case and the medians over every case with a truth, non-conv cases
taken from the campaign's own emulated estimates (H100: memplan 8509308) or benchmarks/results/gpu_fidelity.json's
re-estimates (H200); with --write it writes benchmarks/results/conv_workspace_fidelity.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
H100 = RESULTS / "gpu_campaign_raw_h100"
CONV_FAMILIES = ("cnn", "resnet", "mixer", "vit")
"""The zoo's models with convolutions (the ViTs' and the mixer's patch embedding is a strided Conv2d)."""
QUANTITIES = (("allocated", "peak_allocated", "max_allocated"), ("reserved", "peak_reserved", "max_reserved"))


def h100_truths() -> dict[str, dict]:
    """Case -> {"truth", "emulated"} for every H100 row with a truth (part1b's re-runs over part1's failures)."""
    out = {}
    for part in ("part1.json", "part1b.json"):
        sections = json.loads((H100 / part).read_text())["sections"]
        for section in ("accuracy_zoo", "accuracy_extra"):
            for row in sections[section].get("rows") or []:
                if "error" not in row["truth"]:
                    out[row["case"]] = {"truth": row["truth"], "emulated": row.get("emulated")}
    return out


def h200_truths() -> dict[str, dict]:
    from benchmarks.gpu_fidelity import recorded

    return recorded()


def is_conv(name: str) -> bool:
    return name.startswith(CONV_FAMILIES)


def estimate(name: str, card: str) -> dict:
    from benchmarks.processes import environment_variable

    with environment_variable("MEMPLAN_TRACE_ON_CPU", "1"), environment_variable("MEMPLAN_CALIBRATION", os.devnull):
        if card == "H200":
            from benchmarks.gpu_fidelity import estimate_now

            return estimate_now(name, h200_truths()[name]["part"])
        from benchmarks.accuracy_gpu import all_cases
        from memplan.estimator import estimate as memplan_estimate

        case = all_cases()[name]
        est = memplan_estimate(case.build, case.make_batch(case.batch_size), loss=case.loss,
                               optimizer=case.optimizer, precision=case.precision,
                               checkpointing=case.checkpointing, device="H100-80GB")
        return {"peak_allocated": est.peak_allocated, "peak_reserved": est.peak_reserved,
                "device_total": est.device_total}


def run_estimates(out: Path) -> None:
    import memplan

    result = {"memplan": str(Path(memplan.__file__).parent), "H200": {}, "H100": {}}
    for card, truths in (("H200", h200_truths()), ("H100", h100_truths())):
        for name in truths:
            if is_conv(name):
                result[card][name] = estimate(name, card)
                print(card, name, result[card][name], flush=True)
    out.write_text(json.dumps(result, indent=1))


def _err(est: dict | None, field: str, truth: dict, truth_field: str) -> float | None:
    if not est or not truth.get(truth_field) or est.get(field) is None:
        return None
    return (est[field] - truth[truth_field]) / truth[truth_field]


def compare(before: dict, after: dict) -> dict:
    fidelity = {r["case"]: r["now"] for r in json.loads((RESULTS / "gpu_fidelity.json").read_text())["rows"]}
    report = {}
    for card, truths in (("H200", h200_truths()), ("H100", h100_truths())):
        rows = []
        for name, case in truths.items():
            if name.startswith(("lstm", "gru", "autocast-cache-lstm")):
                continue  # cuDNN RNNs are not emulated (as benchmarks.gpu_fidelity leaves them out)
            if is_conv(name):
                estimates = {"before": before[card].get(name), "after": after[card].get(name)}
            else:  # no convolution: the rule adds nothing (the same estimate before and after)
                unchanged = fidelity.get(name) if card == "H200" else case["emulated"]
                estimates = {"before": unchanged, "after": unchanged}
            row = {"case": name, "conv": is_conv(name)}
            for label, field, truth_field in QUANTITIES:
                for key, est in estimates.items():
                    row[f"{key}_{label}"] = _err(est, field, case["truth"], truth_field)
            rows.append(row)
        summary = {}
        for label, _, _ in QUANTITIES:
            for key in ("before", "after"):
                for scope in ("all", "conv"):
                    errs = [r[f"{key}_{label}"] for r in rows if r[f"{key}_{label}"] is not None
                            and (scope == "all" or r["conv"])]
                    summary[f"{scope}_{key}_{label}_median_abs"] = statistics.median(abs(e) for e in errs)
                    summary[f"{scope}_{key}_{label}_n"] = len(errs)
        report[card] = {"rows": rows, "summary": summary}
    return report


def _pct(e: float | None) -> str:
    return "-" if e is None else f"{100 * e:+.2f}%"


def render(report: dict) -> str:
    lines = ["# cuDNN convolution workspaces: conv cases' errors before and after, against both GPUs' truths", "",
             "`python -m benchmarks.conv_fidelity` (estimates on this CPU with CUDA emulated; errors are (estimate - "
             "truth) / truth; truths: H200 benchmarks/results/gpu_campaign_raw/, H100 gpu_campaign_raw_h100/).", ""]
    for card, part in report.items():
        s = part["summary"]
        lines += [f"## {card}", ""]
        for label in ("allocated", "reserved"):
            lines.append(f"- {label}: median |error| over all {s[f'all_before_{label}_n']} cases "
                         f"{100 * s[f'all_before_{label}_median_abs']:.2f}% -> {100 * s[f'all_after_{label}_median_abs']:.2f}%;"
                         f" over the {s[f'conv_before_{label}_n']} conv cases "
                         f"{100 * s[f'conv_before_{label}_median_abs']:.2f}% -> {100 * s[f'conv_after_{label}_median_abs']:.2f}%")
        lines += ["", "| case | allocated before | after | reserved before | after |", "|---|---:|---:|---:|---:|"]
        for r in part["rows"]:
            if r["conv"]:
                lines.append(f"| {r['case']} | {_pct(r['before_allocated'])} | {_pct(r['after_allocated'])} | "
                             f"{_pct(r['before_reserved'])} | {_pct(r['after_reserved'])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("estimate").add_argument("out", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    cmp.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "estimate":
        run_estimates(args.out)
        return 0
    report = compare(json.loads(args.before.read_text()), json.loads(args.after.read_text()))
    text = render(report)
    print(text)
    if args.write:
        (RESULTS / "conv_workspace_fidelity.json").write_text(json.dumps(report, indent=1))
        (RESULTS / "conv_workspace_fidelity.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
