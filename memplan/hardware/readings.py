"""A device's memory now: the one place torch.cuda's allocator counters and device facts are read beside NVML.

A reading comes from the rank's own device: on a GPU, NVML (this process's bytes, the device's used
and total) and torch's caching allocator (allocated, reserved, peak reserved since the last reading);
on CPU, this process's RSS and the host's RAM (psutil's figures, from the /proc files kept open).

The user's CUDA statistics are left alone: memplan never calls torch.cuda.reset_peak_memory_stats, so
`max_memory_allocated()` and DeviceStatsMonitor's peaks keep their meaning. The interval's peak is
derived from torch's running peak instead (see `interval_peak_bytes`).
"""
from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass, fields
from pathlib import Path

import psutil
import torch

from memplan.hardware import NA, gpu_for_cuda_index, nvml_query, nvml_unavailable_reason, process_gpu_bytes
from memplan.hardware.fallbacks import FALLBACKS, fallback_lines, fallback_mask  # noqa: F401 (re-exported)
from memplan.hardware.nvml import memory_bytes
from memplan.hardware.host import cgroup_memory_files
from memplan.units import format_bytes

log = logging.getLogger(__name__)


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
    """Peak reserved since the previous reading on a GPU (see `interval_peak_bytes`); peak RSS of the
    process since it started on CPU."""
    headroom_bytes: int | None = None
    """What the device could still give at this interval's peak: total - used - (peak - reserved)
    on a GPU; the host's available RAM (within the container's limit) on CPU."""

    @property
    def process_peak_bytes(self) -> int | None:
        """This process's peak on its device in the interval, the figure a plan's predicted peak
        compares with: on a GPU, NVML's figure plus what torch held above now at its peak; on CPU the
        peak RSS."""
        if self.reserved_bytes is None:
            return self.peak_bytes
        if self.process_bytes is None or self.peak_bytes is None:
            return None
        return self.process_bytes + max(0, self.peak_bytes - self.reserved_bytes)

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


def read_memory(device: torch.device, *, new_interval: bool = True) -> MemoryReading:
    """A reading of `device` (this rank's root device) now. `new_interval`: the next reading's peak
    counts from this one (False for a reading in between, such as at an OOM)."""
    reader = _READERS.get(device)
    if reader is None:
        reader = _READERS[device] = _CudaReader(device) if device.type == "cuda" else _HostReader()
    return reader.read(new_interval)


class _CudaReader:
    """The rank's GPU found once through NVML (CUDA_VISIBLE_DEVICES honoured); then two queries a
    reading: its memory, and the processes on it (for this one's share)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.fallbacks: set[str] = set()
        """The FALLBACKS readings of this device have taken."""
        self.gpu = gpu_for_cuda_index(device.index if device.index is not None else torch.cuda.current_device())
        self.pid = os.getpid()
        self.previous: tuple[int, int] | None = None
        """torch's running peak and the reserved bytes at the previous reading."""

    def read(self, new_interval: bool) -> MemoryReading:
        """Never raises for a reading that fails: NVML lost falls back to CUDA's own free/total (said
        once in the log), and where that fails too the device figures are missing (None), said once."""
        device = self.device
        try:
            stats = torch.cuda.memory_stats(device)  # one call: the counters below, never reset
        except RuntimeError as err:
            self.fallbacks.add("stats")
            _say_once("stats", "torch.cuda.memory_stats(%s) failed (%s): torch's counters are missing from the "
                      "readings", device, err)
            stats = None
        reserved = allocated = peak = None
        if stats is not None:
            reserved = int(stats.get("reserved_bytes.all.current", 0))
            running_peak = int(stats.get("reserved_bytes.all.peak", 0))
            allocated = int(stats.get("allocated_bytes.all.current", 0))
            peak = interval_peak_bytes(running_peak, reserved, self.previous)
            if new_interval:
                self.previous = (running_peak, reserved)
        handle = NA if self.gpu is None else nvml_query("nvmlDeviceGetHandleByUUID", self.gpu.uuid)
        total, used, _ = memory_bytes(NA if handle is NA else nvml_query("nvmlDeviceGetMemoryInfo", handle))
        process = None
        if total is not None and total > 0:
            process = process_gpu_bytes(self.pid, self.gpu)
        else:  # no NVML: the driver's free/total through CUDA itself
            self.fallbacks.add("nvml")
            _say_once("nvml", "NVML gives no memory reading for %s (%s): device figures come from CUDA's "
                      "mem_get_info from now on, and this process's own share is not available", device,
                      nvml_unavailable_reason() or "the query failed")
            try:
                free, total = (int(v) for v in torch.cuda.mem_get_info(device))
                used = total - free
            except RuntimeError as err:
                self.fallbacks.add("cuda")
                _say_once("cuda", "torch.cuda.mem_get_info(%s) failed too (%s): the device's memory figures are "
                          "missing from the readings", device, err)
                total = used = None
        headroom = None
        if total is not None and used is not None:
            headroom = max(0, total - used - max(0, (peak or 0) - (reserved or 0)))  # others may have grown since
        return MemoryReading(
            process_bytes=process, device_used_bytes=used, device_total_bytes=total, allocated_bytes=allocated,
            reserved_bytes=reserved, peak_bytes=peak, headroom_bytes=headroom,
        )


def reading_fallbacks(device: torch.device) -> tuple[str, ...]:
    """The FALLBACKS codes the readings of `device` have taken in this process (none on CPU)."""
    reader = _READERS.get(device)
    taken = reader.fallbacks if isinstance(reader, _CudaReader) else set()
    return tuple(code for code in FALLBACKS if code in taken)


_said: set[str] = set()


def _say_once(key: str, message: str, *args: object) -> None:
    """A warning in the log, once per process for each kind of failed reading."""
    if key not in _said:
        _said.add(key)
        log.warning(message, *args)


def interval_peak_bytes(running_peak: int, reserved: int, previous: tuple[int, int] | None) -> int:
    """Peak reserved bytes since the previous reading, from torch's running peak (never reset).

    When the running peak moved since the previous reading (it rose, or the user reset it), the new
    value was reached in this interval: it is the interval's peak (or the reserved bytes at the
    interval's start, if higher). When it did not move, the interval stayed at or below it, and the
    figure is the reserved bytes at either end of the interval: exact while the caching allocator
    only grows (it gives memory back only on empty_cache() or after a failed allocation), a lower
    bound after such a release. The first reading's interval is the whole run so far.
    """
    if previous is None:
        return max(running_peak, reserved)
    previous_peak, previous_reserved = previous
    if running_peak != previous_peak:
        return max(running_peak, previous_reserved, reserved)
    return max(previous_reserved, reserved)


class _HostReader:
    """This process's RSS and the host's available RAM, within a container's limit where there is
    one (read once, its usage at every reading). The figures psutil gives, read from the same /proc
    (and cgroup) files kept open: a reading is taken every few steps of a running fit, and opening
    and parsing the files each time costs ~0.2 ms there. psutil where a file cannot be read."""

    def __init__(self, *, statm: str = "/proc/self/statm", meminfo: str = "/proc/meminfo",
                 cgroup: tuple[int | None, Path | None] | None = None) -> None:
        self.process = psutil.Process()
        self.total = int(psutil.virtual_memory().total)
        self.limit, usage_file = cgroup_memory_files() if cgroup is None else cgroup
        self._statm = _OpenFile(statm)
        self._meminfo = _OpenFile(meminfo)
        self._usage = _OpenFile(usage_file) if self.limit is not None and usage_file is not None else None

    def rss_bytes(self) -> int:
        data = self._statm.read()
        if data is not None:  # "size resident shared ..." in pages
            fields_ = data.split()
            if len(fields_) > 1 and fields_[1].isdigit():
                return int(fields_[1]) * _PAGE_BYTES
        return int(self.process.memory_info().rss)

    def available_bytes(self) -> int:
        data = self._meminfo.read()
        if data is not None:
            start = data.find(b"MemAvailable:")
            end = data.find(b"kB", start)
            if start >= 0 and end > start:
                value = data[start + len(b"MemAvailable:"):end].strip()
                if value.isdigit():
                    return int(value) * 1024
        return int(psutil.virtual_memory().available)

    def read(self, new_interval: bool) -> MemoryReading:
        total, headroom = self.total, self.available_bytes()
        if self.limit is not None:  # the container's headroom, as HostInfo.budget_bytes
            data = self._usage.read() if self._usage is not None else None
            used = int(data) if data is not None and data.strip().isdigit() else 0
            total = min(total, self.limit)
            headroom = max(0, min(headroom, self.limit - used))
        return MemoryReading(
            process_bytes=self.rss_bytes(), device_used_bytes=max(0, total - headroom),
            device_total_bytes=total, headroom_bytes=headroom,
            peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        )


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _OpenFile:
    """A small file kept open and read whole from its start at each call (pread); None when it
    cannot be opened or read (another OS, a vanished cgroup)."""

    def __init__(self, path: str | Path) -> None:
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY)
        except (OSError, TypeError):
            self._fd = None

    def read(self) -> bytes | None:
        if self._fd is None:
            return None
        try:
            return os.pread(self._fd, 16384, 0)
        except OSError:
            return None


_READERS: dict[torch.device, _CudaReader | _HostReader] = {}


@dataclass(frozen=True, kw_only=True)
class CudaDeviceFacts:
    """A CUDA device as torch sees it (for when NVML has no answer, and for what NVML does not say)."""

    index: int
    """The CUDA index (CUDA_VISIBLE_DEVICES applied)."""
    name: str
    """torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB HBM3"."""
    total_bytes: int
    """The device's memory."""
    compute_capability: tuple[int, int]
    """(major, minor)."""


def cuda_device_facts(device: torch.device | None = None) -> CudaDeviceFacts | None:
    """`device` (default: this process's current CUDA device) as torch sees it; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return CudaDeviceFacts(index=index, name=props.name, total_bytes=int(props.total_memory),
                           compute_capability=(props.major, props.minor))


def cuda_free_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device` from the CUDA driver (cudaMemGetInfo): NVML's stand-in."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)
