"""The LightningModule hooks a Trainer calls that the trace does not run, named in the notes.

A real `Trainer.fit` runs, besides training_step: each step `on_train_batch_start`, `on_before_zero_grad`,
`on_before_backward`, `on_after_backward`, `on_before_optimizer_step` and `on_train_batch_end` (also around a manual
training_step's `manual_backward` and `opt.step()`), and once before training `on_fit_start`, `on_train_start` and
`on_train_epoch_start`. A hook the user's class overrides may hold memory at the step's peak: a clone of every gradient
kept in `on_after_backward` is -15.7 % on a small MLP, an EMA copy of the weights made in `on_fit_start` as much. The
trace does not run them: the traced copy of the model shares the user's own objects (counters, buffers held outside
the module tree), which a hook run there would change for real, and hooks start loggers and write files. So the notes
name every overridden one, and say that memory it keeps is not counted."""
from __future__ import annotations

from torch import nn

from memplan.estimator.inputs import is_lightning_module

HOOKS = ("on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start", "on_before_zero_grad",
         "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_train_batch_end")
"""The hooks a Trainer calls before and around each training step, in its order."""
_LIGHTNING = ("pytorch_lightning.", "lightning.")


def overridden(model: nn.Module, names: tuple[str, ...] = HOOKS) -> list[str]:
    """Those of `names` whose implementation on `model`'s class is not Lightning's own."""
    found = []
    for name in names:
        owner = next((cls for cls in type(model).__mro__ if name in vars(cls)), None)
        if owner is not None and not owner.__module__.startswith(_LIGHTNING):
            found.append(name)
    return found


def hook_notes(model: nn.Module, loop: str) -> list[str]:
    """The note naming the hooks of `model` a real fit in Lightning's loop calls and the trace does not run."""
    if loop != "lightning" or not is_lightning_module(model):
        return []
    names = overridden(model)
    if not names:
        return []
    return [f"LightningModule.{', '.join(names)}: {'a hook' if len(names) == 1 else 'hooks'} a Trainer calls that "
            "the estimate does not run (running them on the traced copy could change your module's own state, start "
            "loggers or write files): memory they keep (a copy of the gradients or weights) is not counted"]
