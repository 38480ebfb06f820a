"""A few real training steps at one setting, measured in a fresh process (`python -m
memplan.commands.measurement --measure ...`) so that the caching allocator and the CUDA context start clean:
`memplan validate` holds its estimate to what this reads.

On a GPU it reads torch's max_memory_allocated / reserved and NVML's per-process peak
(memplan.truth.measure_cuda_peak); on CPU the profiler's peak allocation (measure_cpu_peak).
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


def measure_in_subprocess(setting: Setting) -> Measurement:
    """Run the steps in a fresh `python -m memplan.commands.measurement --measure` and read its result line."""
    cmd = [sys.executable, "-m", "memplan.commands.measurement", "--measure", *setting.argv()]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(MEASURE_MARKER)]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"the measurement process failed (exit {done.returncode}): {' '.join(cmd)}\n{tail}")
    return Measurement(**json.loads(lines[-1][len(MEASURE_MARKER):]))


# --- the child: run the steps, print one result line -------------------------------------------
def _measure(setting: Setting) -> Measurement:
    import torch

    from memplan.commands.loading import load_config_for_command
    from memplan.truth import measure_cpu_peak, measure_cuda_peak
    from memplan.batching import map_tensors

    loaded = load_config_for_command(setting.config, quiet=True)  # (validate said its deprecations)
    batch = loaded.example_batch(setting.batch_size)  # the data module is built outside the measurement

    def make_batch():  # a fresh copy, so the batch's bytes are allocated inside the measurement
        return map_tensors(batch, lambda t: t.clone())

    kwargs = dict(optimizer=loaded.optimizer, precision=setting.precision,
                  checkpointing=setting.checkpointing, steps=setting.steps)
    if not torch.cuda.is_available():
        return Measurement(device="cpu", max_allocated=measure_cpu_peak(loaded.build_model, make_batch, **kwargs))
    from memplan.estimator.calibration import current_key
    from memplan.hardware.readings import cuda_device_facts

    got = measure_cuda_peak(loaded.build_model, make_batch, **kwargs)
    key = current_key()
    facts = cuda_device_facts()
    gpu = None if key is None else {"key": key.__dict__, "compute_capability": list(facts.compute_capability)}
    return Measurement(device="cuda", max_allocated=got.max_allocated, max_reserved=got.max_reserved,
                       nvml_process_peak=got.nvml_process_peak, gpu=gpu)


def _child_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memplan.commands.measurement",
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
