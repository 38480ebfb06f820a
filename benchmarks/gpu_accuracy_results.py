"""The GPU campaign's part 1 accuracy rows rendered: accuracy_gpu.{md,json} (benchmarks.gpu_results writes it).

A part may come in several calls (part1.json, then follow-ups part1b.json, part1c.json ...): each case's row is the
newest call's that measured it (benchmarks.gpu_report.merge_section), and each row names that call and the memplan
commit it ran on, since an older call's estimates were made by older code (its truths are the same GPU's).
"""
from __future__ import annotations

import statistics

from benchmarks.gpu_report import (NOT_MEASURED, header, one_line, raw_name, section, status_line, write)
from benchmarks.gpu_report import nbytes as _b
from benchmarks.gpu_report import pct as _pct

GOALS = {"median_abs": 0.03, "worst_abs": 0.06, "most_under": -0.02}
"""Issue 14's accuracy goals: median |error| <= 3 %, worst <= 6 %, never under by more than 2 %."""
SECTIONS = ("accuracy_zoo", "accuracy_extra")


def row_runs(parts: dict[int, dict]) -> dict[str, dict]:
    """Case -> {"file", "date", "memplan_commit"} of the call whose row the merged part holds."""
    data = parts.get(1) or {}
    calls, sources = data.get("calls") or {}, data.get("sources") or {}
    out = {}
    for name in SECTIONS:
        for case, file in (sources.get(name) or {}).get("rows", {}).items():
            call = calls[file]
            out[case] = {"file": file, "date": call["started"],
                         "memplan_commit": call["environment"].get("memplan_commit")}
    return out


def accuracy(parts, env, out) -> None:
    from benchmarks.accuracy_gpu import summarize

    named = {n: e for n in SECTIONS if (e := section(parts, n)) is not None}
    if not named:
        return
    runs = row_runs(parts)
    order = {c: i for i, c in enumerate(c for e in named.values() for c in e.get("cases", []))}
    rows = [dict(r, run=runs[r["case"]]) if r["case"] in runs else r for e in named.values() for r in e.get("rows", [])]
    rows.sort(key=lambda r: order.get(r["case"], len(order)))  # the campaign's case order, whichever call ran it
    summary = summarize(rows)
    lines = header("memplan's estimates vs a real GPU, on the zoo", env, raw_name(out, "accuracy_gpu"))
    for name, e in named.items():
        lines += status_line(e, name)
    truths = [r for r in rows if "error" not in r["truth"]]
    lines += [f"{len(rows)} cases, {len(truths)} with a measured truth; compared: native "
              f"{sum('error' not in r['native'] for r in truths)}, emulated "
              f"{sum('error' not in r['emulated'] for r in truths)} (the other estimates failed: listed at the end).",
              ""]
    lines += ["Error = (estimate - measured) / measured, over the steady-state step (step 2). native: traced on fake "
              "CUDA tensors; emulated: on fake CPU tensors with CUDA semantics (what a CPU-only machine does). "
              "allocated: peak_allocated vs torch.cuda.max_memory_allocated; reserved: peak_reserved vs "
              "max_memory_reserved; nvml: device_total vs NVML's per-process peak (memplan's sourced CUDA context; "
              "no calibration). Goal: median |error| <= 3 %, worst <= 6 %, never under by more than 2 %.", "",
              "| figure | median abs | worst abs | most under | n | goal |", "|---|---:|---:|---:|---:|---|"]
    for key, s in summary.items():
        met = (s["median_abs"] <= GOALS["median_abs"] and s["worst_abs"] <= GOALS["worst_abs"]
               and s["most_under"] >= GOALS["most_under"])
        lines.append(f"| {key} | {100 * s['median_abs']:.2f}% | {100 * s['worst_abs']:.2f}% | "
                     f"{100 * s['most_under']:+.2f}% | {s['n']} | {'met' if met else 'NOT met'} |")
    lines += _by_run(rows, summarize) + _by_setting(rows, summarize)
    contexts = [c for c in (context_of(r["truth"]) for r in rows) if c is not None]
    if contexts:
        lines += ["", f"Memory outside the allocator (NVML process peak - max_memory_reserved: the CUDA context and "
                  f"kernels a training step loaded), over {len(contexts)} cases: min {_b(min(contexts))}, median "
                  f"{_b(statistics.median(contexts))}, max {_b(max(contexts))}."]
    lines += _case_table(rows, several=len({r["run"]["file"] for r in rows if "run" in r}) > 1)
    failed = [(r["case"], k, r[k]["error"]) for r in rows for k in ("native", "emulated")
              if "error" in r[k] and "error" not in r["truth"]]
    if failed:
        lines += ["", "Estimates that failed (the exception's line):", ""] + [
            f"- {c} ({k}): {one_line(e)[:400]}" for c, k, e in failed]
    write(out, "accuracy_gpu", {"environment": env, "summary": summary, "rows": rows}, lines)


def _median_worst(s: dict, key: str) -> str:
    return NOT_MEASURED if key not in s else f"{100 * s[key]['median_abs']:.2f}% / {100 * s[key]['worst_abs']:.2f}%"


def _by_run(rows: list[dict], summarize) -> list[str]:
    """The summary per call, where the rows come from several: an older call's estimates are older code's."""
    calls: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if "run" in r:
            calls.setdefault((r["run"]["file"], str(r["run"]["memplan_commit"])[:10]), []).append(r)
    if len(calls) < 2:
        return []
    lines = ["", "By the call that measured each case (its estimates are that commit's memplan; native allocated / "
             "reserved / nvml, median / worst |error|):", "",
             "| call | memplan | n | allocated | reserved | nvml |", "|---|---|---:|---|---|---|"]
    for (file, commit), rs in sorted(calls.items()):
        s = summarize(rs)
        lines.append(f"| {file} | {commit} | {len(rs)} | {_median_worst(s, 'native_err_allocated')} | "
                     f"{_median_worst(s, 'native_err_reserved')} | {_median_worst(s, 'native_err_nvml')} |")
    return lines


def _by_setting(rows: list[dict], summarize) -> list[str]:
    groups: dict[str, list[dict]] = {}
    cases = _cases()
    for r in rows:
        c = cases.get(r["case"])
        if c is not None:
            groups.setdefault(f"{c.precision}{' + ckpt' if c.checkpointing else ''}", []).append(r)
    lines = ["", "By precision and checkpointing (native allocated / reserved / nvml):", "",
             "| setting | n | allocated median / worst | reserved median / worst | nvml median / worst |",
             "|---|---:|---|---|---|"]
    for g, rs in sorted(groups.items()):
        s = summarize(rs)
        lines.append(f"| {g} | {len(rs)} | {_median_worst(s, 'native_err_allocated')} | "
                     f"{_median_worst(s, 'native_err_reserved')} | {_median_worst(s, 'native_err_nvml')} |")
    return lines


def _case_table(rows: list[dict], *, several: bool) -> list[str]:
    """One line per case; with `several` calls, a last column naming the call and memplan commit of each row."""
    run_head, run_rule = (" run (memplan) |", "---|") if several else ("", "")
    lines = ["", "| case | measured allocated | native | emulated | measured reserved | native | emulated | NVML peak "
             f"| native | emulated | outside allocator |{run_head}",
             f"|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|{run_rule}"]
    for r in rows:
        t = r["truth"]
        run = "" if not several else f" {r['run']['file']} ({str(r['run']['memplan_commit'])[:7]}) |" if "run" in r \
            else " - |"
        if "error" in t:
            why = f"{NOT_MEASURED} ({one_line(t['error'])[:120]})"
            lines.append(f"| {r['case']} | {why} |" + f" {NOT_MEASURED} |" * 9 + run)
            continue

        def err(kind: str, figure: str, r=r) -> str:
            return "estimate failed" if "error" in r[kind] else _pct(r[f"{kind}_err_{figure}"])

        lines.append(f"| {r['case']} | {_b(t.get('max_allocated'))} | {err('native', 'allocated')} | "
                     f"{err('emulated', 'allocated')} | {_b(t.get('max_reserved'))} | {err('native', 'reserved')} | "
                     f"{err('emulated', 'reserved')} | {_b(t.get('nvml_process_peak'))} | {err('native', 'nvml')} | "
                     f"{err('emulated', 'nvml')} | {_b(context_of(t))} |{run}")
    return lines


def _cases() -> dict:
    from benchmarks.accuracy_gpu import all_cases

    return all_cases()


def context_of(truth: dict) -> int | None:
    if truth.get("nvml_process_peak") is None or truth.get("max_reserved") is None:
        return None
    return truth["nvml_process_peak"] - truth["max_reserved"]
