"""memplan's GPU accuracy: estimates against a real CUDA device, case by case (needs a GPU).

For every zoo case, and the zoo's missing fp32 / bf16-mixed / 16-mixed x checkpointing variants
(`all_cases`), three fresh processes:
  measure  -- real steps on the GPU: torch.cuda.max_memory_allocated over the steady-state step,
              max_memory_reserved, and the highest NVML per-process usage sampled during the run;
  native   -- memplan.estimate(device=None) with MEMPLAN_TRACE_ON_CPU=0: traced on fake CUDA tensors (torch has
              CUDA here);
  emulated -- the same with MEMPLAN_TRACE_ON_CPU=1: fake CPU tensors with CUDA semantics emulated, how memplan
              estimates for a GPU by default (on a CPU-only machine and, since session 9, on a GPU machine too).
Goals (issue): median |error| <= 3 %, worst <= 6 %, never under by more than 2 %.

    python -m benchmarks.accuracy_gpu [--only NAME ...]
writes benchmarks/results/accuracy_gpu.json and .md. The GPU campaign (benchmarks.gpu_campaign) runs the same
children in parallel under a deadline; `--measure/--estimate NAME --cpu` is its dry run's CPU stand-in.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from benchmarks.processes import environment_variable
from benchmarks.results_io import write_results

EXTRA_FAMILIES = ("mlp", "resnet18", "gpt2", "bert", "llama-gqa", "vit", "t5", "bart")
"""Families whose first zoo case is also run in every precision x checkpointing the zoo lacks (on a GPU,
16-mixed is as fast as bf16-mixed, which it is not on CPU). The MLP has no repeated block to checkpoint."""
EXTRA_PRECISIONS = ("16-mixed", "bf16-mixed", "32-true")
"""In this order: the precision the zoo covers least first, so a run cut short keeps the most new figures."""


def extra_cases() -> dict:
    """The zoo's missing fp32 / bf16-mixed / 16-mixed x checkpointing variants, named like the zoo's."""
    from dataclasses import replace

    from benchmarks.zoo import CASES

    seen = {(c.family, c.batch_size, c.precision, c.checkpointing, c.optimizer) for c in CASES.values()}
    out = {}
    for precision in EXTRA_PRECISIONS:
        for family in EXTRA_FAMILIES:
            base = next(c for c in CASES.values() if c.family == family)
            for ckpt in (False, True) if family != "mlp" else (False,):
                key = (family, base.batch_size, precision, ckpt, base.optimizer)
                if key in seen:
                    continue
                seen.add(key)
                tag = {"32-true": "", "bf16-mixed": "-bf16mixed", "16-mixed": "-16mixed"}[precision]
                name = f"{family}-b{base.batch_size}{tag}{'-ckpt' if ckpt else ''}-gpu"
                out[name] = replace(base, name=name, precision=precision, checkpointing=ckpt)
    return out


def all_cases() -> dict:
    """The zoo's cases, then the extra GPU variants."""
    from benchmarks.zoo import CASES

    return {**CASES, **extra_cases()}


def _measure(name: str, cpu: bool = False) -> dict:
    """The truth in this process: real steps on the GPU (with `cpu`: the profiler's peak on CPU, the dry run)."""
    from benchmarks.zoo import make_optimizer
    from memplan.truth import measure_cpu_peak, measure_cuda_peak

    case = all_cases()[name]
    kwargs = dict(loss=case.loss, optimizer=lambda params: make_optimizer(case.optimizer, params),
                  precision=case.precision, checkpointing=case.checkpointing, loop=case.loop)
    if cpu:
        peak = measure_cpu_peak(case.build, lambda: case.make_batch(case.batch_size), **kwargs)
        return {"device": "cpu", "max_allocated": peak, "max_reserved": None, "nvml_process_peak": None}
    m = measure_cuda_peak(case.build, lambda: case.make_batch(case.batch_size), **kwargs)
    return {"device": "cuda", "max_allocated": m.max_allocated, "max_reserved": m.max_reserved,
            "nvml_process_peak": m.nvml_process_peak}


def _estimate(name: str, cpu: bool = False) -> dict:
    from memplan.estimator.api import estimate

    case = all_cases()[name]
    est = estimate(case.build, case.make_batch(case.batch_size), loss=case.loss, optimizer=case.optimizer,
                   precision=case.precision, checkpointing=case.checkpointing, device="cpu" if cpu else None,
                   loop=case.loop)  # the order _measure trains in (vit-b8-16mixed, mlp-b256-16mixed: a plain loop)
    return {"peak_allocated": est.peak_allocated, "peak_reserved": est.peak_reserved,
            "device_total": est.device_total, "cuda_context": est.cuda_context, "workspaces": est.workspaces,
            "trace_seconds": est.trace_seconds, "device": est.device}


def child_command(mode: str, name: str, *, cpu: bool = False, emulate: bool = False) -> tuple[list[str], dict]:
    """(argv, env) of the fresh process that measures or estimates one case."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["MEMPLAN_TRACE_ON_CPU"] = "1" if emulate else "0"
    return [sys.executable, "-m", "benchmarks.accuracy_gpu", f"--{mode}", name, *(["--cpu"] if cpu else [])], env


def dry_case(name: str) -> dict:
    """{"truth", "native", "emulated"}: the GPU campaign dry run's three children of one case, run in this process
    on CPU (the profiler's peak first, then the native and the emulated estimate); each failure is recorded as a
    failed child's {"error"}. On CPU nothing carries over from one to the next; a GPU needs each in a fresh
    process (allocator state, CUDA context)."""
    out: dict[str, dict] = {}
    for what, emulate in (("truth", False), ("native", False), ("emulated", True)):
        try:
            with environment_variable("MEMPLAN_TRACE_ON_CPU", "1" if emulate else "0") if what != "truth" \
                    else contextlib.nullcontext():
                out[what] = _measure(name, cpu=True) if what == "truth" else _estimate(name, cpu=True)
        except Exception as err:  # noqa: BLE001 -- as a failed child: recorded, the others still run
            out[what] = {"error": f"{type(err).__name__}: {err}"}
    return out


def parse_child(returncode: int, stdout: str, stderr: str) -> dict:
    """The child's JSON line, or {"error": its last stderr line}."""
    if returncode != 0:
        return {"error": stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {returncode}"}
    return json.loads(stdout.strip().splitlines()[-1])


def _child(mode: str, name: str, *, emulate: bool = False) -> dict:
    argv, env = child_command(mode, name, emulate=emulate)
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    return parse_child(out.returncode, out.stdout, out.stderr)


def _err(estimated: int | None, truth: int | None) -> float | None:
    if not estimated or not truth:
        return None
    return (estimated - truth) / truth


def make_row(name: str, truth: dict, native: dict, emulated: dict) -> dict:
    """One case's figures and errors ((estimate - truth) / truth) against each of the three truths."""
    row = {"case": name, "truth": truth, "native": native, "emulated": emulated}
    for label, est in (("native", native), ("emulated", emulated)):
        row[f"{label}_err_allocated"] = _err(est.get("peak_allocated"), truth.get("max_allocated"))
        row[f"{label}_err_reserved"] = _err(est.get("peak_reserved"), truth.get("max_reserved"))
        row[f"{label}_err_nvml"] = _err(est.get("device_total"), truth.get("nvml_process_peak"))
    return row


ERROR_KEYS = ("native_err_allocated", "native_err_reserved", "native_err_nvml",
              "emulated_err_allocated", "emulated_err_reserved", "emulated_err_nvml")


def summarize(rows: list[dict]) -> dict:
    """Median and worst |error| and the most negative error of each figure over the rows that have it."""
    summary = {}
    for key in ERROR_KEYS:
        errs = [r[key] for r in rows if r.get(key) is not None]
        if errs:
            summary[key] = {"median_abs": statistics.median(abs(e) for e in errs),
                            "worst_abs": max(abs(e) for e in errs), "most_under": min(errs), "n": len(errs)}
    return summary


def run(names: list[str]) -> dict:
    rows = []
    for name in names:
        rows.append(make_row(name, _child("measure", name), _child("estimate", name),
                             _child("estimate", name, emulate=True)))
        print(json.dumps(rows[-1]), flush=True)
    import torch

    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "machine": platform.platform(), "summary": summarize(rows), "rows": rows}


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
    parser.add_argument("--cpu", action="store_true",
                        help="with --measure / --estimate: on CPU (the GPU campaign's dry run)")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(_measure(args.measure, args.cpu)))
        return 0
    if args.estimate:
        print(json.dumps(_estimate(args.estimate, args.cpu)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("accuracy_gpu needs a CUDA GPU; none is available here", file=sys.stderr)
        return 2
    write(run(args.only or list(all_cases())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
