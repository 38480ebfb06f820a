"""Per-rank memory readings, the per-rank JSON-lines log, and the decision every rank shares.

A reading comes from the rank's own device: on a GPU, NVML (this process's bytes, the device's used
and total) and torch's caching allocator (allocated, reserved, peak reserved since the last reading);
on CPU, psutil (this process's RSS, the host's RAM and what is still available). Readings are
gathered from every rank with one collective, so each rank holds the same table and `Adjuster.decide`,
a pure function of that table and of state every rank keeps alike, gives every rank the same answer.
"""
from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import psutil
import torch

from memplan.hardware import NA, gpu_for_cuda_index, host_info, nvml_query, process_gpu_bytes
from memplan.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class MemoryReading:
    """One rank's memory at one moment. Bytes; None where the source could not tell."""

    process_bytes: int | None = None
    """This process's memory on its device: NVML's per-PID figure on a GPU, the RSS on CPU."""
    device_used_bytes: int | None = None
    """Device memory in use by every process (NVML `used`); on CPU, host RAM not available."""
    device_total_bytes: int | None = None
    """Device memory (NVML `total`); on CPU, host RAM or the container's limit."""
    allocated_bytes: int | None = None
    """Bytes in live tensors (torch's caching allocator; None on CPU)."""
    reserved_bytes: int | None = None
    """Bytes the caching allocator holds (None on CPU)."""
    peak_bytes: int | None = None
    """Peak reserved since the previous reading on a GPU; peak RSS of the process on CPU."""
    headroom_bytes: int | None = None
    """What the device could still give at this interval's peak: total - used - (peak - reserved)
    on a GPU; the host's available RAM (within the container's limit) on CPU."""

    def to_dict(self) -> dict[str, int | None]:
        """The fields, bytes as ints (for the JSON-lines log)."""
        return {name: getattr(self, name) for name in READING_FIELDS}

    def describe(self) -> str:
        """The figures that are known, for people."""
        parts = []
        if self.device_used_bytes is not None and self.device_total_bytes is not None:
            parts.append(f"device: {format_bytes(self.device_used_bytes)} of {format_bytes(self.device_total_bytes)} in use")
        if self.process_bytes is not None:
            parts.append(f"this process: {format_bytes(self.process_bytes)}")
        if self.reserved_bytes is not None:
            parts.append(f"torch: {format_bytes(self.allocated_bytes or 0)} allocated, "
                         f"{format_bytes(self.reserved_bytes)} reserved (peak {format_bytes(self.peak_bytes or 0)})")
        return "; ".join(parts) if parts else "no memory reading available"


READING_FIELDS = tuple(f.name for f in fields(MemoryReading))


def read_memory(device: torch.device, *, reset_peak: bool = True) -> MemoryReading:
    """A reading of `device` (this rank's root device) now. On a GPU, `reset_peak` starts the next
    interval's peak (torch.cuda.reset_peak_memory_stats)."""
    reader = _READERS.get(device)
    if reader is None:
        reader = _READERS[device] = _CudaReader(device) if device.type == "cuda" else _HostReader()
    return reader.read(reset_peak)


class _CudaReader:
    """The rank's GPU found once through NVML (CUDA_VISIBLE_DEVICES honoured); then two queries a
    reading: its memory, and the processes on it (for this one's share)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.gpu = gpu_for_cuda_index(device.index if device.index is not None else torch.cuda.current_device())
        self.pid = os.getpid()

    def read(self, reset_peak: bool) -> MemoryReading:
        device = self.device
        reserved = int(torch.cuda.memory_reserved(device))
        peak = int(torch.cuda.max_memory_reserved(device))
        allocated = int(torch.cuda.memory_allocated(device))
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
        handle = NA if self.gpu is None else nvml_query("nvmlDeviceGetHandleByUUID", self.gpu.uuid)
        memory = NA if handle is NA else nvml_query("nvmlDeviceGetMemoryInfo", handle)
        if memory is not NA:
            total, used = int(memory.total), int(memory.used)
            process = process_gpu_bytes(self.pid, self.gpu)
        else:  # no NVML: the driver's free/total through CUDA itself
            free, total = (int(v) for v in torch.cuda.mem_get_info(device))
            used, process = total - free, None
        return MemoryReading(
            process_bytes=process, device_used_bytes=used, device_total_bytes=total, allocated_bytes=allocated,
            reserved_bytes=reserved, peak_bytes=peak,
            headroom_bytes=max(0, total - used - max(0, peak - reserved)),  # others may have grown since
        )


class _HostReader:
    """psutil: this process's RSS and the host's available RAM; a container's limit, read once, and
    its usage at every reading where there is one."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.limited = host_info().cgroup_limit_bytes is not None

    def read(self, reset_peak: bool) -> MemoryReading:
        if self.limited:
            host = host_info()
            total = min(host.total_bytes, host.cgroup_limit_bytes or host.total_bytes)
            headroom = host.budget_bytes
        else:
            memory = psutil.virtual_memory()
            total, headroom = int(memory.total), int(memory.available)
        return MemoryReading(
            process_bytes=int(self.process.memory_info().rss), device_used_bytes=max(0, total - headroom),
            device_total_bytes=total, headroom_bytes=headroom,
            peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        )


_READERS: dict[torch.device, _CudaReader | _HostReader] = {}


@dataclass(frozen=True, kw_only=True)
class RankStatus:
    """What one rank reports at a check: its reading and how it runs now."""

    rank: int
    """Global rank."""
    reading: MemoryReading
    """Its memory reading."""
    micro_batch_size: int
    """Its micro-batch now: below the shared one after it retried an OOM on its own."""
    gradient_checkpointing: bool
    """Whether checkpointing is on for it (an OOM at micro-batch 1 turns it on locally)."""
    oom_retries: int
    """OOMs it has recovered from since the run started."""
    oom_micro_batch_size: int | None = None
    """The smallest micro-batch that ran out of memory on it, if any did."""

    def to_row(self) -> list[float]:
        """Fixed-width numbers for the gather (float64 holds every byte count exactly; None is -1)."""
        values = [getattr(self.reading, name) for name in READING_FIELDS]
        row = [float(self.rank), *(-1.0 if v is None else float(v) for v in values)]
        failed = -1.0 if self.oom_micro_batch_size is None else float(self.oom_micro_batch_size)
        return [*row, float(self.micro_batch_size), float(self.gradient_checkpointing), float(self.oom_retries), failed]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> RankStatus:
        n = len(READING_FIELDS)
        reading = MemoryReading(**{name: None if v < 0 else int(v) for name, v in zip(READING_FIELDS, row[1:1 + n])})
        micro, checkpointing, ooms, failed = row[1 + n:]
        return cls(rank=int(row[0]), reading=reading, micro_batch_size=int(micro),
                   gradient_checkpointing=bool(checkpointing), oom_retries=int(ooms),
                   oom_micro_batch_size=None if failed < 0 else int(failed))


def gather_statuses(strategy: Any, status: RankStatus, world_size: int) -> tuple[RankStatus, ...]:
    """Every rank's status, in rank order, on every rank: one all-gather through the Trainer's strategy."""
    return tuple(RankStatus.from_row(row) for row in gather_rows(strategy, status.to_row(), world_size))


def gather_rows(strategy: Any, row: Sequence[float], world_size: int) -> list[list[float]]:
    """Each rank's row of numbers, in rank order, on every rank (one all-gather, one device sync)."""
    tensor = torch.tensor(list(row), dtype=torch.float64, device=strategy.root_device)
    return strategy.all_gather(tensor).reshape(world_size, -1).tolist()


METRIC_FIELDS = ("process_bytes", "device_used_bytes", "peak_bytes", "headroom_bytes")
"""The readings sent to the Trainer's loggers, per rank."""


def log_metrics(loggers: Sequence[Any], statuses: Sequence[RankStatus], layout: Any, step: int) -> None:
    """Every rank's readings to the Trainer's loggers as memplan/rank<R>/<field>. Lightning's loggers
    write from rank 0 only; after the gather rank 0 holds every rank's readings."""
    metrics: dict[str, float] = {
        "memplan/micro_batch_size": float(layout.micro_batch_size),
        "memplan/micro_batches_per_step": float(layout.micro_batches_per_step),
        "memplan/gradient_checkpointing": float(layout.gradient_checkpointing),
    }
    for status in statuses:
        for name in METRIC_FIELDS:
            value = getattr(status.reading, name)
            if value is not None:
                metrics[f"memplan/rank{status.rank}/{name}"] = float(value)
        metrics[f"memplan/rank{status.rank}/oom_retries"] = float(status.oom_retries)
    for logger in loggers:
        logger.log_metrics(metrics, step=step)


class RankLog:
    """`<dir>/rank<R>.jsonl`: one JSON object a line, flushed as written, appended across resumes."""

    def __init__(self, directory: str | os.PathLike, rank: int) -> None:
        self.path = Path(directory) / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._file = self.path.open("a", encoding="utf-8", buffering=1)  # line-buffered: flushed per line

    def write(self, event: str, step: int, **fields_: Any) -> dict[str, Any]:
        record = {"event": event, "step": step, "rank": self.rank, "time": round(time.time(), 3), **fields_}
        self._file.write(json.dumps(record) + "\n")
        return record

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True, kw_only=True)
class Change:
    """A shared decision: the micro-batch and checkpointing every rank runs from the next step."""

    micro_batch_size: int
    """The new micro-batch."""
    gradient_checkpointing: bool
    """Checkpointing from now on."""
    cause: Literal["oom", "headroom", "grow"]
    """What triggered it: an OOM retried on some rank, headroom under the margin, or lasting headroom."""
    ranks: tuple[int, ...]
    """The ranks whose readings or OOMs triggered it (every rank, for growth)."""
    reason: str
    """The same, in words, for people reading the log."""


class Adjuster:
    """Decides, from every rank's status, whether all ranks lower or grow the micro-batch.

    Lower (halve; at 1, turn checkpointing on) when a rank retried an OOM since the last check or its
    headroom is under `margin` x its device memory; grow (double, up to the planned size) after
    `grow_patience` checks in a row where every rank has `grow_margin` x its memory free. A size that
    ran out of memory is never grown back to. Checkpointing, once on, stays on.
    """

    def __init__(self, *, margin: float, grow: bool, grow_margin: float, grow_patience: int,
                 planned_micro_batch_size: int, can_checkpoint: bool) -> None:
        self.margin = margin
        self.grow = grow
        self.grow_margin = grow_margin
        self.grow_patience = grow_patience
        self.planned_micro_batch_size = planned_micro_batch_size
        self.can_checkpoint = can_checkpoint
        self.calm_checks = 0
        """Checks in a row with room to grow."""
        self.ceiling: int | None = None
        """Smallest micro-batch that ran out of memory; growth stays below it."""
        self._ooms_seen: dict[int, int] = {}

    def decide(self, statuses: Sequence[RankStatus], micro_batch_size: int, checkpointing: bool) -> Change | None:
        oom_ranks = tuple(s.rank for s in statuses if s.oom_retries > self._ooms_seen.get(s.rank, 0))
        self._ooms_seen = {s.rank: s.oom_retries for s in statuses}
        if oom_ranks:
            return self._after_ooms(statuses, oom_ranks, micro_batch_size, checkpointing)
        tight = tuple(s.rank for s in statuses if _fraction_free(s.reading) is not None and not self.has_margin(s.reading))
        if tight:
            self.calm_checks = 0
            return self._lower(statuses, tight, micro_batch_size, checkpointing)
        roomy = all(self.roomy(s.reading) for s in statuses)
        self.calm_checks = self.calm_checks + 1 if roomy else 0
        if self.grow and self.calm_checks >= self.grow_patience:
            return self._grow(micro_batch_size, checkpointing, tuple(s.rank for s in statuses))
        return None

    def roomy(self, reading: MemoryReading) -> bool:
        """Whether a reading shows `grow_margin` of the device free at its interval's peak: room to grow."""
        free = _fraction_free(reading)
        return free is not None and free >= self.grow_margin

    def has_margin(self, reading: MemoryReading) -> bool:
        """Whether a reading shows `margin` of the device free at its interval's peak (unknown: no)."""
        free = _fraction_free(reading)
        return free is not None and free >= self.margin

    def _after_ooms(self, statuses, ranks, micro_batch_size, checkpointing) -> Change | None:
        self.calm_checks = 0
        smallest = min(s.micro_batch_size for s in statuses)
        failed = [s.oom_micro_batch_size for s in statuses if s.oom_micro_batch_size is not None]
        self.ceiling = min([*failed, *([self.ceiling] if self.ceiling else [])], default=self.ceiling)
        checkpoint = checkpointing or any(s.gradient_checkpointing for s in statuses)
        if smallest == micro_batch_size and checkpoint == checkpointing:
            return None
        return Change(micro_batch_size=smallest, gradient_checkpointing=checkpoint, cause="oom", ranks=ranks,
                      reason=f"rank(s) {_ranks(ranks)} ran out of memory and retried with micro-batch {smallest}"
                             f"{' and checkpointing' if checkpoint and not checkpointing else ''}")

    def _lower(self, statuses, ranks, micro_batch_size, checkpointing) -> Change | None:
        worst = min((s for s in statuses if s.rank in ranks), key=lambda s: _fraction_free(s.reading))
        left = f"rank {worst.rank} has {format_bytes(worst.reading.headroom_bytes)} free at its peak, " \
               f"under the margin of {self.margin:.0%} of {format_bytes(worst.reading.device_total_bytes)}"
        smaller = smaller_micro_batch(micro_batch_size)
        if smaller is not None:
            return Change(micro_batch_size=smaller, gradient_checkpointing=checkpointing, cause="headroom",
                          ranks=ranks, reason=f"{left}: micro-batch {micro_batch_size} -> {smaller}")
        if self.can_checkpoint and not checkpointing:
            return Change(micro_batch_size=1, gradient_checkpointing=True, cause="headroom", ranks=ranks,
                          reason=f"{left}: at micro-batch 1, activation checkpointing on")
        return None

    def _grow(self, micro_batch_size, checkpointing, ranks) -> Change | None:
        cap = self.planned_micro_batch_size if self.ceiling is None else min(self.planned_micro_batch_size,
                                                                             self.ceiling - 1)
        larger = larger_micro_batch(micro_batch_size, max(cap, 1))
        if larger is None:
            return None
        self.calm_checks = 0
        return Change(micro_batch_size=larger, gradient_checkpointing=checkpointing, cause="grow", ranks=ranks,
                      reason=f"every rank has had {self.grow_margin:.0%} of its memory free for "
                             f"{self.grow_patience} checks: micro-batch {micro_batch_size} -> {larger}")

    def state_dict(self) -> dict[str, int]:
        return {"calm_checks": self.calm_checks, "ceiling": self.ceiling or 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calm_checks = int(state.get("calm_checks", 0))
        self.ceiling = int(state.get("ceiling", 0)) or None


def smaller_micro_batch(size: int) -> int | None:
    """The next micro-batch to try below `size` (half of it), or None at 1."""
    return size // 2 if size > 1 else None


def larger_micro_batch(size: int, cap: int) -> int | None:
    """The next micro-batch to grow to from `size` (double, at most `cap`), or None at the cap."""
    return min(2 * size, cap) if size < cap else None


def _fraction_free(reading: MemoryReading) -> float | None:
    if reading.headroom_bytes is None or not reading.device_total_bytes:
        return None
    return reading.headroom_bytes / reading.device_total_bytes


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def summary_line(rank: int, peak_process_bytes: int | None, min_headroom_bytes: int | None,
                 micro_batch_size: int, micro_batches_per_step: int, checkpointing: bool, oom_retries: int) -> str:
    """One rank's end-of-fit summary, for people."""
    peak = "n/a" if peak_process_bytes is None else format_bytes(peak_process_bytes)
    headroom = "n/a" if min_headroom_bytes is None else format_bytes(min_headroom_bytes)
    return (f"rank {rank}: peak {peak} in this process, least headroom {headroom}, micro-batch "
            f"{micro_batch_size} x {micro_batches_per_step} per step{', checkpointing' if checkpointing else ''}, "
            f"{oom_retries} OOM retr{'y' if oom_retries == 1 else 'ies'}")
