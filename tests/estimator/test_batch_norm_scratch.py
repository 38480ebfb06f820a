"""CPU batch norm's backward takes a buffer the size of its input while it runs: probed, as convolutions are.

A depthwise Conv3d (its backward takes little scratch) followed by BatchNorm3d peaks inside the batch
norm's backward, where a trace of fake tensors sees no buffer at all.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator.kernels import probe as kernel_probe
from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak


class DepthwiseVideoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(3, 32, (3, 7, 7), stride=(1, 2, 2), padding=(1, 3, 3))
        self.depthwise = nn.Conv3d(32, 32, 3, padding=1, groups=32)
        self.bn = nn.BatchNorm3d(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = self.stem(x).relu()
        x = self.bn(self.depthwise(x)).relu() + x
        return self.head(x.mean((2, 3, 4)))


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 8, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)


def _ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def test_a_peak_inside_batch_norms_backward_is_counted(monkeypatch):
    truth = measure_cpu_peak(DepthwiseVideoBlock, _batch, loss=_ce)
    est = estimate(DepthwiseVideoBlock, _batch(), loss=_ce, device="cpu")
    assert abs(est.peak_allocated - truth) / truth < 0.001, (est.peak_allocated, truth)
    monkeypatch.setattr(kernel_probe, "_PROBED_OPS", kernel_probe._PROBED_OPS - kernel_probe._BATCH_NORMS)
    unprobed = estimate(DepthwiseVideoBlock, _batch(), loss=_ce, device="cpu")
    assert (unprobed.peak_allocated - truth) / truth < -0.05
