"""The training step of a LightningModule that optimizes manually (`automatic_optimization = False`:
GANs, several optimizers), traced as the user wrote it.

Such a training_step runs its own forwards, `self.manual_backward(...)`, `opt.step()` and
`opt.zero_grad()`, reaching the Trainer through `self.optimizers()`, `self.lr_schedulers()`,
`self.toggle_optimizer(...)` and `self.trainer`. The fake copy the estimate traces has no Trainer, so
it gets a stand-in (`StandInTrainer`): the optimizers and schedulers of its `configure_optimizers()`,
a strategy whose `backward` is Lightning's (the GradScaler's scale under 16-mixed, autocast off), and
optimizers whose `step` tells the tracer where the step is (forward, backward, optimizer, and forward
again for the next model). Lightning's own `manual_backward`, `optimizers()` and `toggle_optimizer`
run unchanged on it; `self.log` does nothing. A Trainer attribute the stand-in lacks is an
EstimateError naming it.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from memplan.compat import attach_stand_in_trainer
from memplan.estimator.errors import EstimateError
from memplan.estimator.step import lightning_distribution

_PASSIVE = {"global_step": 0, "current_epoch": 0, "training": True, "sanity_checking": False, "world_size": 1,
            "num_devices": 1, "global_rank": 0, "local_rank": 0, "is_global_zero": True, "accumulate_grad_batches": 1,
            "gradient_clip_val": None, "gradient_clip_algorithm": None, "max_epochs": None, "max_steps": -1,
            "num_training_batches": 1, "estimated_stepping_batches": 1}
"""Trainer attributes a training_step may read that change no memory; the first step's values."""


def is_manual(model: nn.Module) -> bool:
    """Whether `model` is a LightningModule that optimizes manually."""
    return getattr(model, "automatic_optimization", True) is False and hasattr(model, "manual_backward")


def configured(config: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """The optimizers and schedulers of configure_optimizers()'s return value, in any of its forms."""
    optimizers: list[torch.optim.Optimizer] = []
    schedulers: list[Any] = []

    def walk(item: Any) -> None:
        if isinstance(item, torch.optim.Optimizer):
            optimizers.append(item)
        elif isinstance(item, Mapping):
            walk(item.get("optimizer"))
            scheduler = item.get("lr_scheduler")
            scheduler = scheduler.get("scheduler") if isinstance(scheduler, Mapping) else scheduler
            if scheduler is not None:
                schedulers.append(scheduler)
        elif isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
            for sub in item:
                walk(sub)
        elif item is not None and hasattr(item, "step") and hasattr(item, "optimizer"):
            schedulers.append(item)  # an LR scheduler in the ([optimizers], [schedulers]) form

    walk(config)
    if not optimizers:
        raise EstimateError("optimizer: configure_optimizers() returned no torch.optim.Optimizer, and a module "
                            "that optimizes manually steps its own: return them from configure_optimizers()")
    return optimizers, schedulers


class _SchedulerConfig:
    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler


class _StandInOptimizer(torch.optim.Optimizer):
    """What `self.optimizers()` returns: the optimizer, whose step moves the tracer's phases. An Optimizer to
    `isinstance`, as Lightning's LightningOptimizer is: `LightningModule.optimizers()` returns a lone optimizer
    itself, not a one-item list, only for those (a module with one optimizer calls `self.optimizers().step()`).
    Optimizer.__init__ is not run: every attribute but the few set here is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: StandInTrainer) -> None:  # no super().__init__()
        self.optimizer = optimizer
        self._trainer = trainer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if closure is not None:
            closure()
        self._trainer.phase("optimizer")
        found_inf = None  # GradScaler's per-device copy (CUDA targets): held through the step, dropped at update()
        if self._trainer.grad_scale is not None:
            from memplan.estimator.step import unscale_grads

            found_inf = unscale_grads(self.optimizer, self._trainer.grad_scale, copies=self._trainer.scaler_copies)
        out = self.optimizer.step(**kwargs)
        del found_inf
        self._trainer.phase("forward")  # whatever runs next is the next model's forward
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class _StandInStrategy:
    def __init__(self, trainer: StandInTrainer) -> None:
        self._trainer = trainer
        self._lightning_optimizers = [_StandInOptimizer(o, trainer) for o in trainer.optimizers]

    def backward(self, loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning's strategy.backward under manual optimization: the GradScaler's scale, autocast off."""
        self._trainer.phase("backward")
        scale = self._trainer.grad_scale
        with torch.autocast(self._trainer.device_type, enabled=False):
            (loss * scale if scale is not None else loss).backward(*args, **kwargs)


class StandInTrainer:
    """The Trainer a manually optimizing training_step sees while it is traced (module docstring)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], schedulers: list[Any], *, device_type: str,
                 grad_scale: torch.Tensor | None, phase: Callable[[str], None]) -> None:
        self.optimizers = optimizers
        self.lr_scheduler_configs = [_SchedulerConfig(s) for s in schedulers]
        self.device_type = device_type
        self.grad_scale = grad_scale
        self.scaler_copies = False
        """Whether unscaling makes GradScaler's per-device copies (a CUDA target; step.unscale_grads)."""
        self.phase = phase
        self.strategy = _StandInStrategy(self)

    def __getattr__(self, name: str) -> Any:
        if name in _PASSIVE:
            return _PASSIVE[name]
        raise EstimateError(
            argument="model", stage="step", detail=f"training_step reads `self.trainer.{name}`, which memplan's "
            "estimate of a module that optimizes manually does not stand in for (it traces without a Trainer)",
            fix="Estimate a training_step that does not read it, or pass loss=callable(model, batch)")


def run_manual_step(model: nn.Module, batch: Any, trainer: StandInTrainer, *, policy: Any,
                    phase: Callable[[str], None]) -> None:
    """One manual-optimization step: the user's training_step with `trainer` attached. `phase` is told
    "forward" again after each optimizer step, and "end" at the end."""
    current = {"name": None}

    def moved(name: str) -> None:
        if name == current["name"]:
            return
        if name == "backward" and current["name"] == "forward":
            phase("forward_end")
        current["name"] = name
        phase(name)

    trainer.phase = moved
    previous_log = model.__dict__.get("log")
    model.__dict__["log"] = lambda *args, **kwargs: None  # Lightning's log needs the Trainer's result store
    attach_stand_in_trainer(model, trainer)
    try:
        moved("forward")
        with policy.forward_context(trainer.device_type, lightning=lightning_distribution(model)):
            model.training_step(batch, 0)
        if current["name"] == "forward":
            phase("forward_end")
        phase("end")
    finally:
        attach_stand_in_trainer(model, None)
        if previous_log is None:
            model.__dict__.pop("log", None)
        else:
            model.__dict__["log"] = previous_log
