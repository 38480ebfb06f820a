"""Memory CUDA kernels take for themselves inside an op: memplan's trace against the H100's op-by-op readings.

The GPU campaign's part 5 (benchmarks.gpu_ops, raw files in benchmarks/results/gpu_campaign_raw_h100/ops/) read
the caching allocator around every aten op of 14 zoo steps on an H100 (torch 2.11.0+cu130): allocated bytes
before the op, the peak inside it, after it. An op's transient is peak - max(before, after): memory the kernel
held only while it ran (a reduction's staging buffer, a contiguous copy, a library workspace). This benchmark
traces the same cases with memplan on CPU with CUDA emulated (MEMPLAN_TRACE_ON_CPU=1, device "H100-80GB"),
reads memplan's allocator model around each op the same way, lines the steady-state step's ops up with the
GPU's step 2 (difflib over op names), and reports per op class what memplan misses or over-counts.
`--without-reductions` traces without the reduction staging rule (memplan.estimator.cuda.reductions), as
memplan did before it.

    .venv/bin/python -m benchmarks.op_transients [--cases NAME ...] [--without-reductions]

writes benchmarks/results/op_transients.{json,md} (with --cases or --without-reductions: prints, writes nothing).
Convolutions (another rule's) and attention ops are reported like every other op.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import sys
from collections import defaultdict

from benchmarks.processes import environment_variable
from benchmarks.results_io import RESULTS, machine, write_results

RAW = RESULTS / "gpu_campaign_raw_h100" / "ops"
DEVICE = "H100-80GB"
MATCH = 0.02
"""A transient within 2 % of the GPU's counts as the same."""
MiB = 1 << 20


def _recording():
    """Patch the tracker and the allocator model to read each op as gpu_ops does: rows [step, op, before,
    peak, after, shapes, reserved after]; the step is 2 from the tracker's reset_peak (the steady-state step) on."""
    from benchmarks.gpu_ops import _shapes
    from memplan.estimator.allocator import CachingAllocatorModel
    from memplan.estimator.tracker import StorageTracker

    state = {"rows": [], "step": 1, "peak": None}
    malloc, dispatch, reset = CachingAllocatorModel.malloc, StorageTracker.__torch_dispatch__, StorageTracker.reset_peak

    def recording_malloc(self, nbytes, stream=0):
        handle = malloc(self, nbytes, stream)
        if state["peak"] is not None:
            state["peak"] = max(state["peak"], self.allocated_bytes)
        return handle

    def recording_dispatch(self, func, types, args=(), kwargs=None):
        before = self.memory.allocated_bytes
        outer, state["peak"] = state["peak"], before
        try:
            out = dispatch(self, func, types, args, kwargs)
        finally:
            peak, state["peak"] = state["peak"], outer
        after = self.memory.allocated_bytes
        if str(func) != "prim.device.default":
            state["rows"].append([state["step"], str(func), before, peak, after,
                                  _shapes(args) if peak > max(before, after) else None, self.memory.reserved_bytes])
        return out

    def recording_reset(self):
        state["step"] = 2
        return reset(self)

    def undo():
        CachingAllocatorModel.malloc, StorageTracker.__torch_dispatch__ = malloc, dispatch
        StorageTracker.reset_peak = reset

    CachingAllocatorModel.malloc, StorageTracker.__torch_dispatch__ = recording_malloc, recording_dispatch
    StorageTracker.reset_peak = recording_reset
    return state, undo


@contextlib.contextmanager
def reduction_rule(on: bool):
    """memplan's CUDA reduction staging rule as shipped (on) or switched off, for a before / after comparison."""
    from memplan.estimator.cuda.reductions import ReductionStaging

    staging = ReductionStaging.staging_allocations
    if not on:
        ReductionStaging.staging_allocations = lambda self, func, args, kwargs, out: ()
    try:
        yield
    finally:
        ReductionStaging.staging_allocations = staging


def estimate_emulated(name: str, device: str, *, reductions: bool = True):
    """One zoo (or extra GPU) case's estimate for the catalog's `device`, traced on CPU with CUDA emulated, without
    a calibration file (the sourced constants, as on the GPU run), in the case's own loop."""
    from benchmarks.accuracy_gpu import all_cases
    from memplan.estimator import estimate

    case = all_cases()[name]
    with reduction_rule(reductions), environment_variable("MEMPLAN_TRACE_ON_CPU", "1"), \
            environment_variable("MEMPLAN_CALIBRATION", os.devnull):
        return estimate(case.build, case.make_batch(case.batch_size), loss=case.loss, optimizer=case.optimizer,
                        precision=case.precision, checkpointing=case.checkpointing, device=device, loop=case.loop)


def trace_case(name: str, *, reductions: bool) -> dict:
    """memplan's op rows for one case's steady-state step, and its peak."""
    state, undo = _recording()
    try:
        est = estimate_emulated(name, DEVICE, reductions=reductions)
    finally:
        undo()
    return {"rows": [r for r in state["rows"] if r[0] == 2], "peak_allocated": est.peak_allocated,
            "peak_reserved": est.peak_reserved}


_SAME_OP = {
    "aten._scaled_dot_product_cudnn_attention.default": "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention_backward.default":
        "aten._scaled_dot_product_flash_attention_backward.default",
}
"""GPU ops lined up with the op memplan runs in their place: the H100 ran cuDNN attention (sm90 with cuDNN > 9.15
prefers it), memplan emulates flash (memplan.estimator.cuda.sdpa). Reported as memplan's op, '(GPU: cuDNN)'."""


def _transient(row, before: int, peak: int, after: int) -> int:
    return max(0, row[peak] - max(row[before], row[after]))


def compare(gpu_rows: list[list], mp_rows: list[list]) -> list[dict]:
    """One entry per op with a transient on either side: GPU rows [step, op, main, before, peak, after,
    reserved, shapes], memplan rows [step, op, before, peak, after, shapes], lined up by op name."""
    gpu_names, mp_names = [_SAME_OP.get(r[1], r[1]) for r in gpu_rows], [r[1] for r in mp_rows]
    matcher = difflib.SequenceMatcher(None, gpu_names, mp_names, autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        pairs = list(zip(range(i1, i2), range(j1, j2))) if tag == "equal" else \
            [(i, None) for i in range(i1, i2)] + [(None, j) for j in range(j1, j2)]
        for i, j in pairs:
            g = _transient(gpu_rows[i], 3, 4, 5) if i is not None else None
            m = _transient(mp_rows[j], 2, 3, 4) if j is not None else None
            if not g and not m:
                continue
            op = gpu_names[i] if i is not None else mp_rows[j][1]
            if i is not None and gpu_rows[i][1] != op:
                op += " (GPU: cuDNN)"
            shapes = gpu_rows[i][7] if i is not None and gpu_rows[i][7] else (mp_rows[j][5] if j is not None else None)
            out.append({"op": op, "gpu": g, "memplan": m, "shapes": shapes, "position": i if i is not None else j})
    return out


def verdict(entry: dict) -> str:
    g, m = entry["gpu"], entry["memplan"]
    if g is None or m is None:
        return "gpu only" if m is None else "memplan only"
    if abs(g - m) <= MATCH * max(g, m):
        return "match"
    return "missed" if m < g else "over-counted"


def by_class(entries: list[dict]) -> dict:
    """Per op: how many ops of each verdict, the GPU's and memplan's bytes, the largest example of each verdict."""
    classes: dict = defaultdict(lambda: {"counts": defaultdict(int), "gpu_bytes": 0, "memplan_bytes": 0,
                                         "largest": {}})
    for e in entries:
        c, v = classes[e["op"]], verdict(e)
        c["counts"][v] += 1
        c["gpu_bytes"] += e["gpu"] or 0
        c["memplan_bytes"] += e["memplan"] or 0
        size = max(e["gpu"] or 0, e["memplan"] or 0)
        prev = c["largest"].get(v)
        if prev is None or size > max(prev["gpu"] or 0, prev["memplan"] or 0):
            c["largest"][v] = {k: e[k] for k in ("gpu", "memplan", "shapes")}
    return {op: {**c, "counts": dict(c["counts"])} for op, c in sorted(classes.items(), key=lambda kv: -kv[1]["gpu_bytes"])}


def run(names: list[str], *, reductions: bool) -> dict:
    cases = {}
    for name in names:
        gpu = json.loads((RAW / f"{name}.json").read_text())
        gpu_rows = [r for r in gpu["rows"] if r[0] == 2]
        mp = trace_case(name, reductions=reductions)
        entries = compare(gpu_rows, mp["rows"])
        classes = by_class(entries)
        cases[name] = {"gpu_ops": len(gpu_rows), "memplan_ops": len(mp["rows"]),
                       "gpu_peak_allocated_step2": gpu["peak_allocated_step2"],
                       "memplan_peak_allocated": mp["peak_allocated"], "memplan_peak_reserved": mp["peak_reserved"],
                       "classes": classes, "entries": entries}
        counts = {op: c["counts"] for op, c in classes.items()}
        print(f"{name:28s} ops gpu {len(gpu_rows)} memplan {len(mp['rows'])}  {json.dumps(counts)}", flush=True)
    return {"machine": machine(), "device": DEVICE, "reductions_rule": reductions, "cases": cases,
            "summary": summary(cases)}


def summary(cases: dict) -> dict:
    """Per op class over every case: verdict counts and bytes."""
    out: dict = defaultdict(lambda: {"counts": defaultdict(int), "gpu_bytes": 0, "memplan_bytes": 0, "cases": []})
    for name, case in cases.items():
        for op, c in case["classes"].items():
            s = out[op]
            for v, n in c["counts"].items():
                s["counts"][v] += n
            s["gpu_bytes"] += c["gpu_bytes"]
            s["memplan_bytes"] += c["memplan_bytes"]
            s["cases"].append(name)
    return {op: {**s, "counts": dict(s["counts"])} for op, s in sorted(out.items(), key=lambda kv: -kv[1]["gpu_bytes"])}


def render(report: dict, before: dict | None) -> str:
    lines = ["# Transient memory inside CUDA ops: memplan against the H100's op-by-op readings", "",
             "`.venv/bin/python -m benchmarks.op_transients` (benchmarks/op_transients.py). GPU: an H100 80GB HBM3, "
             "torch 2.11.0+cu130, step 2 of each case (benchmarks/results/gpu_campaign_raw_h100/ops/). memplan: this "
             f"tree, traced on this CPU with CUDA emulated for {report['device']} (torch {report['machine']['torch']}), "
             "its steady-state step. An op's transient is peak - max(before, after). Ops are lined up by name "
             "(difflib; the GPU's cuDNN attention ops stand where memplan runs flash's, marked '(GPU: cuDNN)'); "
             "'gpu only' / 'memplan only': an op with a transient that one side does not run at that "
             "place. A transient within 2 % of the GPU's is a match.", "",
             "## Per op class, all cases", "",
             "| op | match | missed | over-counted | gpu only | memplan only | GPU MiB (sum) | memplan MiB (sum) |"
             + (" memplan MiB before the reduction rule |" if before else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if before else "")]
    for op, s in report["summary"].items():
        c = s["counts"]
        cells = [op, *(str(c.get(v, 0)) for v in ("match", "missed", "over-counted", "gpu only", "memplan only")),
                 f"{s['gpu_bytes'] / MiB:,.2f}", f"{s['memplan_bytes'] / MiB:,.2f}"]
        if before:
            cells.append(f"{before['summary'].get(op, {}).get('memplan_bytes', 0) / MiB:,.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Per case: the largest example of each verdict", ""]
    for name, case in report["cases"].items():
        lines.append(f"### {name} (GPU ops {case['gpu_ops']}, memplan ops {case['memplan_ops']}; GPU step-2 peak "
                     f"{case['gpu_peak_allocated_step2'] / MiB:,.1f} MiB, memplan peak "
                     f"{case['memplan_peak_allocated'] / MiB:,.1f} MiB)")
        lines.append("")
        for op, c in case["classes"].items():
            for v, ex in c["largest"].items():
                g = "-" if ex["gpu"] is None else f"{ex['gpu']:,}"
                m = "-" if ex["memplan"] is None else f"{ex['memplan']:,}"
                lines.append(f"- {op} {v} x{c['counts'][v]}: GPU {g} B, memplan {m} B, args {json.dumps(ex['shapes'])}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.gpu_ops import PROFILE_CASES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", metavar="NAME", help="these cases only; print, write nothing")
    parser.add_argument("--without-reductions", action="store_true", help="trace without the reduction staging rule")
    args = parser.parse_args(argv)
    names = args.cases or [n for n in PROFILE_CASES if (RAW / f"{n}.json").exists()]
    report = run(names, reductions=not args.without_reductions)
    if args.cases or args.without_reductions:
        print(json.dumps({op: s["counts"] for op, s in report["summary"].items()}))
        return 0
    before = run(names, reductions=False)
    report["before_reduction_rule"] = {"summary": before["summary"],
                                       "peaks": {n: {k: c[k] for k in ("memplan_peak_allocated", "memplan_peak_reserved")}
                                                 for n, c in before["cases"].items()}}
    write_results("op_transients", report, render(report, before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
