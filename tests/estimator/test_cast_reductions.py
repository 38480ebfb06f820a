"""CPU reductions that cast their input first (ReduceOps.cpp make_reduction): a sum of a bool or int32 tensor copies
it to int64 (8 bytes an element) before reducing, count_nonzero compares with 0 first. Counting an activation's
positive entries read -32 % without it (the kernel probe now runs them: kernels/input_copies.py). Against real CPU
runs (memplan.truth)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from cpu_steps import ce_loss, seeded_batch

from memplan.estimator.api import estimate
from memplan.estimator.kernels.input_copies import copies_an_input
from memplan.truth import measure_cpu_peak

aten = torch.ops.aten
COUNTS = {
    "bool sum": lambda y: y / ((y > 0).sum(1, keepdim=True) + 1),
    "count_nonzero": lambda y: y / (torch.count_nonzero(y > 0, 1).unsqueeze(1) + 1),
    "int32 sum": lambda y: y / ((y > 0).int().sum(1, keepdim=True) + 1),
}


class Counts(nn.Module):
    def __init__(self, count: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.count = count
        self.a = nn.Linear(64, 1024)
        self.h = nn.Linear(1024, 10)

    def forward(self, x):
        return self.h(COUNTS[self.count](self.a(x)))


def _batch():
    return seeded_batch(256, 64)


@pytest.mark.parametrize("count", list(COUNTS))
@pytest.mark.parametrize("loop", ["lightning", "torch"])
def test_a_count_over_an_activation_is_the_real_cpu_peak(count, loop):
    est = estimate(lambda: Counts(count), _batch(), loss=ce_loss, device="cpu", loop=loop, optimizer="sgd")
    truth = measure_cpu_peak(lambda: Counts(count), _batch, loss=ce_loss, loop=loop, optimizer="sgd")
    assert abs(est.peak_allocated - truth) / truth < 0.0005, (est.peak_allocated, truth)


def test_only_reductions_that_cast_are_probed():
    x = torch.randn(4, 8)
    assert copies_an_input(aten.sum.dim_IntList, (x > 0, [1]))
    assert copies_an_input(aten.count_nonzero.dim_IntList, (x, [1]))
    assert not copies_an_input(aten.sum.dim_IntList, (x, [1]))  # float32 sums as it is
    assert not copies_an_input(aten.sum.default, (x.bfloat16(),))  # (bfloat16 too: it accumulates in float inside)
    assert not copies_an_input(aten.sum.default, (x.long(),))
