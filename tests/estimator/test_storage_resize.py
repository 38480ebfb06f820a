"""A storage resized in place is recounted at its new size (the tracker re-checks every sighting).

`torch.cat(..., out=buffer)` and `buffer.resize_(...)` grow a registered buffer's storage in place: the
storage the trace counted at setup (0 bytes) holds the new bytes from then on.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak


class GrowingBuffer(nn.Module):
    """A no-grad side computation written into a registered buffer that starts empty."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc = nn.Linear(256, 256)
        self.register_buffer("buf", torch.empty(0), persistent=False)

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            if self.how == "cat-out":
                torch.cat([x, x, x, x], dim=1, out=self.buf)
            elif self.how == "resize":
                self.buf.resize_(x.shape[0], 4 * x.shape[1]).copy_(x.repeat(1, 4))
            else:  # "assign": a new tensor each step, the old one freed
                self.buf = torch.cat([x, x, x, x], dim=1)
            scale = self.buf.abs().amax()
        return (h * scale).mean()


def make_batch():
    return (torch.randn(512, 256, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("how", ["cat-out", "resize", "assign"])
def test_a_buffer_grown_in_place_is_counted_at_its_new_size(how):
    build = lambda: GrowingBuffer(how)  # noqa: E731
    loss = lambda m, b: m(b[0])  # noqa: E731
    est = estimate(build, make_batch(), loss=loss, optimizer="sgd", device="cpu")
    truth = measure_cpu_peak(build, make_batch, loss=loss, optimizer="sgd")
    assert abs(est.peak_allocated - truth) / truth < 0.001, (est.peak_allocated, truth)
