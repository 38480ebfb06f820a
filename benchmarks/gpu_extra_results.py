"""The GPU campaign's parts 3 and 4 (benchmarks.gpu_extra) as committed result files; benchmarks.gpu_results calls it.

  memory_gaps_gpu.{md,json}  each gap case's truth (max_memory_allocated / reserved over the steady-state steps)
                             against memplan's native (fake CUDA on that GPU) and emulated (MEMPLAN_TRACE_ON_CPU=1)
                             estimates, signed errors; a failed estimate with its exception's line
  step_time_gpu.{md,json}    each measured step time against memplan.planner.predict_step's for the same model,
                             micro-batch, precision and checkpointing on the measured GPU (its catalog entry), with
                             the cost profile built as the planner builds it: bf16-mixed traces, no checkpointing, at
                             micro-batch 1 and PROBE_MICRO, the rest derived. The traces run here, on CPU.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.gpu_report import (NOT_MEASURED, header, nbytes, one_line, pct, raw_name, section, sections_starting,
                                   status_line, write)

FIGURES = ("allocated", "reserved")
DRY_RUN_GPU = "H200"
"""The catalog GPU a dry run's (CPU) step times are predicted for: the mechanics only, no comparison."""


# --- part 3: memory gaps ----------------------------------------------------------------------------
def gap_row(name: str, got: dict) -> dict:
    """One case's truth, estimates and signed errors (None where a side is missing)."""
    missing = {"skipped": "no result: not run, or the part ended first"}
    truth = got.get("truth") or missing
    row = {"case": name, "truth": truth, "native": got.get("native") or missing,
           "emulated": got.get("emulated") or missing}
    for figure in FIGURES:
        measured = truth.get(f"steady_max_{figure}")
        for kind in ("native", "emulated"):
            estimate = row[kind].get(f"peak_{figure}")
            row[f"{kind}_err_{figure}"] = (None if measured is None or estimate is None
                                           else (estimate - measured) / measured)
    return row


def summarize_gaps(rows: list[dict]) -> dict:
    summary = {}
    for kind in ("native", "emulated"):
        for figure in FIGURES:
            errors = [r[f"{kind}_err_{figure}"] for r in rows if r[f"{kind}_err_{figure}"] is not None]
            if errors:
                summary[f"{kind}_err_{figure}"] = {"n": len(errors), "median_abs": statistics.median(map(abs, errors)),
                                                   "worst": max(errors, key=abs)}
    return summary


def memory_gaps(parts: dict[int, dict], env: dict, out: Path) -> None:
    entry = section(parts, "memory_gaps")
    if entry is None:
        return
    got = entry.get("rows") or {}
    rows = [gap_row(name, got.get(name, {})) for name in entry.get("cases", list(got))]
    summary = summarize_gaps(rows)
    lines = header("memplan's estimates vs a real GPU on the published-figure gap cases", env, raw_name(out, "memory_gaps_gpu"))
    lines += status_line(entry, "memory_gaps")
    lines += ["`benchmarks/gpu_extra.py` (issue 25): torchvision's ViT-L/16 as rasbt/pytorch-memory-optim trains it "
              "(16-mixed with GradScaler, bf16-true, 32-true; batch 16 and 64), zoo models in a plain bf16 autocast "
              "loop with autocast's weight cache on, GPT-2 small under FSDP2 on one GPU. Truth: "
              "torch.cuda.max_memory_allocated / max_memory_reserved over the steady-state steps (peaks reset after "
              "step 1), each case in a fresh process. native: memplan traced on fake CUDA tensors on that GPU; "
              "emulated: MEMPLAN_TRACE_ON_CPU=1, what a CPU-only machine does. Error = (estimate - measured) / "
              "measured; no calibration.", ""]
    whole = [r["case"] for r in rows if r["truth"].get("max_allocated") is not None
             and (r["truth"]["max_allocated"], r["truth"]["max_reserved"])
             != (r["truth"]["steady_max_allocated"], r["truth"]["steady_max_reserved"])]
    if any(r["truth"].get("max_allocated") is not None for r in rows):
        lines += [("The whole run's peaks (what the published scripts print) equal the steady-state ones in every "
                   "measured case." if not whole else
                   f"The whole run's peaks differ from the steady-state ones in: {', '.join(whole)} (JSON: max_*)."), ""]
    lines += ["| figure | n | median abs | worst |", "|---|---:|---:|---:|"]
    for kind in ("native", "emulated"):
        for figure in FIGURES:
            s = summary.get(f"{kind}_err_{figure}")
            median = NOT_MEASURED if s is None else f"{100 * s['median_abs']:.2f}%"
            lines.append(f"| {kind} {figure} | {0 if s is None else s['n']} | {median} | "
                         f"{NOT_MEASURED if s is None else pct(s['worst'])} |")
    lines += ["", "| case | measured allocated | native | error | emulated | error | measured reserved | native | "
              "error | emulated | error |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t = r["truth"]
        cells = [r["case"], _truth_cell(t, "allocated")]
        for figure in FIGURES:
            if figure == "reserved":
                cells.append(_truth_cell(t, "reserved"))
            for kind in ("native", "emulated"):
                cells += [_estimate_cell(r[kind], figure),
                          "failed" if "error" in r[kind] else pct(r[f"{kind}_err_{figure}"])]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [(r["case"], k, r[k]["error"]) for r in rows for k in ("truth", "native", "emulated") if "error" in r[k]]
    if failed:
        lines += ["", "Failed (the exception's line):", ""] + [f"- {c} ({k}): {one_line(e)[:500]}" for c, k, e in failed]
    write(out, "memory_gaps_gpu", {"environment": env, "summary": summary, "rows": rows}, lines)


def _truth_cell(truth: dict, figure: str) -> str:
    if "error" in truth:
        return f"{NOT_MEASURED} (failed)"
    if "skipped" in truth:
        return f"{NOT_MEASURED} ({truth['skipped']})"
    return nbytes(truth.get(f"steady_max_{figure}"))


def _estimate_cell(estimate: dict, figure: str) -> str:
    if "error" in estimate:
        return "estimate failed"
    if "skipped" in estimate:
        return f"{NOT_MEASURED} ({estimate['skipped']})"
    return nbytes(estimate.get(f"peak_{figure}"))


# --- part 4: step time ---------------------------------------------------------------------------------
def catalog_gpu(env: dict) -> str:
    """The catalog name of the GPU the part ran on (DRY_RUN_GPU for a dry run)."""
    from memplan.hardware.catalog import match_nvml_name

    name = (env.get("gpu") or {}).get("name")
    if name is None and env.get("dry_run"):
        return DRY_RUN_GPU
    model = match_nvml_name(name) if name else None
    if model is None:
        raise ValueError(f"the campaign's GPU {name!r} is not in memplan's catalog (memplan/hardware/catalog.py): "
                         "add it there to predict its step times")
    return model.name


def cost_profile(model_name: str, *, cpu: bool, gpu: str, sources: dict[str, str]):
    """The planner's CostProfile of a part-4 model (gpu_extra's builders; tiny on CPU for a dry run): bf16-mixed
    traces at micro-batch 1 and PROBE_MICRO, no checkpointing, AdamW, on the catalog's `gpu`. `sources` gets the
    model's source (torchvision's ViT, or memplan's copy of it where torchvision is not installed)."""
    import torch.nn.functional as F

    from benchmarks import gpu_extra
    from memplan.estimator import estimate
    from memplan.planner.profile import CostProfile
    from memplan.planner.search import PROBE_MICRO

    if model_name == "gpt2-small":
        sources[model_name] = "transformers GPT2LMHeadModel"

        def build():
            return gpu_extra.gpt2_small(cpu)

        def batch(micro: int):
            return gpu_extra.gpt2_small_batch(micro, cpu)

        def loss(m, b):
            return m(**b).loss

        tokens = batch(1)["input_ids"].shape[1]
    else:
        def build():
            model, sources[model_name] = gpu_extra.vit_model(cpu)
            return model

        def batch(micro: int):
            return gpu_extra.vit_batch(micro, cpu)

        def loss(m, b):
            return F.cross_entropy(m(b[0]), b[1])

        tokens = 1
    traces = {micro: estimate(build, batch(micro), loss=loss, optimizer="adamw", precision="bf16-mixed", device=gpu)
              for micro in (1, PROBE_MICRO)}
    return CostProfile(traces[1].step_costs, high=traces[PROBE_MICRO].step_costs, high_micro=PROBE_MICRO,
                       traced_amp=True, parameter_count=traces[1].num_parameters, tokens_per_sample=tokens)


def predict(profile, row: dict, gpu: str) -> dict:
    """predict_step for one measured setting: one GPU, no accumulation (what part 4 timed)."""
    from memplan.planner import StepSetting, predict_step
    from memplan.planner.costs import host_ops

    t = predict_step(profile, StepSetting(
        precision=row["precision"], checkpointing=row["checkpointing"], micro_batch_size=row["micro_batch"],
        accumulate_grad_batches=1, world_size=1, gpus_per_node=1, nodes=1, sharding=None, offload=False, gpu_name=gpu))
    ops = profile.ops(row["micro_batch"], amp=row["precision"] != "32-true", checkpointing=row["checkpointing"])
    return {"step_seconds": t.step_seconds, "micro_step_seconds": t.micro_step_seconds,
            "optimizer_seconds": t.optimizer_seconds, "mfu": t.mfu, "host_ops": host_ops(ops)}


def step_times(parts: dict[int, dict], env: dict, out: Path) -> None:
    entries = sections_starting(parts, "step_time_")
    if not entries:
        return
    dry = bool(env.get("dry_run"))
    gpu = catalog_gpu(env)
    lines = header("Measured step time vs memplan's predicted step time", env, raw_name(out, "step_time_gpu"))
    for name, e in entries.items():
        lines += status_line(e, name)
    rows, profiles, sources = [], {}, {}
    for e in entries.values():
        for r in e.get("rows", []):
            row = dict(r)
            if "error" not in r:
                if r["model"] not in profiles:
                    profiles[r["model"]] = cost_profile(r["model"], cpu=dry, gpu=gpu, sources=sources)
                row["predicted"] = predict(profiles[r["model"]], r, gpu)
                row["error"] = row["predicted"]["step_seconds"] / r["step_seconds_median"] - 1
            else:
                row["measure_error"] = row.pop("error")
            rows.append(row)
    measured_sources = {f"{r['model']}: {r['model_source']}" for r in rows if r.get("model_source")}
    errors = [r["error"] for r in rows if "error" in r]
    summary = None if not errors else {"n": len(errors), "median_abs": statistics.median(map(abs, errors)),
                                       "worst": max(errors, key=abs), "median": statistics.median(errors)}
    lines += ["Measured (part 4, `benchmarks/gpu_extra.py --time`): forward + loss, zero_grad(set_to_none=True), "
              "backward and AdamW's step in one process on one GPU, CUDA synchronised around each step, median of 10 "
              "timed steps after 3 warm-up ones; bf16-mixed is autocast without its weight cache (as Lightning runs "
              "it); checkpointing is full, on every repeated block; TF32 off for matmuls (torch's default; cuDNN's "
              "convolutions keep it). No data loading, no Lightning loop, no logging.", "",
              f"Predicted: `memplan.planner.predict_step` for the catalog's `{gpu}` (world size 1, no accumulation: "
              "forward and backward (with recompute under checkpointing) per op as a roofline on the catalog's peaks "
              "and HBM bandwidth, floored by eager PyTorch's per-op host cost, plus the traced optimizer step; "
              "nothing for zero_grad, data or communication) on a CostProfile built as the planner builds one: two "
              "bf16-mixed traces without checkpointing, at micro-batch 1 and 4, the other settings derived "
              "(32-true: casts removed, fp32 peaks; checkpointing: the blocks' forward again). The traces ran on "
              "CPU (fake tensors), after the GPU run; the models are `benchmarks/gpu_extra.py`'s"
              + (" (tiny sizes: a dry run, nothing compared)" if dry else "")
              + "; the predictions' models: " + ", ".join(f"{k}: {v}" for k, v in sources.items())
              + (f" (measured: {', '.join(sorted(measured_sources))})" if measured_sources else "") + ".", "",
              "Error = predicted / measured - 1 (negative: memplan predicts a faster step than measured)."
              + ("" if summary is None else f" Over {summary['n']} settings: median |error| "
                 f"{100 * summary['median_abs']:.1f} %, median {100 * summary['median']:+.1f} %, worst "
                 f"{100 * summary['worst']:+.1f} %."), "",
              "| model | precision | micro-batch | checkpointing | measured s | predicted s | error | predicted "
              "micro-step s | predicted optimizer s |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = r.get("predicted") or {}
        lines.append(f"| {r['model']} | {r['precision']} | {r['micro_batch']} | {'full' if r['checkpointing'] else 'none'}"
                     f" | {_s(r.get('step_seconds_median'))} | {_s(p.get('step_seconds'))} | {pct(r.get('error'))} | "
                     f"{_s(p.get('micro_step_seconds'))} | {_s(p.get('optimizer_seconds'))} |")
    failed = [r for r in rows if "measure_error" in r]
    if failed:
        lines += ["", "Settings whose measurement failed:", ""] + [
            f"- {r['model']} {r['precision']} micro-batch {r['micro_batch']}: {one_line(r['measure_error'])[:300]}"
            for r in failed]
    write(out, "step_time_gpu", {"environment": env, "gpu": gpu, "summary": summary, "rows": rows,
                                 "predicted_on": "CPU traces (fake tensors)", "predicted_model_sources": sources}, lines)


def _s(x) -> str:
    return NOT_MEASURED if x is None else f"{x:.4f}"
