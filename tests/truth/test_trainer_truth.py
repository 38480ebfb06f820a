"""memplan.estimate against the peak of a real `Trainer.fit` (build + 2 steps), within 0.1 %.

The truth trains through Lightning's own loop (memplan.truth.runs.lightning_fit), not through the step
memplan traces: an order, a precision or a cache the estimator gets wrong shows here.
"""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from memplan.demos import GPTLM
from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak

TOLERANCE = 0.001


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10))


def gpt() -> GPTLM:
    torch.manual_seed(0)
    return GPTLM(vocab_size=256, context=32, d_model=64, n_layers=2, n_heads=4, dropout=0.1)


def _features(n: int, *shape: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)


def _ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


MODELS = {
    "mlp": (mlp, lambda: _features(64, 256), _ce),
    "cnn-batchnorm": (cnn, lambda: _features(16, 3, 32, 32), _ce),
    "gpt": (gpt, lambda: GPTLM.example_batch(gpt(), 4), None),
}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_estimate_is_the_peak_of_a_real_trainer_fit(name, precision):
    build, make_batch, loss = MODELS[name]
    est = estimate(build, make_batch(), loss=loss, optimizer="adamw", precision=precision, device="cpu")
    truth = measure_cpu_peak(build, make_batch, loss=loss, optimizer="adamw", precision=precision)
    assert abs(est.peak_allocated - truth) / truth < TOLERANCE, (est.peak_allocated, truth)


class TwoOptimizerGAN(pl.LightningModule):
    """Manual optimization as a GAN writes it: the generator's step, then the discriminator's, each optimizer
    zeroing only its own gradients (the discriminator's from the generator's backward live into the next batch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 64))
        self.discriminator = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
        self.optimizer_steps = 0

    def training_step(self, batch, batch_idx):
        (real,) = batch
        g_opt, d_opt = self.optimizers()
        fake = self.generator(real[:, :16] * 0.5)
        g_loss = self.discriminator(fake).square().mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        d_loss = self.discriminator(real).square().mean() + self.discriminator(fake.detach()).square().mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        self.optimizer_steps += 2

    def configure_optimizers(self):
        return torch.optim.Adam(self.generator.parameters()), torch.optim.Adam(self.discriminator.parameters())


def _real_samples():
    return (torch.randn(64, 64, generator=torch.Generator().manual_seed(0)),)


def test_the_truth_trains_every_batch_of_a_module_stepping_two_optimizers_a_batch():
    # Lightning's max_steps counts every optimizer.step() under manual optimization: a fit with max_steps=2 ends
    # after the GAN's first batch, before the state the second batch's forward holds exists
    from memplan.truth.runs import Training, train

    started = []
    module = train(Training(build=TwoOptimizerGAN, make_batch=_real_samples, on_step_start=started.append))
    assert started == [1, 2] and module.optimizer_steps == 4


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_manually_optimizing_gan_estimates_as_its_real_fit_measures(precision):
    est = estimate(TwoOptimizerGAN, _real_samples(), precision=precision, device="cpu")
    truth = measure_cpu_peak(TwoOptimizerGAN, _real_samples, precision=precision)
    assert est.peak_phase == "forward"  # the second batch's forward: both Adam states, every gradient, activations
    assert abs(est.peak_allocated - truth) / truth < TOLERANCE, (est.peak_allocated, truth)
