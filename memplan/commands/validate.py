"""Hold an estimate to a real run: a few training steps at the planned setting on this machine.

Before anything runs, the estimate is held to the memory free where the steps will run (`check_room`):
the host's RAM (psutil's `available`, within the cgroup's limit) and, on a GPU, the device's free memory
(NVML). A setting the estimate says cannot fit is refused with the figures; `--force` runs it anyway.

The measurement runs in a fresh process (`python -m memplan.commands.validate --measure ...`) so that the
caching allocator and the CUDA context start clean. On a GPU it reads torch's max_memory_allocated /
reserved and NVML's per-process peak (memplan.truth.measure_cuda_peak), and saves the
measured CUDA context as a calibration (memplan.estimator.calibration); on CPU it reads the profiler's peak
allocation (measure_cpu_peak), and there is no context to calibrate.

Goals (issue 2): on CPU every figure within 3 %; on a GPU an over-estimate of at most 6 % and an
under-estimate of at most 2 %. Error = (estimate - measured) / measured.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

MEASURE_MARKER = "MEMPLAN_MEASUREMENT "
"""Prefix of the child's one result line on stdout (the model's own prints may precede it)."""
CPU_GOAL_PCT = 3.0
"""Worst error allowed on CPU, either way."""
GPU_OVER_PCT, GPU_UNDER_PCT = 6.0, 2.0
"""Worst over- and under-estimate allowed on a GPU."""


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What to run: the config at one per-device setting."""

    config: str
    """Path of the LightningCLI config."""
    batch_size: int
    """Micro-batch size per device."""
    precision: str
    """Lightning precision string."""
    checkpointing: bool = False
    """Checkpoint each repeated block."""
    steps: int = 2
    """Real training steps to run (the second is the steady state)."""

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch size must be a positive integer; got {self.batch_size!r}")
        if not isinstance(self.steps, int) or self.steps < 2:
            raise ValueError(f"--steps must be at least 2 (step 1 warms up, the peak is read over the "
                             f"last); got {self.steps!r}")

    def argv(self) -> list[str]:
        out = [self.config, "--batch-size", str(self.batch_size), "--precision", self.precision,
               "--steps", str(self.steps)]
        return out + (["--checkpointing"] if self.checkpointing else [])


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What the fresh process saw (bytes)."""

    device: Literal["cpu", "cuda"]
    """Where the steps ran."""
    max_allocated: int
    """CPU: the profiler's peak allocation; GPU: torch.cuda.max_memory_allocated over the last step."""
    max_reserved: int | None = None
    """torch.cuda.max_memory_reserved (GPU only)."""
    nvml_process_peak: int | None = None
    """NVML's per-process peak (GPU only; None where NVML cannot see the process)."""
    gpu: dict | None = None
    """The calibration key and compute capability of the GPU (GPU only)."""


@dataclass(frozen=True, kw_only=True)
class Row:
    """One estimate-vs-measured comparison."""

    name: str
    """What is compared."""
    estimate_bytes: int
    """The estimate's figure."""
    measured_bytes: int
    """The run's figure."""
    within_goal: bool
    """Whether the error is inside the goal for this device."""

    @property
    def error_pct(self) -> float:
        """(estimate - measured) / measured, in %; positive is an over-estimate."""
        return error_pct(self.estimate_bytes, self.measured_bytes)


def error_pct(estimate_bytes: int, measured_bytes: int) -> float:
    """(estimate - measured) / measured, in %; positive is an over-estimate."""
    return 100.0 * (estimate_bytes - measured_bytes) / max(measured_bytes, 1)


def within_goal(error_pct: float, device: str) -> bool:
    """Issue 2's goals: CPU +-3 %; GPU at most 6 % over and 2 % under."""
    if device == "cpu":
        return abs(error_pct) <= CPU_GOAL_PCT
    return -GPU_UNDER_PCT <= error_pct <= GPU_OVER_PCT


def goal_text(device: str) -> str:
    if device == "cpu":
        return f"within {CPU_GOAL_PCT:g} %"
    return f"at most {GPU_OVER_PCT:g} % over and {GPU_UNDER_PCT:g} % under"


def compare(estimate, measurement: Measurement) -> tuple[Row, ...]:
    """Rows for every figure the run measured."""
    pairs = [("peak allocated", estimate.peak_allocated, measurement.max_allocated)]
    if measurement.device == "cuda":
        pairs.append(("peak reserved", estimate.peak_reserved, measurement.max_reserved))
        if measurement.nvml_process_peak is not None:
            pairs.append(("device total (NVML)", estimate.device_total, measurement.nvml_process_peak))
    return tuple(Row(name=name, estimate_bytes=int(est), measured_bytes=int(got),
                     within_goal=within_goal(error_pct(est, got), measurement.device)) for name, est, got in pairs)


# --- the parent: is there room, then estimate, spawn the measurement, compare ------------------
@dataclass(frozen=True, kw_only=True)
class Room:
    """The estimate against the memory free where the steps will run, read before running them."""

    where: str
    """"this host" or "GPU 0 (<name>)"."""
    needed_bytes: int
    """What the estimate says the steps need there."""
    needed_what: str
    """Which figure of the estimate that is."""
    available_bytes: int
    """Free there now."""
    available_what: str
    """How that was read."""

    @property
    def short_bytes(self) -> int:
        """By how much the estimate exceeds what is free (0 when it fits)."""
        return max(0, self.needed_bytes - self.available_bytes)

    def describe(self) -> str:
        from memplan.units import format_bytes

        verdict = f"{format_bytes(self.short_bytes)} short" if self.short_bytes else "fits"
        return (f"{self.where}: estimated {format_bytes(self.needed_bytes)} ({self.needed_what}), "
                f"{format_bytes(self.available_bytes)} available ({self.available_what}): {verdict}")

    def to_dict(self) -> dict:
        return {**self.__dict__, "short_bytes": self.short_bytes}


def rooms_for(estimate, device: str) -> tuple[tuple[Room, ...], tuple[str, ...]]:
    """The host (and, on a GPU, cuda:0's device) against the estimate; and notes on what could not be read.

    On CPU the steps' tensors live in host RAM: the estimate's peak allocation. On a GPU the estimate's
    device total (CUDA context included) goes to the GPU, and the host first holds the model as built,
    in float32, before it moves (4 bytes a parameter)."""
    from memplan import hardware

    host = hardware.host_info()
    capped = " within the cgroup's limit" if host.cgroup_limit_bytes is not None else ""
    host_need = (estimate.peak_allocated, "peak allocated") if device == "cpu" else \
        (4 * estimate.num_parameters, "the model's float32 weights, built on the host")
    rooms = [Room(where="this host", needed_bytes=int(host_need[0]), needed_what=host_need[1],
                  available_bytes=host.budget_bytes, available_what=f"RAM available{capped}")]
    notes = []
    if device != "cpu":
        gpu = hardware.gpu_for_cuda_index(0)
        if gpu is None or gpu.free_bytes is None:
            reason = hardware.nvml_unavailable_reason() or "NVML cannot read cuda:0's memory"
            notes.append(f"GPU memory not checked before running: {reason}")
        else:
            rooms.append(Room(where=f"GPU {gpu.index} ({gpu.name})", needed_bytes=int(estimate.device_total),
                              needed_what="device total, CUDA context included", available_bytes=gpu.free_bytes,
                              available_what="free, NVML"))
    return tuple(rooms), tuple(notes)


def check_room(estimate, device: str, *, force: bool, stream=None) -> tuple[Room, ...] | None:
    """The rooms, when the steps may run; None, having said why on `stream` (stderr), when the estimate
    says they cannot fit and `force` is off."""
    stream = stream or sys.stderr
    rooms, notes = rooms_for(estimate, device)
    for note in notes:
        print(f"memplan: {note}", file=stream)
    short = [room for room in rooms if room.short_bytes]
    if not short:
        return rooms
    for room in short:
        print(f"memplan: {room.describe()}", file=stream)
    if force:
        print("memplan: running anyway (--force)", file=stream)
        return rooms
    print("memplan: validate refuses to run steps its estimate says cannot fit; use a smaller --batch-size, "
          "--checkpointing or a lower --precision, free memory, or pass --force to run anyway", file=stream)
    return None


def measure_in_subprocess(setting: Setting) -> Measurement:
    """Run the steps in a fresh `python -m memplan.commands.validate --measure` and read its result line."""
    cmd = [sys.executable, "-m", "memplan.commands.validate", "--measure", *setting.argv()]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(MEASURE_MARKER)]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"the measurement process failed (exit {done.returncode}): {' '.join(cmd)}\n{tail}")
    return Measurement(**json.loads(lines[-1][len(MEASURE_MARKER):]))


def estimate_for(loaded, setting: Setting, device: str):
    """The estimate the run is held to: CPU, or the local GPU."""
    return loaded.estimate(setting.batch_size, precision=setting.precision,
                           checkpointing=setting.checkpointing, device="cpu" if device == "cpu" else None)


def calibration_from(measurement: Measurement):
    """The Calibration a GPU run gives, or None (CPU, or NVML could not see the process)."""
    from memplan.estimator.calibration import Calibration, CalibrationKey

    if measurement.device != "cuda" or measurement.nvml_process_peak is None or measurement.gpu is None:
        return None
    context = max(measurement.nvml_process_peak - measurement.max_reserved, 0)
    overhead = max(measurement.max_reserved / max(measurement.max_allocated, 1), 1.0)
    return Calibration(key=CalibrationKey(**measurement.gpu["key"]),
                       compute_capability=tuple(measurement.gpu["compute_capability"]),
                       context_bytes=int(context), allocator_overhead=overhead)


def report_lines(rows: Sequence[Row], device: str) -> list[str]:
    """The comparison as printed, one line per figure, then one verdict line."""
    from memplan.units import format_bytes

    lines = [f"{'':22}{'estimate':>14}{'measured':>14}{'error':>9}"]
    for r in rows:
        flag = "" if r.within_goal else "   <-- OUTSIDE GOAL"
        lines.append(f"{r.name:22}{format_bytes(r.estimate_bytes):>14}{format_bytes(r.measured_bytes):>14}"
                     f"{r.error_pct:>+8.2f}%{flag}")
    bad = [r for r in rows if not r.within_goal]
    if bad:
        worst = max(bad, key=lambda r: abs(r.error_pct))
        lines.append(f"VALIDATION FAILED: {len(bad)} of {len(rows)} figures outside the goal on {device} "
                     f"({goal_text(device)}); worst: {worst.name} {worst.error_pct:+.2f}%")
    else:
        lines.append(f"validation passed: every figure {goal_text(device)} on {device}")
    return lines


# --- the child: run the steps, print one result line -------------------------------------------
def _measure(setting: Setting) -> Measurement:
    import torch

    from memplan.config import load_config
    from memplan.truth import measure_cpu_peak, measure_cuda_peak
    from memplan.estimator.step import map_tensors

    loaded = load_config(setting.config)
    batch = loaded.example_batch(setting.batch_size)  # the data module is built outside the measurement

    def make_batch():  # a fresh copy, so the batch's bytes are allocated inside the measurement
        return map_tensors(batch, lambda t: t.clone())

    kwargs = dict(optimizer=loaded.optimizer, precision=setting.precision,
                  checkpointing=setting.checkpointing, steps=setting.steps)
    if not torch.cuda.is_available():
        return Measurement(device="cpu", max_allocated=measure_cpu_peak(loaded.build_model, make_batch, **kwargs))
    from memplan.estimator.calibration import current_key

    got = measure_cuda_peak(loaded.build_model, make_batch, **kwargs)
    key = current_key()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    gpu = None if key is None else {"key": key.__dict__, "compute_capability": [props.major, props.minor]}
    return Measurement(device="cuda", max_allocated=got.max_allocated, max_reserved=got.max_reserved,
                       nvml_process_peak=got.nvml_process_peak, gpu=gpu)


def _child_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memplan.commands.validate",
                                description="internal: measure one setting and print one JSON line")
    p.add_argument("--measure", action="store_true", required=True)
    p.add_argument("config")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--precision", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--checkpointing", action="store_true")
    args = p.parse_args(argv)
    setting = Setting(config=args.config, batch_size=args.batch_size, precision=args.precision,
                      checkpointing=args.checkpointing, steps=args.steps)
    print(MEASURE_MARKER + json.dumps(_measure(setting).__dict__), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
