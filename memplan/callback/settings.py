"""MemoryPlanner's settings: what the user chose, frozen and checked once, at construction."""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from memplan.callback.exactness import declared_reduction
from memplan.callback.loss_reduction import LossReduction
from memplan.plan import Plan
from memplan.shapes import SCAN_BATCHES


@dataclass(frozen=True, kw_only=True)
class PlannerSettings:
    """MemoryPlanner's constructor arguments (see its docstring for each); a ValueError naming the
    argument and what it accepts for a bad one. Never changed during or between fits: what a fit
    decides (manual optimization declining adjustment, say) lives in its FitSession."""

    plan: Plan | str | os.PathLike | None = None
    """A Plan, or a plan JSON file; None plans at fit start from an estimate."""
    global_batch_size: int | None = None
    """Samples per optimizer step to keep when planning at fit start; None: the Trainer's."""
    every_n_steps: int | None = None
    """Optimizer steps between readings and shared decisions; None: the Trainer's log_every_n_steps."""
    margin: float = 0.05
    """Fraction of each device's memory to keep free."""
    adjust: bool = True
    """Adjust during training and retry OOMs; False only applies and watches."""
    grow: bool = True
    """Grow back toward the planned micro-batch when headroom has lasted."""
    grow_margin: float = 0.25
    """Fraction of memory every rank must have free for growth."""
    grow_patience: int = 5
    """Checks in a row with grow_margin free before growing."""
    guard: Literal["auto", "always"] = "auto"
    """Which backwards run where an OOM can be retried."""
    allow_checkpointing: bool = True
    """Whether activation checkpointing may be turned on."""
    strict: bool = False
    """Refuse to change the user's settings instead of warning."""
    batch_arg_name: str = "batch_size"
    """The attribute holding the train loader's batch size."""
    log_dir: str | os.PathLike | None = None
    """Folder of the per-rank logs; None: <trainer.log_dir>/memplan."""
    planner: Callable[..., Plan] | None = None
    """callable(PlanRequest, estimator) -> Plan for planning at fit start; None: memplan's."""
    loss_reduction: Literal["auto", "mean", "sum"] = "auto"
    """How training_step's loss reduces over the batch: recognised ('auto') or declared."""
    mean_over: Callable[[Any], Any] | None = None
    """callable(batch) -> what a mean loss averages over, where not samples."""
    exact: bool = True
    """Only make changes that train exactly as the user's settings would."""
    scan_batches: int = SCAN_BATCHES
    """Batches read at fit start to plan for the heaviest; 0: the first."""
    max_shape: Mapping[str | int, Sequence[int]] | None = None
    """Per-sample shapes to plan for, by the batch's field; None: found (memplan.shapes)."""
    plan_margin: float | None = None
    """Fraction of each device's memory a plan keeps free (at fit start, and in `memplan suggest`); None:
    twice margin, at most 0.5."""
    suggest: Mapping[str, Any] | None = None
    """What only `memplan suggest` reads, planning before a Trainer exists (precisions, batch_spec, optimizer,
    num_workers, prefetch_factor, pin_memory: memplan.config.placement); training ignores it."""

    def __post_init__(self) -> None:
        if self.plan is not None and not isinstance(self.plan, (Plan, str, os.PathLike)):
            raise ValueError(f"MemoryPlanner(plan=...) must be a memplan Plan or a plan file path; got "
                             f"{type(self.plan).__name__}")
        for name in ("global_batch_size", "every_n_steps"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise ValueError(f"MemoryPlanner({name}=...) must be a positive int or None; got {value!r}")
        for name in ("margin", "grow_margin"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), (int, float)):
                raise ValueError(f"MemoryPlanner({name}=...) is a fraction of device memory, a number; got "
                                 f"{getattr(self, name)!r}")
        if self.log_dir is not None and not isinstance(self.log_dir, (str, os.PathLike)):
            raise ValueError(f"MemoryPlanner(log_dir=...) must be a folder path (str or os.PathLike) or None for "
                             f"<trainer.log_dir>/memplan; got {self.log_dir!r}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"MemoryPlanner(margin=...) is a fraction of device memory in [0, 1); got {self.margin!r}")
        if self.grow and not self.margin < self.grow_margin <= 1.0:
            raise ValueError(f"MemoryPlanner(grow_margin=...) must be in (margin, 1] = ({self.margin}, 1]; got "
                             f"{self.grow_margin!r}")
        if not _positive_int(self.grow_patience):
            raise ValueError(f"MemoryPlanner(grow_patience=...) must be a positive int; got {self.grow_patience!r}")
        if self.guard not in ("auto", "always"):
            raise ValueError(f"MemoryPlanner(guard=...) must be 'auto' or 'always'; got {self.guard!r}")
        if self.planner is not None and not callable(self.planner):
            raise ValueError(f"MemoryPlanner(planner=...) must be callable(PlanRequest, estimator) -> Plan; got "
                             f"{self.planner!r}")
        self._check_loss()
        if self.plan_margin is not None and (isinstance(self.plan_margin, bool) or not isinstance(
                self.plan_margin, (int, float)) or not 0.0 <= self.plan_margin < 1.0):
            raise ValueError(f"MemoryPlanner(plan_margin=...) is a fraction of device memory in [0, 1), or None for "
                             f"twice margin; got {self.plan_margin!r}")
        if self.suggest is not None:
            from memplan.config.placement import check_suggest

            try:
                check_suggest(self.suggest)
            except ValueError as err:
                raise ValueError(f"MemoryPlanner(suggest=...): {err}") from None
        for name in ("adjust", "grow", "allow_checkpointing", "strict", "exact"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MemoryPlanner({name}=...) must be True or False; got {getattr(self, name)!r}")
        if self.max_shape is not None and not (
                isinstance(self.max_shape, Mapping) and self.max_shape
                and all(isinstance(k, (str, int)) and isinstance(v, Sequence) and not isinstance(v, str)
                        and all(_positive_int(n) for n in v) for k, v in self.max_shape.items())):
            raise ValueError("MemoryPlanner(max_shape=...) maps a batch field to the per-sample shape to plan for, "
                             f"e.g. {{'input_ids': (2048,), 'labels': (2048,)}}; got {self.max_shape!r}")
        if not isinstance(self.scan_batches, int) or isinstance(self.scan_batches, bool) or self.scan_batches < 0:
            raise ValueError(f"MemoryPlanner(scan_batches=...) must be an int >= 0 (0: plan from the first batch); "
                             f"got {self.scan_batches!r}")

    def _check_loss(self) -> None:
        if self.loss_reduction not in ("auto", "mean", "sum"):
            raise ValueError(f"MemoryPlanner(loss_reduction=...) must be 'auto' (recognise it from the training "
                             f"step), 'mean' or 'sum' (how training_step's loss reduces over the batch's samples); got "
                             f"{self.loss_reduction!r}")
        if self.mean_over is not None and not callable(self.mean_over):
            raise ValueError(f"MemoryPlanner(mean_over=...) must be callable(batch) -> number, e.g. "
                             f"lambda b: (b['labels'][:, 1:] != -100).sum(); got {self.mean_over!r}")
        if self.mean_over is not None and self.loss_reduction == "sum":
            raise ValueError("MemoryPlanner(mean_over=...) says what a mean loss averages over; with "
                             "loss_reduction='sum' leave it None")

    @property
    def planning_margin(self) -> float:
        """The fraction of memory a plan made at fit start keeps free: plan_margin, else twice margin (at most
        0.5), so that a plan that fits is not lowered at once."""
        return self.plan_margin if self.plan_margin is not None else min(0.5, 2 * self.margin)

    @property
    def declared(self) -> LossReduction | None:
        """The loss's reduction as the user declared it (loss_reduction=, mean_over=); None for 'auto'."""
        return declared_reduction(self.loss_reduction, self.mean_over)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
