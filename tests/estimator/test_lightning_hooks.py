"""A LightningModule's per-step hooks are traced where a Trainer calls them (memplan.estimator.hooks): memory a hook
holds at the step's peak is counted, and the notes name what was traced, what could not be, and the once-per-fit hooks
that are not run (they may start loggers or write files). Against a real Trainer.fit (memplan.truth)."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak


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


class EmaFromFitStart(Plain):
    def on_fit_start(self):
        self.ema = [p.detach().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, [p.detach() for p in self.parameters()], 0.01)


class LogsEachStep(Plain):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("step", float(self.trainer.global_step))
        self.last_loss = outputs["loss"].detach()


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)


def test_a_gradient_snapshot_in_on_after_backward_is_counted_as_a_real_fit_holds_it():
    truth = measure_cpu_peak(GradientSnapshot, _batch)
    est = estimate(GradientSnapshot, _batch(), device="cpu")
    assert est.peak_allocated > estimate(Plain, _batch(), device="cpu").peak_allocated + 1_500_000  # the snapshot
    assert abs(est.peak_allocated - truth) / truth < 0.0005, (est.peak_allocated, truth)
    assert any("traced" in n and "on_after_backward" in n for n in est.notes)


def test_a_hook_reading_the_trainer_and_logging_is_traced_without_a_failure_note():
    est = estimate(LogsEachStep, _batch(), device="cpu")
    assert any("traced" in n and "on_train_batch_end" in n for n in est.notes)
    assert not any("could not be traced" in n for n in est.notes)


def test_state_made_once_at_fit_start_is_named_as_not_counted():
    est = estimate(EmaFromFitStart, _batch(), device="cpu")
    assert any("on_fit_start" in n and "not traced" in n and "not counted" in n for n in est.notes)
    assert any("on_train_batch_end could not be traced" in n and "ema" in n for n in est.notes)


def test_a_module_without_hooks_of_its_own_and_a_plain_loop_get_no_hook_notes():
    assert not any("hook" in n for n in estimate(Plain, _batch(), device="cpu").notes)
    plain_loop = estimate(GradientSnapshot, _batch(), device="cpu", loop="torch")
    assert not any("traced where a Trainer calls them" in n for n in plain_loop.notes)


def test_a_hook_that_writes_a_file_is_not_let_write_it_and_is_named(tmp_path):
    target = tmp_path / "samples.pt"
    target.write_bytes(b"the user's file")

    class SavesSamples(Plain):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.trainer.global_step % 100 == 0:
                torch.save(outputs["loss"], target)

    est = estimate(SavesSamples, _batch(), device="cpu")
    assert target.read_bytes() == b"the user's file"
    assert any("on_train_batch_end could not be traced" in n and "write files" in n for n in est.notes)
    torch.save(torch.zeros(1), tmp_path / "after.pt")  # torch.save and open are their own again
    assert torch.load(tmp_path / "after.pt").tolist() == [0.0]
