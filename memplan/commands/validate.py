"""Hold an estimate to a real run: a few training steps at the planned setting on this machine.

Before anything runs, the estimate is held to the memory free where the steps will run (`check_room`):
the host's RAM (psutil's `available`, within the cgroup's limit) and, on a GPU, the device's free memory
(NVML). A setting the estimate says cannot fit is refused with the figures; `--force` runs it anyway.

The measurement runs in a fresh process (memplan.commands.measurement) so that the
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
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from memplan.commands import args as arg
from memplan.commands.measurement import Measurement, Setting, measure_in_subprocess
from memplan.plan import MAX_BATCH_SIZE

MAX_VALIDATE_STEPS = 1000
"""`validate --steps` at most: it compares an estimate with a few real steps, not a training run."""
CPU_GOAL_PCT = 3.0
"""Worst error allowed on CPU, either way."""
GPU_OVER_PCT, GPU_UNDER_PCT = 6.0, 2.0
"""Worst over- and under-estimate allowed on a GPU."""


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


# --- the command: `memplan validate` -----------------------------------------------------------
def add_parser(subparsers) -> None:
    p = subparsers.add_parser("validate", help="run real training steps on this machine and compare with the estimate")
    p.add_argument("config", help="a LightningCLI config (model: / data: / trainer:)")
    p.add_argument("--batch-size", type=arg.positive_int("--batch-size", "samples per device", MAX_BATCH_SIZE), default=None,
                   help="micro-batch size per device (default: the plan's, else the config's data batch size)")
    p.add_argument("--plan", default=None, help="a plan file from memplan suggest --output (*.plan.json): "
                   "its micro-batch, precision and checkpointing")
    p.add_argument("--precision", type=arg.precision("--precision"), default=None, help="Lightning precision or "
                   "alias (default: the plan's, "
                   "else the config's trainer.precision, else 32-true)")
    p.add_argument("--checkpointing", action="store_true", help="checkpoint each repeated block")
    p.add_argument("--steps", type=arg.positive_int("--steps", "real training steps", MAX_VALIDATE_STEPS), default=2,
                   help=f"real training steps to run, 1 to {MAX_VALIDATE_STEPS} (default 2)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON (bytes as ints)")
    p.add_argument("--force", action="store_true", help="run even when the estimate exceeds the memory free "
                   "on this host (or GPU); without it validate refuses, with the figures")
    p.set_defaults(run=run)


def _read_plan(path: str):
    """The plan file of `validate --plan`, every failure a ValueError naming the flag and the file."""
    from memplan.files import PLAN_MAX_BYTES, FileTooLarge, NotAFile, read_bounded
    from memplan.plan import Plan

    try:
        data = json.loads(read_bounded(path, limit_bytes=PLAN_MAX_BYTES, name="--plan").decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--plan {path}: no such file; write one with "
                         "`memplan suggest ... --output planned.yaml`") from None
    except (NotAFile, FileTooLarge) as err:
        raise ValueError(str(err)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--plan {path}: cannot read it ({getattr(err, 'strerror', None) or err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--plan {path} is not JSON ({err}); pass the *.plan.json `memplan suggest` wrote") from None
    try:
        return Plan.from_dict(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--plan {path}: {err}") from None


def run(args: argparse.Namespace) -> int:
    import torch

    from memplan.estimator.calibration import calibration_path, save_calibration
    from memplan.commands.loading import load_config_for_command

    if args.plan and args.batch_size is not None:
        return arg.usage_error("pass --batch-size or --plan, not both")
    try:
        loaded = load_config_for_command(args.config)
        plan = _read_plan(args.plan) if args.plan else None
        wrong_model = loaded.plan_mismatch(plan, plan_name=f"--plan {args.plan}") if plan else None
        if wrong_model is not None:
            return arg.usage_error(wrong_model)
        batch_size = plan.micro_batch_size if plan else args.batch_size or loaded.data_batch_size
        if batch_size is None:
            return arg.usage_error("the config has no data batch size; pass --batch-size N or --plan FILE")
        setting = Setting(
            config=args.config, batch_size=batch_size, steps=args.steps,
            precision=args.precision or (plan.precision if plan else None) or loaded.trainer_precision or "32-true",
            checkpointing=args.checkpointing or bool(plan and plan.gradient_checkpointing),
        )
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if plan is not None and (plan.gpu_name == "cpu") != (device == "cpu"):
            print(f"memplan: note: --plan {args.plan} was made for {plan.world_size} x {plan.gpu_name}; validate runs "
                  f"its micro-batch in one process on {device} here: it checks the estimate on {device}, not that "
                  f"the plan fits {plan.gpu_name}", file=sys.stderr)
        est = estimate_for(loaded, setting, device)
    except (OSError, ValueError) as err:  # ConfigError and EstimateError are ValueErrors naming the field
        return arg.usage_error(str(err))
    rooms = check_room(est, device, force=args.force)
    if rooms is None:
        return arg.EXIT_ERROR
    try:
        measured = measure_in_subprocess(setting)
    except RuntimeError as err:
        print(f"memplan: {err}", file=sys.stderr)
        return arg.EXIT_ERROR
    rows = compare(est, measured)
    calibration = calibration_from(measured)
    saved = save_calibration(calibration, calibration_path()) if calibration is not None else None
    if measured.device == "cpu":
        calib_line = "CPU run: no CUDA context to calibrate; nothing saved"
    elif saved is None:
        calib_line = "GPU run, but NVML could not see this process: no calibration saved"
    else:
        calib_line = (f"saved calibration to {saved}: CUDA context {calibration.context_bytes} bytes, "
                      f"allocator overhead {calibration.allocator_overhead:.4f} ({calibration.key.as_str()})")
    failed = any(not r.within_goal for r in rows)
    if args.json:
        print(json.dumps({"setting": setting.__dict__, "device": measured.device, "estimate": est.to_dict(),
                          "measurement": measured.__dict__,
                          "rows": [dict(r.__dict__, error_pct=r.error_pct) for r in rows],
                          "within_goal": not failed, "room": [room.to_dict() for room in rooms],
                          "calibration": calibration.to_dict() if calibration else None}, indent=2))
    else:
        print(f"validate {args.config}: batch {setting.batch_size}, {setting.precision}, checkpointing "
              f"{'on' if setting.checkpointing else 'off'}, {setting.steps} steps on {measured.device}")
        print("\n".join(report_lines(rows, measured.device)))
        print(calib_line)
    if failed:  # the loud line goes to stderr too, so --json and pipes still show it
        print("memplan: " + report_lines(rows, measured.device)[-1], file=sys.stderr)
        return arg.EXIT_ERROR
    return arg.EXIT_OK
