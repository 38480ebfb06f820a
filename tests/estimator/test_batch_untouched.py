"""`estimate` leaves the caller's batch as it was. memplan runs ops on the batch alone for real; a step that changes
its batch in place (`x.mul_(2)`, a normalisation written `x.sub_(mean)`) changed the user's tensor, once per traced step
(x4 after an estimate). The trace now runs on its own copy of every real batch tensor already on the trace's device,
storage for storage, so the estimate is what it was (against real CPU runs, memplan.truth)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from cpu_steps import ce_loss, seeded_batch

from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak


class ScalesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(64, 256)
        self.l2 = nn.Linear(256, 10)

    def forward(self, x):
        x.mul_(2).sub_(1)
        return self.l2(torch.relu(self.l1(x)))


def _batch():
    return seeded_batch(32, 64)


@pytest.mark.parametrize("loop", ["lightning", "torch"])
def test_an_in_place_op_on_the_batch_leaves_the_callers_batch_unchanged(loop):
    batch = _batch()
    before = [t.clone() for t in batch]
    est = estimate(ScalesItsInput, batch, loss=ce_loss, device="cpu", loop=loop)
    assert all(torch.equal(t, b) for t, b in zip(batch, before))
    assert batch[0]._version == 0  # not written and restored: never written
    truth = measure_cpu_peak(ScalesItsInput, _batch, loss=ce_loss, loop=loop)
    assert abs(est.peak_allocated - truth) / truth < 0.0005, (est.peak_allocated, truth)  # (12 B short either way)


def test_a_view_into_a_larger_batch_storage_keeps_that_storage_and_the_callers_values():
    """Two batch tensors that are views of one storage (features and targets cut from one table) still share one
    storage in the trace, as large as the caller's: the estimate counts what the caller's batch holds."""

    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(63, 1)

        def forward(self, x):
            x.add_(1)
            return self.l(x).squeeze(1)

    table = torch.randn(32, 64)
    before = table.clone()
    batch = (table[:, :63], table[:, 63])

    def loss(model, b):
        return F.mse_loss(model(b[0]), b[1])

    shared = estimate(Table, batch, loss=loss, device="cpu")
    apart = estimate(Table, (table[:, :63].clone(), table[:, 63].clone()), loss=loss, device="cpu")
    assert torch.equal(table, before)
    assert shared.peak_allocated == apart.peak_allocated  # one 32x64 storage == a 32x63 and a 32-element one
