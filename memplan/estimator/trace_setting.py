"""estimate()'s arguments, checked, as one trace takes them (besides the model, batch, loss and optimizer)."""
from __future__ import annotations

from dataclasses import dataclass

from memplan.estimator.checkpointing import CheckpointArg
from memplan.estimator.determinism import Deterministic
from memplan.estimator.errors import EstimateError
from memplan.estimator.fsdp import FsdpSettings
from memplan.estimator.step import Loop, PrecisionPolicy
from memplan.estimator.target import Target
from memplan.estimator.values import DataDependent

STRATEGIES = (None, "ddp", "fsdp")
"""estimate()'s strategies: one process, DDP, FSDP2."""


def check_strategy(strategy: str | None, world_size: int) -> None:
    """Refuse a strategy estimate() does not know, or a world size it cannot have."""
    if strategy not in STRATEGIES:
        raise EstimateError(f"strategy must be None, 'ddp' or 'fsdp'; got {strategy!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise EstimateError(f"world_size must be a positive int; got {world_size!r}")
    if world_size > 1 and strategy is None:
        raise EstimateError(f"world_size={world_size} needs strategy='ddp' or 'fsdp'")


@dataclass(frozen=True, kw_only=True)
class TraceSetting:
    """How estimate() traces the step."""

    policy: PrecisionPolicy
    """The precision the step runs in (the one Lightning runs on the target)."""
    checkpointing: CheckpointArg
    """estimate()'s checkpointing argument (False for none)."""
    target: Target
    """What the estimate is for: CPU, or a CUDA GPU."""
    strategy: str | None
    """None, "ddp" or "fsdp"."""
    loop: Loop
    """The step order: "lightning" or "torch"."""
    data_dependent: DataDependent
    """How shapes decided by activation values are resolved."""
    fsdp: FsdpSettings | None = None
    """FSDP's settings (strategy "fsdp" only)."""
    world_size: int = 1
    """Ranks the step is one of."""
    deterministic: Deterministic = False
    """Whether the step runs with deterministic algorithms: True, "warn" (warn-only) or False (estimator/
    determinism.py); the CUDA rules that depend on it read it here, never torch's flags in the tracing process."""
