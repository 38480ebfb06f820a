"""Turn the GPU campaign's raw results (DIR/part1.json .. DIR/part5.json, and follow-up calls' DIR/part1b.json ...)
into committed result files.

    python -m benchmarks.gpu_results DIR [--results benchmarks/results] [--card h100]

writes, for whatever the parts measured (a section that failed, ran out of time or never started says so, and
each figure it lacks reads "not measured"):
  accuracy_gpu.{md,json}        estimates vs torch's and NVML's peaks, native and CPU-emulated, per case (part 1;
                                each case from the newest call that measured it, named with its memplan commit)
  cuda_overheads_gpu.{md,json}  CUDA context, cuBLAS workspaces, kernels, allocator segments; the JSON's
                                `replaces` maps each constant of memplan/estimator/cuda/overheads.py to the measured figure
  calibration_gpu.json          the same as a memplan calibration file (MEMPLAN_CALIBRATION=... on that machine)
  validate_gpu.{md,json}        `memplan validate` on the GPU, before and with its calibration
  plan_vs_bisect_gpu.{md,json}  planned micro-batch vs the largest that runs; planning vs BatchSizeFinder time (part 2)
  callback_gpu.{md,json}        MemoryPlanner through a real CUDA OOM, NVML readings, overhead per step (part 2)
  memory_gaps_gpu.{md,json}     the published-figure gap cases: truth vs native and emulated estimates (part 3)
  step_time_gpu.{md,json}       measured step times vs memplan's predicted step time, predicted here on CPU (part 4)
  kernel_profile_gpu.{md,json}  GPT-2 small's step under torch.profiler: wall vs GPU busy time, top kernels (part 4)
  op_readings_gpu.{md,json}     part 5 summarised: the convolution grid's transients, each zoo step's op readings
With --card NAME every name ends _gpu_NAME instead (accuracy_gpu_h100.md): a second card's results beside the first's,
or a run under another allocator setting (`benchmarks/results/gpu_campaign_raw_expandable --card expandable`; a
heading names a PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF the run recorded). A file's header names the calls its
own sections came from: a follow-up call that did not re-measure a section leaves that section's file as it was.
Every Markdown file names the device, driver, torch and CUDA versions of the part it renders. A dry run's results
are refused for benchmarks/results (they are CPU figures); render them elsewhere with --results.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.gpu_accuracy_results import accuracy, context_of
from benchmarks.gpu_report import (NOT_MEASURED, Results, environment, header, load_parts, one_line, raw_name, section,
                                   sections_starting, status_line, value, write)
from benchmarks.gpu_report import nbytes as _b
from benchmarks.gpu_report import seconds as _f

RESULTS = Path(__file__).resolve().parent / "results"


# --- CUDA overheads -> constants -------------------------------------------------------------------
def overheads(parts, env, out: Path) -> None:
    entry = section(parts, "cuda_overheads")
    if entry is None:
        return
    lazy, eager = entry.get("lazy") or {}, entry.get("eager") or {}
    acc = [r for name in ("accuracy_zoo", "accuracy_extra") for r in (section(parts, name) or {}).get("rows", [])]
    contexts = [c for c in (context_of(r["truth"]) for r in acc) if c is not None]
    overheads_ratio = [r["truth"]["max_reserved"] / r["truth"]["max_allocated"] for r in acc
                       if r["truth"].get("max_reserved") and r["truth"].get("max_allocated")]
    gpu = env.get("gpu") or {}
    cc = tuple(gpu["compute_capability"]) if gpu.get("compute_capability") else None
    measured = derive_constants(lazy, eager, contexts)
    replaces = _replaces(measured, cc)
    lines = header("CUDA memory besides tensors, measured", env, raw_name(out, "cuda_overheads_gpu"))
    lines += status_line(entry, "cuda_overheads")
    if "skipped" in lazy:
        lines += [f"Not measured: {lazy['skipped']}.", ""]
    lines += ["| figure | measured | memplan now | where |", "|---|---:|---:|---|"]
    for name, r in replaces.items():
        lines.append(f"| {name} | {_b(r['measured']) if r['unit'] == 'bytes' else r['measured']} | "
                     f"{_b(r['now']) if r['unit'] == 'bytes' else r['now']} | {r['how']} |")
    for name, how in (("cudnn_outside_allocator", "cuDNN handle + conv kernels, outside the allocator"),
                      ("sdpa_outside_allocator", "bf16 SDPA kernels, outside the allocator"),
                      ("nccl_one_rank_outside_allocator", "a 1-rank NCCL group + all-reduce, outside the allocator"),
                      ("cudnn_workspace_peak", "peak allocated above the start during a conv fwd+bwd"),
                      ("context_bare", "CUDA context after the first tensor (nothing else loaded)"),
                      ("context_after_kernels", "the same after cuBLAS, cuDNN and SDPA kernels ran")):
        lines.append(f"| {name} | {_b(measured.get(name))} | no constant | {how} |")
    alloc = lazy.get("allocator") or {}
    if alloc:
        lines += ["", f"Caching allocator: {len(alloc.get('rows', []))} steps of a fixed malloc/free sequence "
                  f"replayed on torch and on memplan's CachingAllocatorModel; {alloc.get('mismatches')} steps differ.", "",
                  "| step | torch allocated | model | torch reserved | model |", "|---|---:|---:|---:|---:|"]
        for r in alloc.get("rows", []):
            lines.append(f"| {r['op']} | {r['allocated']} | {r['model_allocated']} | {r['reserved']} | "
                         f"{r['model_reserved']} |")
    if overheads_ratio:
        lines += ["", f"Allocator overhead (max_memory_reserved / max_memory_allocated) over {len(overheads_ratio)} "
                  f"zoo cases: median {statistics.median(overheads_ratio):.4f}, max {max(overheads_ratio):.4f}."]
    errors = {**(lazy.get("errors") or {}), **({"eager": eager["error"]} if "error" in eager else {})}
    if errors:
        lines += ["", "Sub-measurements that failed:", ""] + [f"- {k}: {v[:300]}" for k, v in errors.items()]
    calibration = _calibration(parts, env, measured, overheads_ratio, cc)
    write(out, "cuda_overheads_gpu", {"environment": env, "measured": measured, "replaces": replaces,
                                       "calibration": calibration, "raw": entry}, lines)
    if calibration is not None and not env.get("dry_run"):
        folder = out.folder if isinstance(out, Results) else out
        (folder / f"{raw_name(out, 'calibration_gpu')}").write_text(json.dumps(
            {"format": 1, "entries": {_key_str(calibration["key"]): calibration}}, indent=2) + "\n")


def derive_constants(lazy: dict, eager: dict, contexts: list[int]) -> dict:
    """The figures the constants come from (bytes; None where not measured)."""
    def get(d: dict | None, *keys):
        for k in keys:
            if not isinstance(d, dict) or d.get(k) is None:
                return None
            d = d[k]
        return d

    snaps = {s["label"]: s for s in lazy.get("snapshots", [])}
    cublas = lazy.get("cublas") or {}
    main, autograd = cublas.get("main_thread_workspace"), cublas.get("autograd_thread_workspace")
    return {
        "context_bare": get(lazy, "context", "outside_allocator"),
        "context_after_kernels": get(snaps, "nccl: before init", "outside_allocator")
        or get(snaps, "sdpa: after attention forward + backward", "outside_allocator"),
        "context_training_step_max": max(contexts) if contexts else None,
        "context_training_step_median": int(statistics.median(contexts)) if contexts else None,
        "context_eager": get(eager, "context", "outside_allocator"),
        "cublas_workspace": main,
        "cublas_workspaces_per_step": None if main is None or autograd is None else 1 + (autograd >= main // 2 > 0),
        "cublaslt_separate_workspace": cublas.get("cublaslt_extra_workspace"),
        "cudnn_outside_allocator": get(lazy, "cudnn", "outside_allocator"),
        "cudnn_workspace_peak": get(lazy, "cudnn", "peak_allocated_above_start"),
        "sdpa_outside_allocator": get(lazy, "sdpa", "outside_allocator"),
        "nccl_one_rank_outside_allocator": get(lazy, "nccl_one_rank", "outside_allocator"),
    }


def _replaces(measured: dict, cc: tuple[int, int] | None) -> dict:
    """Each constant of memplan/estimator/cuda/overheads.py, what memplan uses now for this GPU, and the measured figure
    (the module's private names are read with getattr: a renamed one shows as '-', never stops the report)."""
    from memplan.estimator.cuda import overheads as cuda

    now = cuda.cuda_overheads(cc, env={}) if cc else None
    eager = cuda.cuda_overheads(cc, env={"CUDA_MODULE_LOADING": "EAGER"}) if cc else None
    major = None if cc is None else min(max(cc[0], 7), 9)
    big = cc is not None and cc[0] in getattr(cuda, "_CUBLAS_BIG_MAJORS", (9, 10, 11, 12))
    lazy, how = measured["context_training_step_max"], ("max over the zoo of NVML's process peak - "
                                                         "max_memory_reserved (a training step's context)")
    if lazy is None:  # NVML saw no training process: the probe's context after cuBLAS, cuDNN and SDPA kernels
        lazy, how = measured["context_after_kernels"], ("the probe's context after cuBLAS, cuDNN and SDPA kernels "
                                                        "(NVML saw no zoo process)")
    return {
        f"_CONTEXT_LAZY_BYTES[{major}]": {
            "unit": "bytes", "now": None if now is None else now.context_bytes, "measured": lazy, "how": how},
        "_CONTEXT_EAGER_BYTES": {"unit": "bytes", "now": None if eager is None else eager.context_bytes,
                                 "measured": measured["context_eager"],
                                 "how": "CUDA_MODULE_LOADING=EAGER: context after the first tensor (memplan's "
                                        "figure adds the step's cuBLAS handles)"},
        "_CUBLAS_BIG_BYTES" if big else "_CUBLAS_DEFAULT_BYTES": {
            "unit": "bytes", "now": None if now is None else now.cublas_workspace_bytes,
            "measured": measured["cublas_workspace"],
            "how": "allocated bytes the first fp32 matmul leaves beyond its output"},
        "CudaOverheads.cublas_workspaces": {
            "unit": "count", "now": None if now is None else now.cublas_workspaces,
            "measured": measured["cublas_workspaces_per_step"],
            "how": "1 + whether the first backward (autograd's thread) allocated its own workspace"},
        "CudaOverheads.cublaslt_workspace_bytes": {
            "unit": "bytes", "now": None if now is None else now.cublaslt_workspace_bytes,
            "measured": measured["cublaslt_separate_workspace"],
            "how": "allocated bytes a bf16 addmm (cuBLASLt) leaves beyond its output"},
    }


def _calibration(parts, env, measured: dict, ratios: list[float], cc) -> dict | None:
    """A memplan Calibration entry (dict) from the measured figures, keyed like `memplan validate`'s."""
    validate = section(parts, "validate") or {}
    saved = (validate.get("calibration_file") or {}).get("entries") or {}
    key = next(iter(saved.values()))["key"] if saved else None
    if key is None and env.get("gpu") and env.get("driver"):
        key = {"gpu_name": env["gpu"]["name"], "driver_version": env["driver"], "torch_version": env.get("torch"),
               "cuda_version": env.get("torch_cuda"), "module_loading": "LAZY"}
    context = measured.get("context_training_step_max") or measured.get("context_after_kernels")
    if key is None or context is None or cc is None:
        return None
    return {"key": key, "compute_capability": list(cc), "context_bytes": int(context),
            "allocator_overhead": max(1.0, statistics.median(ratios)) if ratios else 1.0}


def _key_str(key: dict) -> str:
    from memplan.estimator.calibration import CalibrationKey

    return CalibrationKey(**key).as_str()


# --- validate, plan vs bisect, callback ------------------------------------------------------------
def validate(parts, env, out: Path) -> None:
    entry = section(parts, "validate")
    if entry is None:
        return
    lines = header("`memplan validate` on the GPU", env, raw_name(out, "validate_gpu"))
    lines += status_line(entry, "validate")
    lines += ["Each config twice: the first run measures and saves the calibration (CUDA context, allocator "
              "overhead), the second estimates with it. Goal on a GPU: at most 6 % over and 2 % under.", "",
              "| run | figure | estimate | measured | error | within goal |", "|---|---|---:|---:|---:|---|"]
    for name, run in entry.items():
        if not isinstance(run, dict) or "command" not in run:
            continue
        got = run.get("json")
        if got is None:
            lines.append(f"| {name} | exit {run.get('exit')}: {(run.get('stderr_tail') or '')[-200:]} | | | | |")
            continue
        for r in got.get("rows", []):
            lines.append(f"| {name} | {r['name']} | {_b(r['estimate_bytes'])} | {_b(r['measured_bytes'])} | "
                         f"{r['error_pct']:+.2f}% | {r['within_goal']} |")
    cal = entry.get("calibration_file")
    lines += ["", "Calibration written: " + ("none" if not cal else "; ".join(
        f"{k}: context {_b(v['context_bytes'])}, allocator overhead {v['allocator_overhead']:.4f}"
        for k, v in cal.get("entries", {}).items()))]
    write(out, "validate_gpu", {"environment": env, "validate": entry}, lines)


def plan_vs_bisect(parts, env, out: Path) -> None:
    entries = sections_starting(parts, "plan_vs_bisect_")
    if not entries:
        return
    lines = header("memplan's micro-batch vs the largest that runs, and planning time", env, raw_name(out, "plan_vs_bisect_gpu"))
    for name, e in entries.items():
        lines += status_line(e, name)
    lines += ["Goals: memplan's largest micro-batch runs and is >= 90 % of the truth; `memplan suggest` takes "
              "<= 1/10 of BatchSizeFinder(mode=\"binsearch\")'s time.", "",
              "| config | precision | ckpt | planned (runs) | memplan max (runs) | truth max (first OOM) | ratio | "
              "suggest s | BatchSizeFinder s (its batch) | time ratio | goals |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    steps = []
    for name, e in entries.items():
        if e.get("config") is None:  # skipped: its status line says so
            continue
        ratio, tr = e.get("ratio"), e.get("suggest_over_batch_size_finder")
        met = None if ratio is None or tr is None else (ratio >= 0.9 and e.get("memplan_max_runs") and tr <= 0.1)
        ran = [p["micro_batch"] for p in e.get("probes", []) if p.get("fits")]
        # a search cut short has not set whether memplan's sizes ran; the steps it did run may say
        probed = {p["micro_batch"]: p.get("fits") for p in e.get("probes", [])}
        e = dict(e, planned_runs=e.get("planned_runs", probed.get(e.get("planned_micro_batch"))),
                 memplan_max_runs=e.get("memplan_max_runs", probed.get(e.get("memplan_max_micro_batch"))))
        # a truth no step failed above is the search's cap: the largest that runs is at least that
        capped = "<= " if e.get("truth_max_micro_batch") is not None and e.get("truth_first_oom") is None else ""
        truth = (f"{e['truth_max_micro_batch']} ({value(e.get('truth_first_oom'))})"
                 if e.get("truth_max_micro_batch") is not None and e.get("truth_first_oom") is not None
                 else f"{e['truth_max_micro_batch']} (none failed up to the search's cap)"
                 if e.get("truth_max_micro_batch") is not None
                 else f"{NOT_MEASURED} (search cut short; {max(ran)} ran)" if ran else NOT_MEASURED)
        lines.append(f"| {e.get('config')} | {e.get('precision')} | {e.get('checkpointing')} | "
                     f"{value(e.get('planned_micro_batch'))} ({_ran(e.get('planned_runs'))}) | "
                     f"{value(e.get('memplan_max_micro_batch'))} ({_ran(e.get('memplan_max_runs'))}) | {truth} | "
                     f"{NOT_MEASURED if ratio is None else f'{capped}{100 * ratio:.0f}%'} | {_f(e.get('suggest_seconds'))} | "
                     f"{_f(e.get('batch_size_finder_seconds'))} ({value(e.get('batch_size_finder_batch'))}) | "
                     f"{NOT_MEASURED if tr is None else f'{tr:.3f}'} | "
                     f"{NOT_MEASURED if met is None else 'met' if met else 'NOT met'} |")
        steps += [(e["config"], p) for p in e.get("probes", [])]
    if steps:
        lines += ["", "Real steps run (each in a fresh process), in the order the search ran them:", "",
                  "| config | micro-batch | ran | max_memory_reserved | NVML process peak | seconds |",
                  "|---|---:|---|---:|---:|---:|"]
        for config, p in steps:
            lines.append(f"| {config} | {p.get('micro_batch')} | {_ran(p.get('fits'))} | {_b(p.get('max_reserved'))} | "
                         f"{_b(p.get('nvml_process_peak'))} | {_f(p.get('seconds'))} |")
    write(out, "plan_vs_bisect_gpu", {"environment": env, "rows": list(entries.values())}, lines)


def _ran(fits: bool | None) -> str:
    return NOT_MEASURED if fits is None else "runs" if fits else "OOM"


def callback(parts, env, out: Path) -> None:
    oom, ovh = section(parts, "oom_retry"), section(parts, "callback_overhead")
    if oom is None and ovh is None:
        return
    lines = header("MemoryPlanner on the GPU: a real OOM, NVML readings, overhead", env, raw_name(out, "callback_gpu"))
    if oom is not None:
        lines += ["## A batch too large for the card", ""] + status_line(oom, "oom_retry")
        log = oom.get("rank_log")
        if log is None:
            lines += [f"The fit's rank log: {NOT_MEASURED} (the probe ended before it returned one).", ""]
        log = log or {}
        lines += [] if "loaded_batch" not in oom else [f"GPT-2-small-class model ({oom.get('precision')}), loaded batch {oom.get('loaded_batch')} planned as "
                  f"one micro-batch (memplan's estimate puts it at ~1.5x the card's {_b(oom.get('device_total_bytes'))}). "
                  f"Finished: {oom.get('finished')} ({oom.get('global_step')} steps, {_f(oom.get('fit_seconds'))} s). "
                  f"Log events: {log.get('events')}.", ""]
        for e in log.get("notable", []):
            if e.get("event") in ("oom_retry", "change", "exception"):
                lines.append(f"- {json.dumps(e)[:400]}")
        if log.get("readings"):
            lines += ["", "| step | process (NVML) | device used | device total | headroom | micro-batch | guarded |",
                      "|---:|---:|---:|---:|---:|---:|---|"]
        for r in log.get("readings", []):
            lines.append(f"| {r.get('step')} | {_b(r.get('process_bytes'))} | {_b(r.get('device_used_bytes'))} | "
                         f"{_b(r.get('device_total_bytes'))} | {_b(r.get('headroom_bytes'))} | "
                         f"{r.get('micro_batch_size')} | {r.get('guarded')} |")
        lines.append("")
    if ovh is not None:
        lines += ["## Overhead per step", ""] + status_line(ovh, "callback_overhead")
        if "own_us_per_step" in ovh:
            goal = "met" if ovh["own_overhead"] < 0.005 else "NOT met"
            lines += [f"gpt2-small, micro-batch {ovh.get('micro_batch')}, {ovh.get('precision')}, {ovh.get('steps')} "
                      f"steps a run ({ovh.get('repeat')} runs without and with, interleaved), default interval.", "",
                      "| ms/step without | ms/step with | end to end | own code us/step | any callback's dispatch "
                      "us/step | own code / step | goal < 0.5 % |", "|---:|---:|---:|---:|---:|---:|---|",
                      f"| {ovh['median_step_ms_without']:.2f} | {ovh['median_step_ms_with']:.2f} | "
                      f"{100 * ovh['end_to_end_overhead']:+.2f}% | {ovh['own_us_per_step']:.1f} | "
                      f"{ovh['floor_us_per_step']:.1f} | {100 * ovh['own_overhead']:.3f}% | {goal} |"]
        failed = [r for r in ovh.get("runs", []) if "error" in r]
        lines += [""] + [f"- run `{r['arm']}` failed: {one_line(r['error'])[:300]}" for r in failed] if failed else []
    write(out, "callback_gpu", {"environment": env, "oom_retry": oom, "overhead": ovh}, lines)


def convert(folder: Path, out: Path, card: str = "") -> list[str]:
    """Write every result file the parts allow (names ending `_gpu`, or `_gpu_<card>`); the names written."""
    from benchmarks import gpu_extra_results, gpu_profile_results

    parts = load_parts(folder)
    target = Results(out, card)
    started = time.time()
    # part 1's files name the calls their own sections came from (a follow-up call may re-measure one section)
    for part, fn, sections in ((1, overheads, ("cuda_overheads",)), (1, accuracy, ("accuracy_zoo", "accuracy_extra")),
                               (1, validate, ("validate",)), (2, plan_vs_bisect, ()), (2, callback, ()),
                               (3, gpu_extra_results.memory_gaps, ()), (4, gpu_extra_results.step_times, ()),
                               (4, gpu_profile_results.kernel_profile, ()), (5, gpu_profile_results.op_readings, ())):
        fn(parts, environment(parts, part, sections), target)
    pattern = f"*_gpu_{card}.*" if card else "*_gpu.*"
    return sorted(p.name for p in out.glob(pattern) if p.stat().st_mtime >= started - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="the folder holding part1.json .. part5.json (and follow-ups: part1b.json ...)")
    parser.add_argument("--results", default=str(RESULTS), help="where to write (default benchmarks/results)")
    parser.add_argument("--card", default="", help="end every file name with _<card> (e.g. h100: accuracy_gpu_h100.md), "
                        "so a second card's results sit beside the first's")
    args = parser.parse_args(argv)
    if args.card and not args.card.replace("-", "").isalnum():
        print(f"gpu_results: --card {args.card!r} goes into file names: use letters, digits and '-' (e.g. h100)",
              file=sys.stderr)
        return 2
    try:
        parts = load_parts(Path(args.folder))
    except ValueError as err:
        print(f"gpu_results: {err}", file=sys.stderr)
        return 2
    out = Path(args.results)
    if any(d.get("dry_run") for d in parts.values()) and out.resolve() == RESULTS.resolve():
        print(f"gpu_results: {args.folder} holds a dry run (CPU figures); pass --results DIR to render it "
              "outside benchmarks/results", file=sys.stderr)
        return 2
    for name in convert(Path(args.folder), out, args.card):
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
