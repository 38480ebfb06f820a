"""Measure the real peak of training steps on this machine's CPU, the truth estimates are held to.

Truth is the peak of the CPU allocator's "Total Allocated" as torch.profiler reports it
(profile_memory=True): every allocation from the moment profiling starts, kernel-internal ones
included. Profiling starts before the model is built, so parameters, batch, optimizer state and two
full steps are all inside it. While measuring, the allocator counts every thread's allocations and
frees (see `allocator_counts_every_thread`), not only those of the threads the profiler records.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memplan.estimator.checkpointing import CheckpointArg, apply_checkpointing
from memplan.estimator.inputs import resolve_loss, resolve_optimizer
from memplan.estimator.kernel_probe import memory_profile
from memplan.estimator.step import PrecisionPolicy, map_tensors, run_training_step


def measure_cpu_peak(
    build: Callable[[], nn.Module],
    make_batch: Callable[[], Any],
    *,
    loss=None,
    optimizer=None,
    precision: str = "32-true",
    checkpointing: CheckpointArg = False,
    steps: int = 2,
    loop: str = "lightning",
) -> int:
    """Peak "Total Allocated" bytes over building the model and batch and `steps` real training steps
    in `loop`'s order ("lightning" or "torch", as in memplan.estimate)."""
    with allocator_counts_every_thread(), memory_profile() as prof:
        _run_steps(build, make_batch, torch.device("cpu"), loss=loss, optimizer=optimizer,
                   precision=precision, checkpointing=checkpointing, steps=steps, loop=loop)
    return peak_total_allocated(prof)


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


def _run_steps(build, make_batch, device: torch.device, *, loss, optimizer, precision, checkpointing, steps,
               before_last: Callable[[], None] | None = None, loop: str = "lightning") -> None:
    """Build the model and batch on `device` and run `steps` real training steps, as the trace does."""
    policy = PrecisionPolicy.from_string(precision)
    model = build().train()
    if policy.param_dtype != torch.float32:
        model = model.to(policy.param_dtype)  # Lightning converts before moving to the device
    model = model.to(device)
    if checkpointing:
        apply_checkpointing(model, checkpointing)
    batch = map_tensors(policy.convert_batch(make_batch()), lambda t: t.to(device))
    opt = resolve_optimizer(model, optimizer)
    loss_fn = resolve_loss(model, loss)
    grad_scale = torch.tensor(65536.0, device=device) if policy.grad_scaling else None
    for step in range(steps):
        if step == steps - 1 and before_last is not None:
            before_last()
        run_training_step(model, batch, loss_fn=loss_fn, optimizer=opt, policy=policy,
                          device_type=device.type, grad_scale=grad_scale, loop=loop)


def _reset_cuda_peaks() -> None:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def peak_total_allocated(prof: torch.profiler.profile) -> int:
    """Max of the "[memory]" events' "Total Allocated" for the CPU in a finished profile, less the
    counter's value when the profile began.

    The CPU counter (c10 ProfiledCPUMemoryReporter) is process-global and moves only while a profiler
    records memory: tensors allocated under an earlier profile and freed after it stay counted. The
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
    baseline = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    return int(max(e["args"]["Total Allocated"] for e in memory) - baseline)


@dataclass(frozen=True, kw_only=True)
class CudaMeasurement:
    """What a real GPU reports for the steady-state step (all bytes)."""

    max_allocated: int
    """torch.cuda.max_memory_allocated() over step 2 (peaks reset after step 1)."""
    max_reserved: int
    """torch.cuda.max_memory_reserved() over the whole run (the cache only grows)."""
    nvml_process_peak: int | None
    """Highest NVML per-process usage sampled during the run; None where NVML cannot see the process."""


def measure_cuda_peak(
    build: Callable[[], nn.Module],
    make_batch: Callable[[], Any],
    *,
    loss=None,
    optimizer=None,
    precision: str = "32-true",
    checkpointing: CheckpointArg = False,
    steps: int = 2,
) -> CudaMeasurement:
    """Run real training steps on the current CUDA device and read torch's and NVML's peaks. Use a
    fresh process: the CUDA context and the allocator cache are part of what is measured."""
    from memplan.hardware import gpu_for_cuda_index, process_gpu_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    gpu = gpu_for_cuda_index(device.index)
    sampler = _NvmlSampler(gpu, process_gpu_bytes) if gpu is not None else None
    try:
        _run_steps(build, make_batch, device, loss=loss, optimizer=optimizer, precision=precision,
                   checkpointing=checkpointing, steps=steps, before_last=_reset_cuda_peaks)
        torch.cuda.synchronize()
    finally:
        nvml_peak = sampler.stop() if sampler is not None else None
    stats = torch.cuda.memory_stats()
    return CudaMeasurement(
        max_allocated=int(stats["allocated_bytes.all.peak"]),
        max_reserved=int(stats["reserved_bytes.all.peak"]),
        nvml_process_peak=nvml_peak,
    )


class _NvmlSampler:
    """Polls this process's NVML usage on a thread; keeps the maximum."""

    def __init__(self, gpu, read, interval_s: float = 0.002):
        self._gpu, self._read, self._interval = gpu, read, interval_s
        self._peak: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            value = self._read(os.getpid(), self._gpu)
            if value is not None:
                self._peak = value if self._peak is None else max(self._peak, value)
            if self._done.wait(self._interval):
                return

    def stop(self) -> int | None:
        self._done.set()
        self._thread.join()
        value = self._read(os.getpid(), self._gpu)
        if value is not None:
            self._peak = value if self._peak is None else max(self._peak, value)
        return self._peak
