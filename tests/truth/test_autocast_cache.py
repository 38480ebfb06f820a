"""A plain loop's autocast caches weight casts; Lightning's does not (cache_enabled=False, since Lightning 2.5.5).

A layer applied twice under autocast: with the cache its weight is cast once, both matmuls use that one
copy, and the backward sums their gradients in bf16 before one cast back to float32; without it each call
casts its own copy, and the backward casts two float32 gradients of the layer and sums them.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.compat.versions import lightning_autocast_caches
from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak

WIDTH = 1024


class TwiceApplied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.fc(torch.relu(self.fc(x))).float().square().mean()


def make_batch():
    return (torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(0)),)


def loss(model, batch):
    return model(batch[0])


@pytest.mark.parametrize("loop", ["lightning", "torch", "torch-zero-after-forward", "torch-keep-grads"])
def test_estimate_matches_the_loops_autocast_cache(loop):
    est = estimate(TwiceApplied, make_batch(), loss=loss, optimizer="sgd", precision="bf16-mixed", device="cpu",
                   loop=loop)
    truth = measure_cpu_peak(TwiceApplied, make_batch, loss=loss, optimizer="sgd", precision="bf16-mixed", loop=loop)
    assert abs(est.peak_allocated - truth) / truth < 0.001, (est.peak_allocated, truth)


@pytest.mark.skipif(lightning_autocast_caches(), reason="this Lightning (before 2.5.5) caches weight casts as a plain "
                    "loop does: the two loops' autocast do not differ")
def test_the_cache_saves_a_second_float32_gradient_of_a_shared_layer():
    kwargs = dict(loss=loss, optimizer="sgd", precision="bf16-mixed", device="cpu")
    lightning = estimate(TwiceApplied, make_batch(), **kwargs)
    plain = estimate(TwiceApplied, make_batch(), loop="torch", **kwargs)
    assert lightning.peak_phase == plain.peak_phase == "backward"
    # + 4 bytes: the scalar Lightning's closure divides the loss into (loss / 1), alive through the backward
    assert lightning.peak_allocated - plain.peak_allocated == 4 * (WIDTH * WIDTH + WIDTH) + 4


@pytest.mark.parametrize("lightning, caches", [("2.5.4", True), ("2.5.5", False)])
def test_lightnings_loop_autocasts_as_the_installed_lightning_does(monkeypatch, lightning, caches):
    """Lightning's MixedPrecision kept torch's weight-cast cache on until 2.5.5; the step follows the installed
    release (a plain loop always caches)."""
    from memplan.compat import versions
    from memplan.estimator.step import PrecisionPolicy

    monkeypatch.setattr(versions, "installed_version", {"pytorch-lightning": lightning}.get)
    policy = PrecisionPolicy.from_string("bf16-mixed")
    with policy.forward_context("cpu", loop="lightning"):
        assert torch.is_autocast_cache_enabled() is caches
    with policy.forward_context("cpu", loop="torch"):
        assert torch.is_autocast_cache_enabled()


def test_the_trainer_comes_from_the_package_the_module_subclasses():
    import lightning.pytorch
    import pytorch_lightning

    from memplan.estimator.step import lightning_distribution

    class FromLightning(lightning.pytorch.LightningModule):
        pass

    class FromPytorchLightning(pytorch_lightning.LightningModule):
        pass

    assert lightning_distribution(FromLightning()) == "lightning"
    assert lightning_distribution(FromPytorchLightning()) == "pytorch-lightning"
    assert lightning_distribution(TwiceApplied()) == "pytorch-lightning"  # a plain module under loop="lightning"
