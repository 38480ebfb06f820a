"""The step-time model (memplan/planner/costs.py) against the step times measured on two GPUs.

Both GPU campaigns timed the same 16 settings (benchmarks/gpu_extra.py `time_model`: GPT-2 small and ViT-L/16,
bf16-mixed and 32-true, with and without full checkpointing, one GPU, median of 10 steps):

    H200           benchmarks/results/gpu_campaign_raw/part4.json        (session 4)
    H100 80GB HBM3 benchmarks/results/gpu_campaign_raw_h100/part4.json   (session 5; also a torch.profiler
                                                                          kernel profile of GPT-2 small, micro-batch 8)

Each setting is predicted as benchmarks.gpu_extra_results predicts it (memplan.planner.predict_step for the
card's catalog entry on a CostProfile built as the planner builds one: bf16-mixed traces at micro-batch 1 and
PROBE_MICRO, on CPU, fake tensors). Besides the step, the kernel profile's GPU busy time per step is set against
the model's GPU time for that setting (the sum of the per-op rooflines, without the host floor): the direct check
of the GPU side of the model.

    .venv/bin/python -m benchmarks.step_time_cards [--baseline benchmarks/results/step_time_cards_before.json]

writes benchmarks/results/step_time_cards.{json,md}; --baseline adds a earlier run's errors as a 'before' column
(the committed step_time_cards_before.json is this benchmark on memplan 8b5073a, before the alignment rule).
Nothing here needs a GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.results_io import RESULTS, machine, write_results

CARDS = {"H200": RESULTS / "gpu_campaign_raw" / "part4.json", "H100": RESULTS / "gpu_campaign_raw_h100" / "part4.json"}
"""Each card's part-4 raw results."""


def _key(row: dict) -> tuple:
    return (row["model"], row["precision"], row["micro_batch"], bool(row["checkpointing"]))


def gpu_seconds(profile, row: dict, gpu: str) -> float:
    """The model's GPU time of one step's forward, backward and optimizer ops (no host floor)."""
    from memplan.planner.costs import _compute_capability, ops_seconds
    from memplan.hardware.catalog import gpu_links

    ops = profile.ops(row["micro_batch"], amp=row["precision"] != "32-true", checkpointing=row["checkpointing"])
    return ops_seconds(ops, gpu_links(gpu), _compute_capability(gpu))


def summary(errors: list[float]) -> dict | None:
    """n, median |error|, worst (signed, largest |error|), median."""
    if not errors:
        return None
    return {"n": len(errors), "median_abs": statistics.median(map(abs, errors)), "worst": max(errors, key=abs),
            "median": statistics.median(errors)}


def card(name: str, raw: Path) -> dict:
    """One card's rows (measured, predicted, error) and its kernel-profile check."""
    from benchmarks.gpu_extra_results import catalog_gpu, cost_profile, predict

    sections = json.loads(raw.read_text())["sections"]
    env = sections["environment"]
    gpu = catalog_gpu(env)
    profiles, sources, rows = {}, {}, []
    for entry_name, entry in sections.items():
        if not entry_name.startswith("step_time_"):
            continue
        for r in entry.get("rows", []):
            if "step_seconds_median" not in r:
                continue
            if r["model"] not in profiles:
                profiles[r["model"]] = cost_profile(r["model"], cpu=False, gpu=gpu, sources=sources)
            p = predict(profiles[r["model"]], r, gpu)
            p["gpu_seconds"] = gpu_seconds(profiles[r["model"]], r, gpu)
            rows.append({"model": r["model"], "precision": r["precision"], "micro_batch": r["micro_batch"],
                         "checkpointing": bool(r["checkpointing"]), "measured_s": r["step_seconds_median"],
                         "predicted": p, "error": p["step_seconds"] / r["step_seconds_median"] - 1})
    kernel = []
    for s in (sections.get("kernel_profile") or {}).get("settings", []):
        row = {"model": "gpt2-small", "precision": s["precision"], "micro_batch": s["micro_batch"], "checkpointing": False}
        if "gpt2-small" not in profiles:
            profiles["gpt2-small"] = cost_profile("gpt2-small", cpu=False, gpu=gpu, sources=sources)
        predicted = gpu_seconds(profiles["gpt2-small"], row, gpu)
        kernel.append({**row, "measured_gpu_busy_s": s["gpu_busy_seconds_per_step"], "predicted_gpu_s": predicted,
                       "error": predicted / s["gpu_busy_seconds_per_step"] - 1})
    return {"card": name, "device": env["gpu"]["name"], "catalog": gpu, "raw": str(raw.relative_to(RESULTS.parent.parent)),
            "torch": env.get("torch"), "rows": rows, "summary": summary([r["error"] for r in rows]),
            "kernel_profile": kernel, "model_sources": sources}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _line(s: dict | None) -> str:
    return "-" if s is None else (f"median |error| {100 * s['median_abs']:.1f} %, worst {100 * s['worst']:+.1f} %, "
                                  f"median {100 * s['median']:+.1f} % ({s['n']} settings)")


def markdown(cards: list[dict], before: dict | None) -> str:
    old = {(c["card"], _key(r)): r["error"] for c in (before or {}).get("cards", []) for r in c["rows"]}
    old_kernel = {(c["card"], _key(r)): r["error"] for c in (before or {}).get("cards", []) for r in c["kernel_profile"]}
    lines = ["# Step-time model vs measured step times on two GPUs", "",
             "`.venv/bin/python -m benchmarks.step_time_cards --baseline benchmarks/results/step_time_cards_before.json`"
             " (benchmarks/step_time_cards.py). Measured: benchmarks/gpu_extra.py `time_model` (one GPU, median of 10 "
             "steps, bf16-mixed without autocast's weight cache, TF32 off for matmuls). Predicted: memplan.planner."
             "predict_step for the card's catalog entry, on two bf16-mixed CPU traces (micro-batch 1 and 4), as "
             "benchmarks.gpu_extra_results predicts. Error = predicted / measured - 1.", ""]
    for c in cards:
        lines += [f"## {c['card']} ({c['device']}, catalog `{c['catalog']}`, torch {c['torch']}; raw `{c['raw']}`)", "",
                  f"**Now: {_line(c['summary'])}.**"]
        if before is not None:
            prev = next((b for b in before["cards"] if b["card"] == c["card"]), None)
            lines.append(f"Before ({before.get('memplan', '?')}): {_line(prev and prev['summary'])}.")
        lines += ["", "| model | precision | micro-batch | checkpointing | measured s | predicted s | GPU-side s | error |"
                  + (" before |" if before else ""),
                  "|---|---|---:|---|---:|---:|---:|---:|" + ("---:|" if before else "")]
        for r in c["rows"]:
            p = r["predicted"]
            lines.append(f"| {r['model']} | {r['precision']} | {r['micro_batch']} | "
                         f"{'full' if r['checkpointing'] else 'none'} | {r['measured_s']:.4f} | {p['step_seconds']:.4f} | "
                         f"{p['gpu_seconds']:.4f} | {_pct(r['error'])} |"
                         + (f" {_pct(old.get((c['card'], _key(r))))} |" if before else ""))
        if c["kernel_profile"]:
            lines += ["", "Kernel profile (torch.profiler, GPT-2 small): measured GPU busy time per step vs the model's "
                      "GPU time (per-op rooflines summed, no host floor):", "",
                      "| precision | micro-batch | measured GPU busy s | predicted GPU s | error |"
                      + (" before |" if before else ""), "|---|---:|---:|---:|---:|" + ("---:|" if before else "")]
            for k in c["kernel_profile"]:
                lines.append(f"| {k['precision']} | {k['micro_batch']} | {k['measured_gpu_busy_s']:.4f} | "
                             f"{k['predicted_gpu_s']:.4f} | {_pct(k['error'])} |"
                             + (f" {_pct(old_kernel.get((c['card'], _key(k))))} |" if before else ""))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="an earlier run's JSON, shown as the 'before' column")
    parser.add_argument("--name", default="step_time_cards", help="results/<name>.{json,md} (default: %(default)s)")
    parser.add_argument("--memplan", default=None, help="the memplan commit the run is on, recorded as is")
    args = parser.parse_args(argv)
    before = json.loads(args.baseline.read_text()) if args.baseline else None
    cards = [card(name, raw) for name, raw in CARDS.items()]
    report = {"memplan": args.memplan, "machine": machine(), "cards": cards,
              "all": summary([r["error"] for c in cards for r in c["rows"]])}
    write_results(args.name, report, markdown(cards, before))
    for c in cards:
        print(c["card"], _line(c["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
