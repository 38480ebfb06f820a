"""The plan: how to run a training job so that it fits. Produced by the planner, written to configs,
applied by the MemoryPlanner callback. Frozen; bytes as ints."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from memplan.estimator.result import PRECISIONS, Precision

PLAN_FORMAT = 1
"""Version of the plan file layout (`Plan.to_dict()`)."""


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """One candidate the planner weighed."""

    world_size: int
    """Data-parallel ranks (nodes x GPUs per node)."""
    micro_batch_size: int
    """Samples per GPU per forward/backward."""
    accumulate_grad_batches: int
    """Micro-batches per optimizer step."""
    precision: Precision
    """Lightning precision string."""
    gradient_checkpointing: bool
    """Whether repeated blocks are checkpointed."""
    predicted_peak_bytes: int
    """Predicted per-GPU device total (what NVML would show)."""
    relative_speed: float
    """Predicted throughput relative to the winner (1.0 = the winner)."""
    fits: bool
    """Whether it fits the device budget and host RAM."""
    why_not: str | None = None
    """Why it lost or does not fit, in words."""
    strategy: str = "ddp"
    """The data-parallel layout in words: 'ddp', 'single', or 'fsdp FULL_SHARD' (+ ' offload')."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How to run: per-GPU micro-batch, world size, precision, checkpointing, accumulation."""

    gpu_name: str
    """GPU model planned for (the smallest free budget among the chosen GPUs)."""
    gpus: tuple[int, ...]
    """CUDA indices of the chosen local GPUs (empty when planning off-box)."""
    nodes: int
    """Number of nodes."""
    world_size: int
    """Total data-parallel ranks: nodes x GPUs per node."""
    micro_batch_size: int
    """Samples per GPU per forward/backward."""
    accumulate_grad_batches: int
    """Micro-batches per optimizer step."""
    global_batch_size: int
    """micro_batch_size x world_size x accumulate_grad_batches: the user's batch, kept."""
    precision: Precision
    """Lightning precision string, ready for Trainer(precision=...)."""
    gradient_checkpointing: bool
    """Checkpoint each repeated block."""
    strategy: Literal["ddp", "fsdp", "auto"]
    """Lightning strategy: 'ddp' or 'fsdp' for more than one rank, else 'auto'."""
    predicted_peak_bytes: int
    """Predicted per-GPU device total (peak reserved + CUDA context + NCCL)."""
    device_budget_bytes: int
    """Usable per-GPU bytes: free memory less the safety margin."""
    host_bytes_per_rank: int
    """Predicted host RAM per rank (process runtime, model copy at init, loader workers, pinned buffers)."""
    relative_speed: float = 1.0
    """Predicted throughput relative to the best alternative (the winner is 1.0)."""
    reasons: tuple[str, ...] = ()
    """Why this plan won, in words."""
    alternatives: tuple[Alternative, ...] = field(default_factory=tuple)
    """The next-best candidates, best first."""
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"] | None = None
    """FSDP's sharding strategy when strategy is 'fsdp' (HYBRID_SHARD: sharded within a node)."""
    cpu_offload: bool = False
    """FSDP keeps parameters, gradients and optimizer state in host memory."""
    block_classes: tuple[str, ...] = ()
    """Import paths of the repeated block classes FSDP wraps (its auto_wrap_policy)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"Plan.precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        for name in ("nodes", "world_size", "micro_batch_size", "accumulate_grad_batches", "global_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Plan.{name} must be a positive int; got {value!r}")
        product = self.micro_batch_size * self.world_size * self.accumulate_grad_batches
        if product != self.global_batch_size:
            raise ValueError(
                f"Plan.global_batch_size must equal micro_batch_size x world_size x accumulate_grad_batches "
                f"({self.micro_batch_size} x {self.world_size} x {self.accumulate_grad_batches} = {product}); "
                f"got {self.global_batch_size}"
            )
        if self.strategy == "fsdp" and self.sharding_strategy is None:
            raise ValueError("Plan.sharding_strategy must be FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD when "
                             "strategy is 'fsdp'")
        if self.world_size % self.nodes:
            raise ValueError(f"Plan.world_size ({self.world_size}) must be a multiple of nodes ({self.nodes})")

    @property
    def gpus_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def headroom_bytes(self) -> int:
        """Budget left above the predicted peak (negative: does not fit)."""
        return self.device_budget_bytes - self.predicted_peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-ready; bytes stay ints."""
        out = dataclasses.asdict(self)
        out["format"] = PLAN_FORMAT
        out["gpus"] = list(self.gpus)
        out["reasons"] = list(self.reasons)
        out["block_classes"] = list(self.block_classes)
        out["headroom_bytes"] = self.headroom_bytes
        out["alternatives"] = [dataclasses.asdict(a) for a in self.alternatives]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of to_dict (for plan files); unknown keys are refused by name."""
        data = dict(data)
        fmt = data.pop("format", PLAN_FORMAT)
        if fmt != PLAN_FORMAT:
            raise ValueError(f"plan file format {fmt} is not supported (this memplan reads {PLAN_FORMAT}); re-run memplan suggest")
        data.pop("headroom_bytes", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"plan file has unknown keys {unknown}; re-run memplan suggest with this memplan version")
        data["gpus"] = tuple(data.get("gpus", ()))
        data["reasons"] = tuple(data.get("reasons", ()))
        data["block_classes"] = tuple(data.get("block_classes", ()))
        data["alternatives"] = tuple(Alternative(**a) for a in data.get("alternatives", ()))
        return cls(**data)
