"""The LightningModule hooks a Trainer calls around the step are not run by the trace (memplan.estimator.hooks): the
traced copy shares the user's own objects, which a hook would change for real, and hooks start loggers and write
files. The notes name every overridden one, since memory it keeps is not counted (a gradient snapshot kept in
on_after_backward is -15.7 % here)."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator.api import estimate


class Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class GradientSnapshot(Plain):
    """Keeps a copy of every gradient after the backward (for logging): alive through the optimizer step."""

    def on_after_backward(self):
        self.snapshot = [p.grad.detach().clone() for p in self.parameters()]


class CountsAndReadsTheTrainer(Plain):
    """A hook changing state the module shares with the caller, and reading the Trainer from training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = torch.zeros((), dtype=torch.long)

    def on_train_batch_start(self, batch, batch_idx):
        self.steps += 1

    def on_fit_start(self):
        self.ema = [p.detach().clone() for p in self.parameters()]


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)


def test_an_overridden_hook_is_named_as_not_run_and_not_counted():
    est = estimate(GradientSnapshot, _batch(), device="cpu")
    (note,) = [n for n in est.notes if "on_after_backward" in n]
    assert "does not run" in note and "not counted" in note


def test_hooks_are_never_run_on_the_users_module_and_every_overridden_one_is_named():
    model = CountsAndReadsTheTrainer()
    est = estimate(model, _batch(), device="cpu")
    assert model.steps.item() == 0 and not hasattr(model, "ema")
    (note,) = [n for n in est.notes if "LightningModule." in n]
    assert "on_fit_start" in note and "on_train_batch_start" in note and "on_after_backward" not in note


def test_a_module_without_hooks_of_its_own_and_a_plain_loop_get_no_hook_note():
    assert not any("LightningModule." in n for n in estimate(Plain, _batch(), device="cpu").notes)
    assert not any("LightningModule." in n for n in estimate(GradientSnapshot, _batch(), device="cpu",
                                                             loop="torch").notes)
