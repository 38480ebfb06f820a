"""The host side of a training node: RAM, CPUs, the container's memory limit, /dev/shm (psutil).

DataLoader workers, pinned buffers, checkpoint loading and CPU offload all live in host memory; a
container or a Slurm job usually has less of it than the machine (psutil reports the machine), so
the cgroup limit is read as well. Bytes everywhere.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


@dataclass(frozen=True, kw_only=True)
class HostInfo:
    """Host memory and CPUs as seen by this process at one moment."""

    total_bytes: int
    """Physical RAM of the machine (psutil.virtual_memory().total)."""
    available_bytes: int
    """RAM that new allocations can get without swapping (psutil's `available`)."""
    cpu_count: int
    """Logical CPUs of the machine."""
    usable_cpu_count: int
    """CPUs this process may run on (its affinity: taskset, Slurm, cpuset cgroups)."""
    cgroup_limit_bytes: int | None = None
    """Memory limit of this process's cgroup (container or Slurm job); None when unlimited/unknown."""
    cgroup_used_bytes: int | None = None
    """Memory charged to that cgroup now (page cache included); None without a limit."""
    shm_total_bytes: int | None = None
    """Size of /dev/shm, through which DataLoader workers pass batches (Docker's default: 64 MiB)."""

    @property
    def budget_bytes(self) -> int:
        """RAM this process can still count on: `available`, capped by the cgroup's headroom."""
        if self.cgroup_limit_bytes is None:
            return self.available_bytes
        headroom = self.cgroup_limit_bytes - (self.cgroup_used_bytes or 0)
        return max(0, min(self.available_bytes, headroom))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # cgroup v2 writes "max" for no limit
        return None
    value = int(text)
    return None if value >= _UNLIMITED else value


def _cgroup_memory(cgroup_root: Path, proc_cgroup: Path) -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup, v2 or v1; (None, None) when unlimited."""
    limit, usage_file = cgroup_memory_files(cgroup_root=cgroup_root, proc_cgroup=proc_cgroup)
    if limit is None:
        return None, None
    return limit, _read_int(usage_file)


def cgroup_memory_files(*, cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
                        ) -> tuple[int | None, Path | None]:
    """(limit, the file that holds its usage) of this process's memory cgroup, v2 or v1; (None, None)
    when unlimited or unknown. The usage file is read at every reading (memplan.hardware.readings)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    candidates: list[tuple[Path, str, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":  # v2 unified hierarchy: "0::/path"
            for base in (cgroup_root / rel, cgroup_root):
                candidates.append((base, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):  # v1: "4:memory:/path"
            for base in (cgroup_root / "memory" / rel, cgroup_root / "memory"):
                candidates.append((base, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    for base, limit_file, usage_file in candidates:
        limit = _read_int(base / limit_file)
        if limit is not None:
            return limit, base / usage_file
    return None, None


def _usable_cpus(cpu_count: int) -> int:
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere assume every CPU
    return len(affinity(0)) if affinity is not None else cpu_count


def host_info(*, cgroup_root: Path = Path("/sys/fs/cgroup"),
              proc_cgroup: Path = Path("/proc/self/cgroup"),
              shm_path: str = "/dev/shm") -> HostInfo:
    """A reading of this host now. The paths are parameters so tests can point them at fixtures."""
    memory = psutil.virtual_memory()
    cpu_count = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    limit, used = _cgroup_memory(cgroup_root, proc_cgroup)
    try:
        shm_total = psutil.disk_usage(shm_path).total
    except OSError:  # no /dev/shm (macOS, Windows)
        shm_total = None
    return HostInfo(
        total_bytes=int(memory.total), available_bytes=int(memory.available),
        cpu_count=cpu_count, usable_cpu_count=_usable_cpus(cpu_count),
        cgroup_limit_bytes=limit, cgroup_used_bytes=used if limit is not None else None,
        shm_total_bytes=shm_total,
    )


def process_rss_bytes(pid: int | None = None) -> int | None:
    """Resident host memory of process `pid` (default: this one); None if it is gone or hidden."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # ZombieProcess is a NoSuchProcess
        return None


__all__ = ["HostInfo", "cgroup_memory_files", "host_info", "process_rss_bytes"]
