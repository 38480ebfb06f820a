"""estimate()'s arguments, checked, as one trace takes them (besides the model, batch, loss and optimizer)."""
from __future__ import annotations

from dataclasses import dataclass

from memplan.estimator.checkpointing import CheckpointArg
from memplan.estimator.fsdp import FsdpSettings
from memplan.estimator.step import Loop, PrecisionPolicy
from memplan.estimator.target import Target
from memplan.estimator.values import DataDependent


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
