"""The GPU campaign's profiles as committed result files; benchmarks.gpu_results calls it.

  kernel_profile_gpu.{md,json}  part 4's `kernel_profile` (benchmarks.gpu_extra --profile): GPT-2 small's step under
                                torch.profiler per setting: wall time, the GPU's busy time (its kernels' sum), the
                                kernel and aten-op counts, the kernels and aten ops taking the most device time
  op_readings_gpu.{md,json}     part 5 (benchmarks.gpu_ops) summarised: the convolution grid (each convolution's
                                transient memory, from DIR/conv_grid.json) and each zoo step's op-by-op readings (the
                                part's summaries: peaks, and the largest transient of each op kind). The op-by-op
                                rows themselves stay in DIR/ops/<case>.json.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.gpu_report import NOT_MEASURED, header, nbytes, raw_name, section, sections_starting, status_line, write

TOP = 12
"""Kernels, aten ops and convolutions listed per table."""
ANNOTATION = re.compile(r"^[\w.]+#[\w.]+$")
"""A GPU user annotation the profiler lists among the kernels ("Optimizer.step#AdamW.step"): a span over kernels
already counted, so not a kernel of its own."""


# --- part 4: the kernel profile ---------------------------------------------------------------------
def busy_without_annotations(setting: dict) -> float:
    """The GPU's busy seconds per step less the annotation spans the profiler counted as kernels (those listed in
    the setting's top kernels; one outside the top list is not seen here)."""
    spans = sum(us for name, _, us in setting.get("top_kernels", []) if ANNOTATION.match(name))
    return setting["gpu_busy_seconds_per_step"] - spans / 1e6


def kernel_profile(parts: dict[int, dict], env: dict, out) -> None:
    entry = section(parts, "kernel_profile")
    if entry is None or str(entry.get("status")).startswith("skipped"):
        return
    lines = header("GPT-2 small's training step under torch.profiler", env, raw_name(out, "kernel_profile_gpu"))
    lines += status_line(entry, "kernel_profile")
    settings = entry.get("settings", [])
    lines += [f"`benchmarks/gpu_extra.py --profile`: GPT-2 small (transformers), forward + loss, "
              f"zero_grad(set_to_none=True), backward and AdamW's step, 3 warm-up steps then "
              f"{entry.get('steps_profiled')} profiled ones (CPU and CUDA activities), figures per step. Wall: the "
              "profiled steps' wall time, synchronised (the profiler's own cost included); GPU busy: the sum of the "
              "kernels' device time less the profiler's GPU annotation spans (the optimizer step's, a span over "
              "kernels counted already); idle = 1 - busy / wall: where the GPU waited for the host. The profiler "
              "slows the host: the same step unprofiled (part 4's step times, `step_time_gpu` of this card, where "
              "measured) is the figure to compare busy time with.", "",
              "| precision | micro-batch | wall ms/step (profiled) | unprofiled ms/step | GPU busy ms/step | GPU idle "
              "(profiled) | busy / unprofiled | kernels/step | aten ops/step |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    unprofiled = {(r["precision"], r["micro_batch"]): r["step_seconds_median"]
                  for e in sections_starting(parts, "step_time_gpt2-small").values() for r in e.get("rows", [])
                  if not r.get("checkpointing") and r.get("step_seconds_median") is not None}
    rows = []
    for s in settings:
        busy, wall = busy_without_annotations(s), s["wall_seconds_per_step"]
        plain = unprofiled.get((s["precision"], s["micro_batch"]))
        row = {"precision": s["precision"], "micro_batch": s["micro_batch"], "wall_seconds_per_step": wall,
               "unprofiled_step_seconds": plain, "gpu_busy_seconds_per_step": busy,
               "gpu_idle_fraction": 1 - busy / wall if wall > 0 else None,
               "busy_over_unprofiled": None if not plain else busy / plain,
               "kernels_per_step": s["kernels_per_step"], "aten_ops_per_step": s["aten_ops_per_step"]}
        rows.append(row)
        lines.append(f"| {s['precision']} | {s['micro_batch']} | {1e3 * wall:.1f} | "
                     f"{NOT_MEASURED if plain is None else f'{1e3 * plain:.1f}'} | {1e3 * busy:.1f} | "
                     f"{_share(row['gpu_idle_fraction'])} | {_share(row['busy_over_unprofiled'])} | "
                     f"{s['kernels_per_step']:.0f} | {s['aten_ops_per_step']:.0f} |")
    for s in settings:
        busy_us = 1e6 * busy_without_annotations(s)
        kernels = [k for k in s.get("top_kernels", []) if not ANNOTATION.match(k[0])][:TOP]
        lines += ["", f"### {s['precision']}, micro-batch {s['micro_batch']}: the {len(kernels)} kernels taking the "
                  "most device time", "", "| kernel (first 100 characters) | calls/step | us/step | of busy |",
                  "|---|---:|---:|---:|"]
        lines += [f"| `{name[:100]}` | {calls:g} | {us:.0f} | "
                  f"{f'{100 * us / busy_us:.1f}%' if busy_us > 0 else NOT_MEASURED} |" for name, calls, us in kernels]
        ops = s.get("top_aten_ops_device_us", [])[:TOP]
        lines += ["", "| aten op | calls/step | device us/step (its kernels, children's included) | host us/step |",
                  "|---|---:|---:|---:|"]
        lines += [f"| `{name}` | {calls:g} | {dev:.0f} | {host:.0f} |" for name, calls, dev, host in ops]
    write(out, "kernel_profile_gpu", {"environment": env, "steps_profiled": entry.get("steps_profiled"),
                                      "rows": rows, "raw": entry}, lines)


def _share(x: float | None) -> str:
    return NOT_MEASURED if x is None else f"{100 * x:.0f}%"


# --- part 5: op readings ------------------------------------------------------------------------------
def conv_summary(grid: dict) -> dict:
    """The convolution grid's rows summarised: counts, and the rows with the largest transient memory."""
    rows = grid.get("rows", [])
    wide = [r for r in rows if r["transient"] > 0]
    top = sorted(wide, key=lambda r: -r["transient"])[:TOP]
    by_what: dict[str, dict] = {}
    for r in rows:
        w = by_what.setdefault(f"{r['what']}, {r['dtype']}", {"n": 0, "with_transient": 0, "max_transient": 0})
        w["n"] += 1
        w["with_transient"] += r["transient"] > 0
        w["max_transient"] = max(w["max_transient"], r["transient"])
    return {"measurements": len(rows), "errors": len(grid.get("errors", [])), "with_transient": len(wide),
            "by_what": by_what, "largest": top,
            **{k: grid.get(k) for k in ("cudnn", "cudnn_benchmark", "allow_tf32")}}


def _conv_name(r: dict) -> str:
    kind = f"Conv{r['dims']}d" + ("Transpose" if r.get("transposed") else "")
    k, s = "x".join(map(str, r["kernel"])), "x".join(map(str, r["stride"]))
    groups = f", groups {r['groups']}" if r["groups"] != 1 else ""
    return f"{r['source']}: {kind} {r['c_in']}->{r['c_out']} k{k} s{s}{groups}, input {r['batch']}x{'x'.join(map(str, r['sample']))}"


def op_readings(parts: dict[int, dict], env: dict, out) -> None:
    grid_entry, ops_entry = section(parts, "conv_grid"), section(parts, "op_profiles")
    if grid_entry is None and ops_entry is None:
        return
    folder = parts.get(5, {}).get("folder")
    lines = header("Where device memory goes op by op, and each convolution's transient memory", env,
                   raw_name(out, "op_readings_gpu"))
    lines += ["Part 5 of the campaign (`benchmarks/gpu_ops.py`) reads the caching allocator on the GPU, with nothing "
              "of memplan's estimator: (1) the convolution grid: each convolution of the zoo's conv models and a few "
              "other shapes, called directly at two batch sizes in float32, bfloat16 and float16, forward and "
              "backward, each from an emptied cache; transient = the op's peak allocated - what it leaves allocated "
              "(a cuDNN workspace the trace cannot see); (2) op readings: zoo training steps (a real Lightning fit, 2 "
              "steps) under a dispatch mode reading allocated memory before, at the peak inside and after every aten "
              "op; an op's transient = its peak - max(before, after). The raw rows stay in the campaign folder "
              "(conv_grid.json, ops/<case>.json); this file only summarises them.", ""]
    data: dict = {"environment": env}
    if grid_entry is not None:
        lines += ["## The convolution grid", ""] + status_line(grid_entry, "conv_grid")
        path = None if folder is None else Path(folder) / "conv_grid.json"
        if path is None or not path.is_file():
            lines += [f"Rows: {NOT_MEASURED} (no conv_grid.json beside the part files).", ""]
        else:
            s = conv_summary(json.loads(path.read_text()))
            data["conv_grid"] = s
            lines += [f"{s['measurements']} measurements ({s['errors']} failed), cuDNN {s['cudnn']}, "
                      f"cudnn.benchmark {s['cudnn_benchmark']}, cudnn.allow_tf32 {s['allow_tf32']}; "
                      f"{s['with_transient']} of them peak above what they leave allocated.", "",
                      "| call, dtype | measurements | with a transient | largest transient |", "|---|---:|---:|---:|"]
            lines += [f"| {k} | {w['n']} | {w['with_transient']} | {nbytes(w['max_transient'])} |"
                      for k, w in sorted(s["by_what"].items())]
            lines += ["", "The largest transients:", "",
                      "| convolution | dtype | call | input | output | transient |", "|---|---|---|---:|---:|---:|"]
            lines += [f"| {_conv_name(r)} | {r['dtype']} | {r['what']} | {nbytes(r['input_bytes'])} | "
                      f"{nbytes(r['output_bytes'])} | {nbytes(r['transient'])} |" for r in s["largest"]]
            lines.append("")
    if ops_entry is not None:
        lines += ["## Op readings of zoo training steps", ""] + status_line(ops_entry, "op_profiles")
        summaries = ops_entry.get("summaries", {})
        data["op_profiles"] = summaries
        lines += ["| case | precision | ckpt | batch | ops read | step-2 peak allocated | max reserved seen | "
                  "largest transients (op: bytes) |", "|---|---|---|---:|---:|---:|---:|---|"]
        for name in ops_entry.get("cases", list(summaries)):
            s = summaries.get(name)
            if s is None or "error" in s:
                why = NOT_MEASURED if s is None else f"{NOT_MEASURED}: {str(s['error']).splitlines()[-1][:200]}"
                lines.append(f"| {name} | {why} | | | | | | |")
                continue
            biggest = sorted(s.get("largest_transient_by_op", {}).items(), key=lambda kv: -kv[1])[:4]
            lines.append(f"| {name} | {s['precision']} | {s['checkpointing']} | {s['batch']} | {s['ops']} | "
                         f"{nbytes(s['peak_allocated_step2'])} | {nbytes(s['max_reserved_seen'])} | "
                         + ("; ".join(f"{op.removeprefix('aten.')}: {nbytes(b)}" for op, b in biggest) or "none")
                         + " |")
    write(out, "op_readings_gpu", data, lines)
