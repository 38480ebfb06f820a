"""The real peak of a training run: on this CPU (the profiler's allocator total) or on a CUDA device.

Both train through memplan.truth.runs (a real `Trainer.fit`, or a plain loop), never through the
step the estimator traces.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memplan.truth.counting import counted_profile, peak_total_allocated
from memplan.truth.runs import Training, preload, train


def measure_cpu_peak(
    build: Callable[[], nn.Module],
    make_batch: Callable[[], Any],
    *,
    loss=None,
    optimizer=None,
    precision: str = "32-true",
    checkpointing: bool | Collection[type[nn.Module]] | str = False,
    steps: int = 2,
    loop: str = "lightning",
) -> int:
    """Peak "Total Allocated" bytes over building the model and batch and `steps` real training steps:
    a `Trainer.fit` for loop="lightning", a plain PyTorch loop in that order for the other loops (runs.PLAIN_LOOPS)."""
    run = Training(build=build, make_batch=make_batch, loss=loss, optimizer=optimizer, precision=precision,
                   checkpointing=checkpointing, steps=steps)
    preload(loop)
    with counted_profile() as prof:
        train(run, loop=loop)
    return peak_total_allocated(prof)


@dataclass(frozen=True, kw_only=True)
class CudaMeasurement:
    """What a real GPU reports for the steady-state step (all bytes)."""

    max_allocated: int
    """torch.cuda.max_memory_allocated() over the last step (peaks reset before it)."""
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
    checkpointing: bool | Collection[type[nn.Module]] | str = False,
    steps: int = 2,
    loop: str = "lightning",
) -> CudaMeasurement:
    """Run real training steps on the current CUDA device and read torch's and NVML's peaks. Use a
    fresh process: the CUDA context and the allocator cache are part of what is measured."""
    from memplan.hardware import gpu_for_cuda_index, process_gpu_bytes

    gpu = gpu_for_cuda_index(torch.cuda.current_device())

    def reset_before_last(step: int) -> None:
        if step == steps:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    run = Training(build=build, make_batch=make_batch, loss=loss, optimizer=optimizer, precision=precision,
                   checkpointing=checkpointing, steps=steps, on_step_start=reset_before_last)
    sampler = _NvmlSampler(gpu, process_gpu_bytes) if gpu is not None else None
    try:
        train(run, loop=loop, accelerator="cuda")
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
