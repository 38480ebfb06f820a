"""A model's small buffers keep their values in the trace (memplan.estimator.known_values): a number, list or mask
a buffer holds decides shapes as it does in the real step, and the estimate equals a real CPU step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak


class SliceByBuffer(nn.Module):
    """A slice length in a 0-dim int buffer, read with int(): 1 instead of 4000 was a silent -99.9 %."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keep", torch.tensor(3000), persistent=False)
        self.lin = nn.Linear(1, 64)

    def forward(self, x):
        return self.lin(x[:, :int(self.keep), None])


class PadByBuffer(nn.Module):
    """Conv padding in a buffer (transformers' Encodec): with 1 instead of 3 the next conv could not run."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pad", torch.tensor(3), persistent=False)
        self.conv = nn.Conv1d(1, 8, 7, stride=2)
        self.down = nn.Conv1d(8, 8, 7, stride=int(self.pad))  # a stride of 3 needs the padded length

    def forward(self, x):
        p = int(self.pad)
        return self.down(F.pad(self.conv(F.pad(x[:, None], (p, p))), (p, p)))


class SplitAndMaskByBuffers(nn.Module):
    """Split sizes read with .tolist() and a boolean mask buffer selecting features; a step counter incremented
    in place (BatchNorm's num_batches_tracked pattern) and read back."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("sizes", torch.tensor([300, 700]), persistent=False)
        self.register_buffer("mask", torch.arange(1000) % 4 == 0, persistent=False)
        self.register_buffer("steps", torch.tensor(0))
        self.a, self.b, self.c = nn.Linear(300, 32), nn.Linear(700, 32), nn.Linear(250, 32)

    def forward(self, x):
        self.steps.add_(1)
        first, second = torch.split(x, self.sizes.tolist(), dim=1)
        picked = x[:, self.mask]
        return self.a(first) * int(self.steps) + self.b(second) + self.c(picked)


def _batch_of(width: int):
    def make():
        return torch.randn(8, width, generator=torch.Generator().manual_seed(0))
    return make


def _loss(model, batch):
    return model(batch).square().mean()


@pytest.mark.parametrize("build, width", [(SliceByBuffer, 3000), (PadByBuffer, 4000), (SplitAndMaskByBuffers, 1000)],
                         ids=["slice", "pad", "split-mask-counter"])
def test_an_estimate_reads_the_values_its_buffers_hold(build, width):
    est = estimate(build, _batch_of(width)(), loss=_loss, optimizer="sgd", device="cpu")
    truth = measure_cpu_peak(build, _batch_of(width), loss=_loss, optimizer="sgd")
    assert abs(est.peak_allocated / truth - 1) < 0.001, (est.peak_allocated, truth)
    assert not any(".item()" in n for n in est.notes)  # read exactly: nothing assumed


class OverwrittenByActivation(nn.Module):
    """A buffer first holding 3000, then overwritten from an activation before it is read (from the batch alone, it
    would still be known: ops on the real batch run for real)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keep", torch.tensor(3000), persistent=False)
        self.lin, self.first = nn.Linear(1, 64), nn.Linear(8, 1)

    def forward(self, x):
        self.keep.copy_((self.first(x[:, :8])[0, 0] > 100).long() + 10)  # an activation decides (10 here)
        return self.lin(x[:, :int(self.keep), None])


def test_a_buffer_written_from_an_activation_no_longer_answers_with_its_old_value():
    est = estimate(OverwrittenByActivation, _batch_of(3000)(), loss=_loss, optimizer="sgd", device="cpu")
    wide = estimate(SliceByBuffer, _batch_of(3000)(), loss=_loss, optimizer="sgd", device="cpu")
    assert any(".item()" in n for n in est.notes), est.notes  # an assumption, named
    assert est.forward_activations < wide.forward_activations / 100  # not the stale 3000 columns


def test_a_cuda_target_reads_buffer_values_moved_to_the_device():
    """On a CUDA target the buffer is moved to the (fake) device; its value travels with it."""
    est = estimate(SliceByBuffer, _batch_of(3000)(), loss=_loss, optimizer="sgd", device="A100-80GB")
    assert est.forward_activations >= 8 * 3000 * 64 * 4  # the 3000-wide slice's linear output, float32


class WrittenThroughAnAlias(nn.Module):
    """The buffer overwritten from an activation through a view, `.detach()` or `.data` (not through itself)."""

    def __init__(self, alias: str) -> None:
        super().__init__()
        self.alias = alias
        self.register_buffer("keep", torch.tensor([3000]), persistent=False)
        self.lin, self.first = nn.Linear(1, 64), nn.Linear(8, 1)

    def forward(self, x):
        decided = (self.first(x[:, :8])[0, 0] > 100).long() + 10
        target = {"view": self.keep[0:1], "detach": self.keep.detach(), "data": self.keep.data}[self.alias]
        target.copy_(decided)
        return self.lin(x[:, :int(self.keep[0]), None])


@pytest.mark.parametrize("alias", ["view", "detach", "data"])
def test_a_write_through_an_alias_drops_the_value_for_every_alias(alias):
    est = estimate(lambda: WrittenThroughAnAlias(alias), _batch_of(3000)(), loss=_loss, optimizer="sgd", device="cpu")
    wide = estimate(SliceByBuffer, _batch_of(3000)(), loss=_loss, optimizer="sgd", device="cpu")
    assert any(".item()" in n for n in est.notes), est.notes  # an assumption, named, not the stale 3000
    assert est.forward_activations < wide.forward_activations / 100
