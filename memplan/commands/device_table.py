"""What `memplan devices` prints: the GPUs this process can use and the host, as a table or JSON.

Both views take the GPUs in CUDA order (as `visible_gpus()` returns them, so row i is cuda:i) and a
`HostInfo`. With no GPU they say why (NVML unavailable, or CUDA_VISIBLE_DEVICES hiding them) and how
to plan for a GPU this machine does not have.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rich.markup import escape
from rich.console import Group
from rich.table import Table
from rich.text import Text

from memplan.hardware.catalog import match_nvml_name
from memplan.hardware.host import HostInfo
from memplan.hardware.nvml import GpuInfo, nvml_unavailable_reason
from memplan.hardware.visible import visibility_problem
from memplan.units import format_bytes

OFF_BOX_HINT = ("To plan for a GPU this machine does not have, pass --gpu H100-80GB (a known "
                "model) or --gpu-memory 24GiB (any GPU).")
_SHOWN_PROCESSES = 3


def _no_gpu_note(env: Mapping[str, str]) -> str:
    reason = nvml_unavailable_reason()
    if reason is not None:
        why = f"NVML is unavailable: {reason}."
    elif env.get("CUDA_VISIBLE_DEVICES") is not None:
        why = (f"No GPU is visible to this process: "
               f"{visibility_problem(env) or 'CUDA_VISIBLE_DEVICES=' + repr(env['CUDA_VISIBLE_DEVICES']) + ' selects none'}.")
    else:
        why = "NVML works but reports no GPU."
    return f"{why} {OFF_BOX_HINT}"


def _gpu_dict(cuda_index: int, gpu: GpuInfo) -> dict[str, Any]:
    model = match_nvml_name(gpu.name)
    return {
        "cuda_index": cuda_index,
        "nvml_index": gpu.index,
        "mig_index": gpu.mig_index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "catalog_model": None if model is None else model.name,
        "total_bytes": gpu.total_bytes,
        "used_bytes": gpu.used_bytes,
        "free_bytes": gpu.free_bytes,
        "compute_capability": None if gpu.compute_capability is None else list(gpu.compute_capability),
        "bf16_supported": gpu.bf16_supported,
        "mig_mode": gpu.mig_mode,
        "processes": [dataclasses.asdict(p) for p in gpu.processes],
    }


def devices_dict(gpus: Sequence[GpuInfo], host: HostInfo, *,
                 env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """JSON-ready view (`memplan devices --json`): plain ints in bytes, no formatted strings."""
    reason = nvml_unavailable_reason()
    return {
        "nvml": {"available": reason is None, "reason": reason},
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "gpus": [_gpu_dict(i, gpu) for i, gpu in enumerate(gpus)],
        "host": {**dataclasses.asdict(host), "budget_bytes": host.budget_bytes},
        "note": None if gpus else _no_gpu_note(env),
    }


def _size(num_bytes: int | None) -> str:
    return "n/a" if num_bytes is None else format_bytes(num_bytes)


def _processes_cell(gpu: GpuInfo) -> str:
    ranked = sorted(gpu.processes, key=lambda p: p.used_bytes or 0, reverse=True)
    lines = [f"{p.pid} {escape(p.name or '?')} {_size(p.used_bytes)}"
             for p in ranked[:_SHOWN_PROCESSES]]
    if len(ranked) > _SHOWN_PROCESSES:
        lines.append(f"+{len(ranked) - _SHOWN_PROCESSES} more")
    return "\n".join(lines) or "-"


def _host_caption(host: HostInfo) -> str:
    ram = f"RAM {format_bytes(host.available_bytes)} available of {format_bytes(host.total_bytes)}"
    if host.cgroup_limit_bytes is not None:
        ram += f" (cgroup limit {format_bytes(host.cgroup_limit_bytes)})"
    shm = "" if host.shm_total_bytes is None else f", /dev/shm {format_bytes(host.shm_total_bytes)}"
    return f"Host: {ram}, {host.usable_cpu_count}/{host.cpu_count} CPUs usable{shm}"


def devices_table(gpus: Sequence[GpuInfo], host: HostInfo, *,
                  env: Mapping[str, str] = os.environ) -> Table | Group:
    """Rich table for `memplan devices`: one row per GPU in CUDA order, the host in the caption. Without a GPU,
    why, and the host, as lines of text (in a table's one cell the sentence would fold at the table's width,
    even piped)."""
    if not gpus:
        return Group(Text("GPUs: none", style="bold"), Text(_no_gpu_note(env), style="yellow"),
                     Text(_host_caption(host), style="dim"))
    table = Table(title="GPUs (row = CUDA index)", caption=_host_caption(host))
    for header, justify in (("cuda", "right"), ("nvml", "right"), ("name", "left"),
                            ("used / total", "right"), ("free", "right"), ("cc", "center"),
                            ("bf16", "center"), ("MIG", "center"), ("processes", "left")):
        table.add_column(header, justify=justify)
    for cuda_index, gpu in enumerate(gpus):
        cc = "?" if gpu.compute_capability is None else "{}.{}".format(*gpu.compute_capability)
        nvml_index = str(gpu.index) if gpu.mig_index is None else f"{gpu.index}:{gpu.mig_index}"
        table.add_row(
            str(cuda_index), nvml_index, escape(gpu.name),
            f"{_size(gpu.used_bytes)} / {_size(gpu.total_bytes)}", _size(gpu.free_bytes), cc,
            {True: "yes", False: "no", None: "?"}[gpu.bf16_supported],
            {True: "on", False: "off", None: "-"}[gpu.mig_mode],
            _processes_cell(gpu),
        )
    return table


__all__ = ["OFF_BOX_HINT", "devices_dict", "devices_table"]
