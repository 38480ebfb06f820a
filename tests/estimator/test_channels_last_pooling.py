"""A channels_last CNN whose pooled (or padded) activation is flattened into a linear head: the gradient comes back
to the pooling op NCHW-contiguous, and the CPU kernel copies it into the input's channels_last layout before it
runs. The trace probes the real kernel (memplan/estimator/kernels/input_copies.py, LAYOUT_OPS) and counts the copy."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak

POOLS = {
    "max_pool2d": (lambda y: F.max_pool2d(y, 2), ("max_pool2d_with_indices_backward",)),
    "adaptive_avg_pool2d": (lambda y: F.adaptive_avg_pool2d(y, 16), ("_adaptive_avg_pool2d_backward",)),
    "reflection_pad2d": (lambda y: F.pad(y, (1, 1, 1, 1), mode="reflect")[:, :, 1:17, 1:17],
                         ("reflection_pad2d_backward",)),
}


class ChannelsLastHead(nn.Module):
    def __init__(self, pool: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pool = POOLS[pool][0]
        self.conv = nn.Conv2d(3, 64, 3, padding=1)
        self.head = nn.Linear(64 * 16 * 16, 10)

    def forward(self, x):
        y = self.pool(self.conv(x.contiguous(memory_format=torch.channels_last)))
        return self.head(y.reshape(y.shape[0], -1))


def _images():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)


def _loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_a_channels_last_pooling_backward_s_copy_of_its_gradient_is_counted(pool, monkeypatch):
    from memplan.estimator.kernels import input_copies
    from memplan.estimator.kernels import probe as kernel_probe

    build = lambda: ChannelsLastHead(pool)  # noqa: E731
    truth = measure_cpu_peak(build, _images, loss=_loss)
    est = estimate(build, _images(), loss=_loss, device="cpu")
    assert abs(est.peak_allocated - truth) / truth < 0.001, (est.peak_allocated, truth)
    # the backward's copy is what the probe adds: without probing that op the estimate is short of the truth
    unprobed = {getattr(torch.ops.aten, name).default for name in POOLS[pool][1]}
    monkeypatch.setattr(input_copies, "LAYOUT_OPS", input_copies.LAYOUT_OPS - unprobed)
    kernel_probe._CACHE.clear()
    missed = estimate(build, _images(), loss=_loss, device="cpu")
    assert (missed.peak_allocated - truth) / truth < -0.03, (missed.peak_allocated, truth)
