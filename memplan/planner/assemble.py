"""The planning request, assembled once for `memplan suggest` and MemoryPlanner alike: request_for().

Both sides hand over what they know in the same form (the model, one batch as training_step receives it,
what the user asks and allows, the GPUs of one node, the host); the model's own facts (its repeated
blocks, what it checkpoints itself, its parameter and optimizer-state bytes), the batch's tokens per
sample and the host load per rank are read here, the same way for both. Pure: no Lightning import.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memplan.planner.reasons import Words
from memplan.planner.request import SEARCHED_PRECISIONS, STRATEGIES, DeviceBudget, HostLoad, PlanRequest

_MODEL_CHECKPOINTS = object()
"""Asked.checkpointable's default: the model can be checkpointed when it has repeated blocks to wrap."""


@dataclass(frozen=True, kw_only=True)
class Asked:
    """What the user asks of the plan and allows it to change: from the command line and the config
    (suggest), or from the Trainer and MemoryPlanner's arguments (the callback)."""

    global_batch_size: int
    """Samples per optimizer step over all ranks, kept exactly."""
    precisions: tuple[str, ...] = SEARCHED_PRECISIONS
    """Precisions the planner may choose among (the callback: the Trainer's one)."""
    allow_checkpointing: bool = True
    """Whether the user allows activation checkpointing."""
    checkpointable: Any = _MODEL_CHECKPOINTS
    """Whether the model can be checkpointed at all (True / False, as the caller found: MemoryPlanner also
    counts a model's own checkpointing switch); by default, whether it has repeated blocks."""
    margin: float = 0.10
    """Fraction of each GPU's free memory (and of the host's available RAM) left unused."""
    strategies: tuple[str, ...] = STRATEGIES
    """Data-parallel strategies the planner may choose among."""
    allow_cpu_offload: bool = True
    """Whether FSDP with CPU offload may be chosen."""
    all_devices: bool = False
    """Use every GPU given (the callback: the Trainer's world size is fixed)."""
    words: Words = field(default_factory=Words)
    """How the user names these settings (flags and YAML keys, or MemoryPlanner's arguments), for the plan's
    account and NoFit."""


@dataclass(frozen=True, kw_only=True)
class HostSide:
    """The host each node's ranks share, and what its DataLoader costs each rank."""

    available_bytes: int | None
    """Host RAM available per node; None: no host-RAM limit (planning for other machines)."""
    sample_bytes: int
    """Bytes of one sample of the batch, as the DataLoader yields it."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead."""
    pin_memory: bool = False
    """Whether the DataLoader pins its batches."""


def request_for(model: Any, batch: Any, *, asked: Asked, devices: Sequence[DeviceBudget], nodes: int = 1,
                host: HostSide | None = None, optimizer: Any = None) -> PlanRequest:
    """The PlanRequest for `model` (a fake skeleton or the user's module: nothing is allocated or run but
    an optimizer's state probe) trained on `batch` (one batch; its first dimension the samples) with
    `optimizer` (as memplan.estimate takes it: None for the model's configure_optimizers)."""
    from memplan.estimator.optimizer_state import elementwise_state_bytes
    from memplan.planner.tracing import model_facts, tokens_per_sample

    checkpointable = asked.checkpointable
    facts = model_facts(model, allow_checkpointing=asked.allow_checkpointing)
    if checkpointable is _MODEL_CHECKPOINTS:
        checkpointable = facts["repeated_blocks"] > 0
    facts["allow_checkpointing"] = facts["allow_checkpointing"] and bool(checkpointable)
    facts["checkpointable"] = bool(checkpointable)
    if facts["parameter_count"] is None and tuple(asked.strategies) == ("fsdp",):  # FSDP is the Trainer's: searched
        facts["parameter_count"] = sum(p.numel() for p in model.parameters()) or None
    host_load = None if host is None else HostLoad(
        model_init_bytes=facts["parameter_bytes"], sample_bytes=host.sample_bytes, num_workers=host.num_workers,
        prefetch_factor=host.prefetch_factor, pin_memory=host.pin_memory)
    return PlanRequest(
        global_batch_size=asked.global_batch_size, devices=tuple(devices), nodes=nodes,
        host_available_bytes=None if host is None else host.available_bytes, host_load=host_load,
        precisions=tuple(asked.precisions), margin=asked.margin, strategies=tuple(asked.strategies),
        allow_cpu_offload=asked.allow_cpu_offload, all_devices=asked.all_devices, words=asked.words,
        optimizer_state_bytes=elementwise_state_bytes(model, optimizer), tokens_per_sample=tokens_per_sample(batch),
        **facts,
    )
