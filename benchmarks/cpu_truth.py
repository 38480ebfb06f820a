"""Ground truth on CPU: the real peak of live tensor bytes over one case's training, read from the profiler.

    python -m benchmarks.cpu_truth CASE     # prints one JSON object

Run each case in a fresh process. The profiler starts before anything is built, so every tensor the
case ever allocates passes through it. The run is the one a user writes, not the step memplan traces
(memplan.truth.runs): the model is built (+ each repeated block wrapped in non-reentrant
torch.utils.checkpoint), the batch made, then a real `Trainer.fit` trains 2 steps for a case in
Lightning's order (its precision plugin converts, autocasts and scales), and a plain PyTorch loop for
a `loop="torch"` case (autocast with its weight cache on, as torch defaults it; a GradScaler for
'16-mixed').

How the figure is read: with `profile_memory=True`, c10's CPU allocator reports every allocation and
free to the profiler together with its running total of bytes allocated (`ProfiledCPUMemoryReporter`,
which counts the requested sizes, as `torch.cuda.memory_allocated` does). The chrome trace holds these
as "[memory]" instant events with args "Bytes" (+ on allocation, - on free) and "Total Allocated". The
truth is the largest "Total Allocated" (less the total before the first event, 0 in a fresh process).
Each event's "Bytes" is checked against the move of "Total Allocated" since the event before, so an
event missing from the trace would show (as a counter mismatch). Only CPU events count (Device Type 0).

The profiler records events only on its own threads, and c10 keeps the total only on those threads
unless told otherwise: a tensor freed on another thread (gloo's workers free collective buffers) would
stay in "Total Allocated" for good. Measuring therefore sets c10's flag that makes every thread count
(memplan.truth.allocator_counts_every_thread); an allocation or free on an unrecorded
thread then moves the total with no event of its own, and shows as a counter mismatch.

Besides the peak this reports the peak of each phase (build, step 1, step 2: marked with
`record_function`; "build" runs from the start to the first step, so it holds the Trainer's setup),
the op running at the peak, and "scratch": bytes allocated and freed inside one
kernel (oneDNN/MKL workspaces and other buffers a kernel takes through c10's allocator), which are in
the truth but invisible to an estimate made on fake tensors, since fake tensors never run kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.zoo import CASES, SEED, Case, make_optimizer
from memplan.truth import Training, allocator_counts_every_thread, train
from memplan.truth.runs import preload

STEPS = 2
PHASES = ("build", *(f"step{i}" for i in range(1, STEPS + 1)))
_MARK = "memplan.truth."
_FACTORY_OPS = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_"})
"""Ops that only allocate: their allocation belongs to the op that called them."""


def training(case: Case, batch_size: int | None = None, steps: int = STEPS) -> Training:
    """The case as memplan.truth trains it: its model, batch, loss, optimizer, precision and checkpointing."""
    return Training(
        build=case.build, make_batch=lambda: case.make_batch(batch_size or case.batch_size), loss=case.loss,
        optimizer=lambda params: make_optimizer(case.optimizer, params), precision=case.precision,
        checkpointing=case.checkpointing, steps=steps,
    )


class _Marks:
    """record_function spans "build" (start to the first step) and "step{i}", entered from the run's hooks."""

    def __init__(self, wall: dict[str, float]) -> None:
        self._open: tuple[str, record_function, float] | None = None
        self._wall = wall

    def enter(self, name: str) -> None:
        mark = record_function(_MARK + name)
        mark.__enter__()
        self._open = (name, mark, time.perf_counter())

    def exit(self) -> None:
        if self._open is not None:
            name, mark, start = self._open
            mark.__exit__(None, None, None)
            self._wall[name] = time.perf_counter() - start
            self._open = None

    def step_start(self, step: int) -> None:
        self.exit()
        self.enter(f"step{step}")


def measure(case: Case) -> dict:
    """Build and train `case` for STEPS steps under the profiler; the peak figures and timings.

    Call it in a fresh process (`python -m benchmarks.cpu_truth`): the allocator's running total is
    process-wide, and tensors allocated before the profile started would be freed without a record.
    """
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    wall: dict[str, float] = {}
    marks = _Marks(wall)
    run = replace(training(case), on_step_start=marks.step_start, on_step_end=lambda step: marks.exit())
    preload(case.loop)
    with allocator_counts_every_thread() as every_thread, profile(
        activities=[ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        marks.enter("build")
        model = train(run, loop=case.loop)
        marks.exit()
    num_parameters = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    result = analyze_trace(trace)
    wall["export_and_read"] = time.perf_counter() - start
    return {
        "case": case.name,
        "loop": "Trainer.fit" if case.loop == "lightning" else "plain torch loop",
        "num_parameters": num_parameters,
        **result,
        "allocator_counts_every_thread": every_thread,
        "wall_seconds": {k: round(v, 3) for k, v in wall.items()},
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "torch": torch.__version__,
    }


@dataclass(frozen=True)
class _Op:
    start: float
    end: float
    name: str


def analyze_trace(trace: dict) -> dict:
    """The peak figures from a chrome trace of a run marked with `record_function(_MARK + phase)`."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
        key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)),
    )
    if not memory:
        raise RuntimeError("the profile holds no CPU [memory] events: was profile_memory=True?")
    phases = {
        e["name"][len(_MARK):]: (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith(_MARK)
    }
    ops = _ops_by_thread(events)

    first = memory[0]["args"]
    baseline = first["Total Allocated"] - first["Bytes"]
    previous = baseline
    mismatches = 0
    totals = []
    for e in memory:
        if previous + e["args"]["Bytes"] != e["args"]["Total Allocated"]:
            mismatches += 1
        previous = e["args"]["Total Allocated"]
        totals.append(previous - baseline)
    peak_index = max(range(len(totals)), key=totals.__getitem__)
    peak_event = memory[peak_index]

    phase_peaks = {}
    phase_start_allocated = {}
    for phase, (lo, hi) in phases.items():
        inside = [t for e, t in zip(memory, totals) if lo <= e["ts"] <= hi]
        before = [t for e, t in zip(memory, totals) if e["ts"] < lo]
        phase_peaks[phase] = max(inside, default=before[-1] if before else 0)
        phase_start_allocated[phase] = before[-1] if before else 0
    peak_phase = next((p for p, (lo, hi) in phases.items() if lo <= peak_event["ts"] <= hi), None)

    owners, peak_stack = _owners(memory, ops, peak_index)
    scratch_live, largest_scratch, peak_without_scratch = _scratch(memory, peak_index, owners, baseline)
    transient = _op_transient_at_peak(memory, peak_index, peak_stack)
    return {
        "peak_allocated": totals[peak_index],
        "phase_peaks": {p: phase_peaks[p] for p in PHASES if p in phase_peaks},
        "phase_start_allocated": {p: phase_start_allocated[p] for p in PHASES if p in phase_start_allocated},
        "end_allocated": totals[-1],
        "peak_phase": peak_phase,
        "peak_op_stack": [op.name for op in peak_stack][-4:],
        "scratch_at_peak": scratch_live,
        "peak_without_scratch": peak_without_scratch,
        "op_transient_at_peak": transient,
        "largest_scratch": largest_scratch,
        "baseline_allocated": baseline,
        "memory_events": len(memory),
        "memory_event_threads": len({e["tid"] for e in memory}),
        "counter_mismatches": mismatches,
    }


def _ops_by_thread(events: list[dict]) -> dict[object, list[_Op]]:
    """Per thread: cpu ops sorted by (start, -duration), so an enclosing op precedes the ops it holds."""
    by_tid: dict[object, list[_Op]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            by_tid.setdefault(e["tid"], []).append(_Op(e["ts"], e["ts"] + e["dur"], e["name"]))
    for ops in by_tid.values():
        ops.sort(key=lambda op: (op.start, -(op.end - op.start)))
    return by_tid


def _owners(memory: list[dict], ops: dict[object, list[_Op]], peak_index: int) -> tuple[list[_Op | None], list[_Op]]:
    """For each memory event, the op it belongs to: the innermost op open on its thread that is not a
    plain factory (aten::empty & co., whose allocation is the calling op's). Also the op stack at the peak.

    One sweep per thread over ops and events in time order; ops on one thread nest, so the open ops
    form a stack.
    """
    owners: list[_Op | None] = [None] * len(memory)
    peak_stack: list[_Op] = []
    by_tid: dict[object, list[int]] = {}
    for i, e in enumerate(memory):
        by_tid.setdefault(e["tid"], []).append(i)
    for tid, indices in by_tid.items():
        thread_ops = ops.get(tid, [])
        stack: list[_Op] = []
        j = 0
        for i in indices:
            ts = memory[i]["ts"]
            while j < len(thread_ops) and thread_ops[j].start <= ts:
                while stack and stack[-1].end < thread_ops[j].start:
                    stack.pop()
                stack.append(thread_ops[j])
                j += 1
            while stack and stack[-1].end < ts:
                stack.pop()
            owners[i] = next((op for op in reversed(stack) if op.name not in _FACTORY_OPS), None)
            if i == peak_index:
                peak_stack = list(stack)
    return owners, peak_stack


def _op_transient_at_peak(memory: list[dict], peak_index: int, peak_stack: list[_Op]) -> dict:
    """Bytes live at the peak that the outermost aten op running then allocated and frees before it
    returns: kernel scratch, plus temporaries of sub-ops the op calls (e.g. the dtype-promotion copy
    TensorIterator makes on CPU for a mixed-dtype add). An upper bound of what a fake-tensor trace cannot
    see: for a composite op (aten::linear, aten::matmul) it also counts temporaries the trace sees."""
    outer = next((op for op in peak_stack if op.name.startswith("aten::")), None)
    if outer is None:
        return {"op": None, "bytes": 0}
    freed_by_addr: dict[int, float] = {}
    for e in memory[peak_index + 1:]:
        if e["args"]["Bytes"] < 0 and e["args"]["Addr"] not in freed_by_addr:
            freed_by_addr[e["args"]["Addr"]] = e["ts"]
    total = 0
    live: dict[int, dict] = {}
    for e in memory[: peak_index + 1]:
        if e["args"]["Bytes"] > 0:
            live[e["args"]["Addr"]] = e
        else:
            live.pop(e["args"]["Addr"], None)
    for addr, e in live.items():
        if e["ts"] >= outer.start and freed_by_addr.get(addr, float("inf")) <= outer.end:
            total += e["args"]["Bytes"]
    return {"op": outer.name, "bytes": total}


def _scratch(
    memory: list[dict], peak_index: int, owners: list[_Op | None], baseline: int
) -> tuple[int, dict, int]:
    """Kernel scratch: allocations freed before the op that made them returns.

    Returns the scratch bytes live at the peak, the largest scratch allocation (op, bytes), and the
    peak of allocated bytes with all scratch left out (the most a tracer that never runs kernels sees).
    """
    free_at: dict[int, int] = {}  # allocation index -> index of its free
    open_by_addr: dict[int, int] = {}
    for i, e in enumerate(memory):
        addr, nbytes = e["args"]["Addr"], e["args"]["Bytes"]
        if nbytes > 0:
            open_by_addr[addr] = i
        elif addr in open_by_addr:
            free_at[open_by_addr.pop(addr)] = i

    def is_scratch(i: int) -> bool:
        owner = owners[i]
        return i in free_at and owner is not None and memory[free_at[i]]["ts"] <= owner.end

    live_scratch = sum(
        memory[i]["args"]["Bytes"]
        for i in range(peak_index + 1)
        if memory[i]["args"]["Bytes"] > 0 and free_at.get(i, len(memory)) > peak_index and is_scratch(i)
    )
    scratch = [i for i in free_at if is_scratch(i)]
    largest = max(scratch, key=lambda i: memory[i]["args"]["Bytes"], default=None)
    largest_scratch = (
        {"op": owners[largest].name, "bytes": memory[largest]["args"]["Bytes"]}
        if largest is not None else {"op": None, "bytes": 0}
    )
    scratch_events = set(scratch) | {free_at[i] for i in scratch}
    running = peak_without = 0
    for i, e in enumerate(memory):
        if i not in scratch_events:
            running += e["args"]["Bytes"]
            peak_without = max(peak_without, running)
    return live_scratch, largest_scratch, peak_without


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=sorted(CASES), metavar="CASE", help="a name in benchmarks.zoo.CASES")
    args = parser.parse_args(argv)
    json.dump(measure(CASES[args.case]), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
