"""Backward formulas that fill a fresh buffer of zeros in place (`scatter_` for max/median over a dim,
`scatter_add_` for gather, `put_` for take) run out of place under any dispatch mode, the tracker's included; the
estimate counts them as the real backward runs them (memplan.estimator.accumulation FILLED_IN_PLACE)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak

REDUCTIONS = {
    "max over a dim": lambda h: h.max(-1).values,
    "median over a dim": lambda h: h.median(-1).values,
    "take": lambda h: h.take(torch.arange(0, h.numel(), 7)),
    "gather": lambda h: h.gather(-1, torch.zeros(h.shape[0], 8, dtype=torch.long)),  # per-token log-probs' op
}


class Reduced(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.linear = name, nn.Linear(64, 64)

    def forward(self, x):
        return REDUCTIONS[self.name](self.linear(x))


def _rows():
    return torch.randn(8192, 64, generator=torch.Generator().manual_seed(0))


def _loss(model, x):
    return model(x).square().mean()


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_a_backward_that_fills_zeros_in_place_is_counted_as_the_real_one(name):
    build = lambda: Reduced(name)  # noqa: E731
    est = estimate(build, _rows(), loss=_loss, optimizer="sgd", device="cpu")
    truth = measure_cpu_peak(build, _rows, loss=_loss, optimizer="sgd")
    assert abs(est.peak_allocated / truth - 1) < 0.001, (est.peak_allocated, truth)
