"""memplan's GPU accuracy: estimates against a real CUDA device, case by case (needs a GPU).

For every zoo case, three fresh processes:
  measure  -- real steps on the GPU: torch.cuda.max_memory_allocated over the steady-state step,
              max_memory_reserved, and the highest NVML per-process usage sampled during the run;
  native   -- memplan.estimate(device=None): traced on fake CUDA tensors (torch has CUDA here);
  emulated -- the same with MEMPLAN_TRACE_ON_CPU=1: fake CPU tensors with CUDA semantics emulated,
              which is how a CPU-only machine estimates for a GPU. The gap native vs emulated is the
              emulation's own error.
Goals (issue): median |error| <= 3 %, worst <= 6 %, never under by more than 2 %.

    python -m benchmarks.accuracy_gpu [--only NAME ...]
writes benchmarks/results/accuracy_gpu.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from benchmarks.results_io import write_results



def _measure(name: str) -> dict:
    from benchmarks.zoo import CASES, make_optimizer
    from memplan.estimator.measure import measure_cuda_peak

    case = CASES[name]
    m = measure_cuda_peak(
        case.build, lambda: case.make_batch(case.batch_size), loss=case.loss,
        optimizer=lambda params: make_optimizer(case.optimizer, params),
        precision=case.precision, checkpointing=case.checkpointing,
    )
    return {"max_allocated": m.max_allocated, "max_reserved": m.max_reserved, "nvml_process_peak": m.nvml_process_peak}


def _estimate(name: str) -> dict:
    from benchmarks.zoo import CASES
    from memplan.estimator.api import estimate

    case = CASES[name]
    est = estimate(case.build, case.make_batch(case.batch_size), loss=case.loss, optimizer=case.optimizer,
                   precision=case.precision, checkpointing=case.checkpointing, device=None)
    return {"peak_allocated": est.peak_allocated, "peak_reserved": est.peak_reserved,
            "device_total": est.device_total, "trace_seconds": est.trace_seconds, "device": est.device}


def _child(mode: str, name: str, *, emulate: bool = False) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if emulate:
        env["MEMPLAN_TRACE_ON_CPU"] = "1"
    out = subprocess.run([sys.executable, "-m", "benchmarks.accuracy_gpu", f"--{mode}", name],
                         capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _err(estimated: int | None, truth: int | None) -> float | None:
    if not estimated or not truth:
        return None
    return (estimated - truth) / truth


def run(names: list[str]) -> dict:
    rows = []
    for name in names:
        truth = _child("measure", name)
        native = _child("estimate", name)
        emulated = _child("estimate", name, emulate=True)
        row = {"case": name, "truth": truth, "native": native, "emulated": emulated}
        for label, est in (("native", native), ("emulated", emulated)):
            row[f"{label}_err_allocated"] = _err(est.get("peak_allocated"), truth.get("max_allocated"))
            row[f"{label}_err_reserved"] = _err(est.get("peak_reserved"), truth.get("max_reserved"))
            row[f"{label}_err_nvml"] = _err(est.get("device_total"), truth.get("nvml_process_peak"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {}
    for key in ("native_err_allocated", "native_err_reserved", "native_err_nvml",
                "emulated_err_allocated", "emulated_err_reserved", "emulated_err_nvml"):
        errs = [r[key] for r in rows if r[key] is not None]
        if errs:
            summary[key] = {"median_abs": statistics.median(abs(e) for e in errs),
                            "worst_abs": max(abs(e) for e in errs), "most_under": min(errs), "n": len(errs)}
    import torch

    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "machine": platform.platform(), "summary": summary, "rows": rows}


def write(report: dict) -> None:
    lines = [f"# GPU accuracy ({report['gpu']}, torch {report['torch']}, {report['date']})", "",
             "| metric | median abs | worst abs | most under | n |", "|---|---|---|---|---|"]
    for key, s in report["summary"].items():
        lines.append(f"| {key} | {100 * s['median_abs']:.2f}% | {100 * s['worst_abs']:.2f}% | "
                     f"{100 * s['most_under']:+.2f}% | {s['n']} |")
    lines += ["", "| case | truth allocated | native err | emulated err | truth reserved | native err | NVML | native err |",
              "|---|---|---|---|---|---|---|---|"]
    pct = lambda e: "-" if e is None else f"{100 * e:+.2f}%"  # noqa: E731
    for r in report["rows"]:
        t = r["truth"]
        lines.append(f"| {r['case']} | {t.get('max_allocated', t.get('error'))} | {pct(r['native_err_allocated'])} | "
                     f"{pct(r['emulated_err_allocated'])} | {t.get('max_reserved', '-')} | {pct(r['native_err_reserved'])} | "
                     f"{t.get('nvml_process_peak', '-')} | {pct(r['native_err_nvml'])} |")
    write_results("accuracy_gpu", report, "\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", metavar="CASE")
    parser.add_argument("--estimate", metavar="CASE")
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(_measure(args.measure)))
        return 0
    if args.estimate:
        print(json.dumps(_estimate(args.estimate)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("accuracy_gpu needs a CUDA GPU; none is available here", file=sys.stderr)
        return 2
    from benchmarks.zoo import CASES

    write(run(args.only or list(CASES)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
