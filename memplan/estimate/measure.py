"""Measure the real peak of training steps on this machine's CPU, the truth estimates are held to.

Truth is the peak of the CPU allocator's "Total Allocated" as torch.profiler reports it
(profile_memory=True): every allocation from the moment profiling starts, kernel-internal ones
included. Profiling starts before the model is built, so parameters, batch, optimizer state and two
full steps are all inside it.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from memplan.estimate.checkpointing import apply_checkpointing
from memplan.estimate.inputs import resolve_loss, resolve_optimizer
from memplan.estimate.step import PrecisionPolicy, run_training_step


def measure_cpu_peak(
    build: Callable[[], nn.Module],
    make_batch: Callable[[], Any],
    *,
    loss=None,
    optimizer=None,
    precision: str = "32-true",
    checkpointing: bool | Collection[type[nn.Module]] = False,
    steps: int = 2,
) -> int:
    """Peak "Total Allocated" bytes over building the model and batch and `steps` real training steps."""
    policy = PrecisionPolicy.from_string(precision)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build().train()
        if policy.param_dtype != torch.float32:
            model = model.to(policy.param_dtype)
        if checkpointing:
            apply_checkpointing(model, checkpointing)
        batch = policy.convert_batch(make_batch())
        opt = resolve_optimizer(model, optimizer)
        loss_fn = resolve_loss(model, loss)
        grad_scale = torch.tensor(65536.0) if policy.grad_scaling else None
        for _ in range(steps):
            run_training_step(model, batch, loss_fn=loss_fn, optimizer=opt, policy=policy,
                              device_type="cpu", grad_scale=grad_scale)
    return peak_total_allocated(prof)


def peak_total_allocated(prof: profile) -> int:
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
