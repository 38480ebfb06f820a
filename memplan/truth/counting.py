"""Reading the CPU allocator's real total: c10's every-thread counting flag and the profiler's peak.

Truth is the peak of the CPU allocator's "Total Allocated" as torch.profiler reports it
(profile_memory=True): every allocation from the moment profiling starts, kernel-internal ones
included. While measuring, the allocator counts every thread's allocations and frees (see
`allocator_counts_every_thread`), not only those of the threads the profiler records.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.profiler import profile


_C10_COUNT_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


@functools.cache
def _c10_count_flag() -> ctypes.c_bool | None:
    """c10's `caffe2_report_cpu_memory_usage` flag in the loaded libc10, or None where it is not exported."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in sorted(glob.glob(os.path.join(lib_dir, "*c10.*"))):
        try:
            return ctypes.c_bool.in_dll(ctypes.CDLL(path), _C10_COUNT_FLAG)
        except (OSError, ValueError):
            continue
    return None


@contextmanager
def allocator_counts_every_thread() -> Iterator[bool]:
    """Make c10's CPU allocator keep its running total on every thread while measuring; yields whether
    it could.

    c10's ProfiledCPUMemoryReporter moves the total the profiler reports ("Total Allocated") only on a
    thread the profiler records. A tensor freed on another thread stays counted for the rest of the
    process: gloo's worker threads drop collective buffers (an FSDP reduce-scatter's input copy, 3 MiB
    on a small ViT) after the op that made them, and the profiled peak then carried that phantom, by
    up to 15 % on a 4-rank run (and a tensor allocated on such a thread would never be counted). c10's
    `caffe2_report_cpu_memory_usage` flag makes every thread count
    (c10/core/CPUAllocator.cpp: New and Delete update the total when the flag is set *or* the thread
    is profiled); the profiler still records events only for its own threads. The flag's own log lines
    are INFO, below c10's default log level. It is set back when the last open measurement ends.
    """
    flag = _c10_count_flag()
    if flag is None:
        yield False
        return
    global _counting_depth, _flag_before
    with _counting_lock:
        if _counting_depth == 0:
            _flag_before = flag.value
            flag.value = True
        _counting_depth += 1
    try:
        yield True
    finally:
        with _counting_lock:
            _counting_depth -= 1
            if _counting_depth == 0:
                flag.value = _flag_before


_counting_lock = threading.Lock()
_counting_depth = 0
"""Measurements open now (threads may overlap them): the flag is set back only when the last one ends."""
_flag_before = False


def peak_total_allocated(prof: torch.profiler.profile) -> int:
    """Max of the "[memory]" events' "Total Allocated" for the CPU in a finished profile, less the
    counter's value when the profile began, frees of memory allocated before it not counted.

    The CPU counter (c10 ProfiledCPUMemoryReporter) is process-global and moves only while a profiler
    records memory: tensors allocated under an earlier profile and freed in this one would lower it. The
    first event's "Total Allocated" minus its "Bytes" is where this profile started.
    """
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0),
        key=lambda e: e["ts"],
    )
    if not memory:
        raise RuntimeError("the profile has no CPU memory events; was profile_memory=True set?")
    # The counter counts every thread's allocations and frees (allocator_counts_every_thread), but it also drops
    # where this thread frees memory allocated before the profile began (an earlier test's tensor that the
    # garbage collector releases now): not this run's, and counted it read a run's peak low (by half, once in a
    # long test session). Such a free is one whose address no event of this profile allocated: added back.
    baseline = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    allocated: set = set()
    earlier = peak = 0
    for event in memory:
        args = event["args"]
        if args["Bytes"] >= 0:
            allocated.add(args.get("Addr"))
        elif args.get("Addr") not in allocated:
            earlier += -args["Bytes"]
        peak = max(peak, args["Total Allocated"] - baseline + earlier)
    return int(peak)


@contextmanager
def counted_profile() -> Iterator[profile]:
    """torch's profiler recording CPU memory events, with c10 counting every thread's allocations and
    kineto's start and stop lines kept off the console (memplan.estimator.kernels.probe.memory_profile)."""
    from memplan.estimator.kernels.probe import memory_profile

    with allocator_counts_every_thread(), memory_profile() as prof:
        yield prof
