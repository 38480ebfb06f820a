"""The LightningModule hooks a Trainer calls around each training step, traced where the step runs them.

A real `Trainer.fit` (automatic optimization) runs, each step: `on_train_batch_start`, training_step,
`on_before_zero_grad` and zero_grad, `on_before_backward`, backward, `on_after_backward`, `on_before_optimizer_step`,
the optimizer step, `on_train_batch_end`. A hook the user's class overrides may hold memory at the step's peak: a clone
of every gradient kept for logging in `on_after_backward` read -15.7 % before these were traced. The trace calls each
overridden one at its place (memplan.estimator.step), with a stand-in Trainer attached (memplan.estimator.manual) and
`self.log` doing nothing; a hook that fails on it (it reads a Trainer attribute the stand-in lacks, state a hook that
is not traced made) is not called again, and the notes name it.

The hooks that run once before training (`on_fit_start`, `on_train_start`, `on_train_epoch_start`) are not traced:
they commonly start loggers or write files, which an estimate must not do. Where the class overrides one, the notes
name it, since memory it keeps (an EMA copy of the weights made there) is not counted."""
from __future__ import annotations

import builtins
import contextlib
import io
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memplan.compat import attach_stand_in_trainer
from memplan.estimator.inputs import is_lightning_module
from memplan.estimator.manual import StandInTrainer

STEP_HOOKS = ("on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_after_backward",
              "on_before_optimizer_step", "on_train_batch_end")
"""The per-step hooks, in the order a Trainer calls them."""
START_HOOKS = ("on_fit_start", "on_train_start", "on_train_epoch_start")
"""The hooks a Trainer calls once before the first step: not traced (module doc)."""
_LIGHTNING = ("pytorch_lightning.", "lightning.")


def overridden(model: nn.Module, names: tuple[str, ...]) -> list[str]:
    """Those of `names` whose implementation on `model`'s class is not Lightning's own."""
    found = []
    for name in names:
        owner = next((cls for cls in type(model).__mro__ if name in vars(cls)), None)
        if owner is not None and not owner.__module__.startswith(_LIGHTNING):
            found.append(name)
    return found


def traced_hooks(model: nn.Module, optimizer: Any, device_type: str, loop: str, manual: bool) -> TracedHooks:
    """The hooks of `model` a trace in `loop` calls: a LightningModule's in Lightning's loop (the per-step ones only
    under automatic optimization, not `manual`: a manual training_step's own code is what runs); none otherwise."""
    lightning = loop == "lightning" and is_lightning_module(model)
    trainer = StandInTrainer([optimizer], [], device_type=device_type, grad_scale=None, phase=lambda name: None)
    return TracedHooks(model, trainer, step=lightning and not manual, start=lightning)


class TracedHooks:
    """Calls a LightningModule's overridden per-step hooks during the trace (module doc); `notes()` says which."""

    def __init__(self, model: nn.Module, trainer: Any, *, step: bool = True, start: bool = True) -> None:
        self.model = model
        self.trainer = trainer
        self.step_hooks = overridden(model, STEP_HOOKS) if step else []
        self.start_hooks = overridden(model, START_HOOKS) if start else []
        self.failed: dict[str, str] = {}
        """Hooks that raised in the trace, by name: what they raised."""

    def __call__(self, name: str, *args: Any) -> None:
        if name not in self.step_hooks or name in self.failed:
            return
        own = self.model.__dict__
        previous = {key: own[key] for key in ("log", "log_dict") if key in own}
        own["log"] = own["log_dict"] = _no_log  # Lightning's log needs the Trainer's result store
        attach_stand_in_trainer(self.model, self.trainer)
        try:
            with _no_file_writes():
                getattr(self.model, name)(*args)
        except Exception as err:  # the hook is user code the stand-in may not carry: named in the notes
            self.failed[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
        finally:
            attach_stand_in_trainer(self.model, None)
            for key in ("log", "log_dict"):
                own.pop(key, None)
            own.update(previous)

    def notes(self) -> list[str]:
        notes = []
        traced = [name for name in self.step_hooks if name not in self.failed]
        if traced:
            notes.append(f"LightningModule hooks traced where a Trainer calls them in the step: {', '.join(traced)}")
        for name, error in self.failed.items():
            notes.append(f"LightningModule.{name} could not be traced ({error}); memory it holds is not counted")
        if self.start_hooks:
            one = len(self.start_hooks) == 1
            notes.append(f"LightningModule.{', '.join(self.start_hooks)} {'runs' if one else 'run'} once before "
                         f"training and {'is' if one else 'are'} not traced (such hooks may start loggers or write "
                         "files): memory kept from there, such as an EMA copy of the weights, is not counted")
        return notes


def _no_log(*args: Any, **kwargs: Any) -> None:
    """LightningModule.log / log_dict while a hook is traced."""


@contextlib.contextmanager
def _no_file_writes() -> Iterator[None]:
    """`open` (builtins' and io's, which pathlib, numpy and PIL call) refuses to write, and `torch.save` (which writes
    through its own C++ writer) refuses, while a hook is traced: a hook that saves samples or a checkpoint at step 0
    would otherwise write, or overwrite, a user's file from an estimate. (A C extension writing for itself is not
    stopped.)"""
    original_open, original_save = builtins.open, torch.save

    def guarded_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(flag in mode for flag in "wax+"):
            raise PermissionError(f"memplan does not let a traced hook write files (open({file!r}, {mode!r}))")
        return original_open(file, mode, *args, **kwargs)

    def guarded_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(f"memplan does not let a traced hook write files (torch.save to {f!r})")

    builtins.open = io.open = guarded_open
    torch.save = torch.serialization.save = guarded_save
    try:
        yield
    finally:
        builtins.open = io.open = original_open
        torch.save = torch.serialization.save = original_save
