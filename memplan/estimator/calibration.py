"""Measured CUDA overheads of this machine, saved by `memplan validate` and read by the estimator.

A calibration holds what a real GPU showed for one training process: the CUDA context (NVML's
per-process peak minus torch's max_memory_reserved) and the caching allocator's overhead
(max_memory_reserved / max_memory_allocated). It is keyed by everything the context size depends
on: GPU name, driver version, torch version, CUDA version and CUDA_MODULE_LOADING. A calibration
for any other key is never used.

The file is JSON (bytes as ints) at ~/.cache/memplan/calibration.json, or where MEMPLAN_CALIBRATION
points; one entry per key, a later measurement replacing an earlier one.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CALIBRATION_ENV = "MEMPLAN_CALIBRATION"
"""Environment variable naming the calibration file (default ~/.cache/memplan/calibration.json)."""
CALIBRATION_FORMAT = 1
"""Version of the file layout."""


@dataclass(frozen=True, kw_only=True)
class CalibrationKey:
    """What a calibration is valid for; all must match for it to be used."""

    gpu_name: str
    """torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB HBM3"."""
    driver_version: str
    """NVML's driver version, e.g. "550.54.15"."""
    torch_version: str
    """torch.__version__."""
    cuda_version: str
    """torch.version.cuda: the CUDA runtime torch was built with."""
    module_loading: str = "LAZY"
    """CUDA_MODULE_LOADING (LAZY when unset, as torch sets it): EAGER loads every kernel at init."""

    def as_str(self) -> str:
        """The entry's name in the file."""
        return " | ".join((self.gpu_name, f"driver {self.driver_version}", f"torch {self.torch_version}",
                           f"CUDA {self.cuda_version}", f"{self.module_loading} loading"))


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """One GPU's measured overheads under one key."""

    key: CalibrationKey
    """The GPU, driver, torch and CUDA this was measured with."""
    compute_capability: tuple[int, int]
    """(major, minor) of the GPU measured."""
    context_bytes: int
    """NVML process peak minus max_memory_reserved: the CUDA context and loaded kernel images."""
    allocator_overhead: float
    """max_memory_reserved / max_memory_allocated of the run (>= 1: cache fragmentation and rounding)."""

    def __post_init__(self) -> None:
        if not isinstance(self.context_bytes, int) or self.context_bytes < 0:
            raise ValueError(f"Calibration.context_bytes must be a non-negative int; got {self.context_bytes!r}")
        if not self.allocator_overhead >= 1.0:
            raise ValueError(f"Calibration.allocator_overhead must be >= 1.0 (reserved / allocated); "
                             f"got {self.allocator_overhead!r}")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["compute_capability"] = list(self.compute_capability)
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> Calibration:
        return cls(key=CalibrationKey(**data["key"]), compute_capability=tuple(data["compute_capability"]),
                   context_bytes=int(data["context_bytes"]), allocator_overhead=float(data["allocator_overhead"]))


def calibration_path(env: Mapping[str, str] = os.environ) -> Path:
    """$MEMPLAN_CALIBRATION, else ~/.cache/memplan/calibration.json."""
    if env.get(CALIBRATION_ENV):
        return Path(env[CALIBRATION_ENV]).expanduser()
    return Path("~/.cache/memplan/calibration.json").expanduser()


def current_key(env: Mapping[str, str] = os.environ) -> CalibrationKey | None:
    """The key of this machine's current CUDA device; None without CUDA or without NVML's driver version."""
    import torch

    from memplan.hardware.nvml import nvml_query
    from memplan.hardware.readings import cuda_device_facts

    facts = cuda_device_facts()
    if facts is None or torch.version.cuda is None:
        return None
    driver = nvml_query("nvmlSystemGetDriverVersion", default=None)
    if not isinstance(driver, str):
        return None
    return CalibrationKey(
        gpu_name=facts.name, driver_version=driver,
        torch_version=torch.__version__, cuda_version=str(torch.version.cuda),
        module_loading=env.get("CUDA_MODULE_LOADING", "LAZY").upper(),
    )


def load_calibrations(path: str | Path) -> dict[str, Calibration]:
    """Every entry of the file, by key string; {} when it does not exist. Raises ValueError naming
    the file when it cannot be read as a calibration file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); delete it and re-run memplan validate on the GPU") from err
    if not isinstance(raw, dict) or raw.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"{path} is not a memplan calibration file of format {CALIBRATION_FORMAT}; "
                         "delete it and re-run memplan validate on the GPU")
    try:
        return {name: Calibration.from_dict(entry) for name, entry in raw.get("entries", {}).items()}
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path} has a malformed entry ({err!r}); delete it and re-run memplan validate") from err


def save_calibration(calibration: Calibration, path: str | Path) -> Path:
    """Add or replace the entry for `calibration.key`, keeping the others; written atomically."""
    path = Path(path)
    entries = load_calibrations(path)
    entries[calibration.key.as_str()] = calibration
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": CALIBRATION_FORMAT, "entries": {k: c.to_dict() for k, c in sorted(entries.items())}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
    return path


def find_calibration(key: CalibrationKey | None, path: str | Path) -> Calibration | None:
    """The entry saved for exactly `key`, or None."""
    if key is None:
        return None
    return load_calibrations(path).get(key.as_str())


def local_calibration(compute_capability: tuple[int, int],
                      env: Mapping[str, str] = os.environ) -> tuple[Calibration, Path] | None:
    """The saved calibration of this machine's current GPU, driver, torch and CUDA when it was
    measured on a GPU of `compute_capability` (so estimates for another GPU model never use it)."""
    path = calibration_path(env)
    if not path.is_file():
        return None
    found = find_calibration(current_key(env), path)
    if found is None or tuple(found.compute_capability) != tuple(compute_capability):
        return None
    return found, path
