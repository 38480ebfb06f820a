"""MemoryPlanner reads the train loader before training (a batch to plan from, a scan for the heaviest): the samples
and their order that training then sees must be the ones it sees without the callback, and a loader it cannot read
ahead without changing them is refused by name."""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from memplan.callback import MemoryPlanner
from memplan.callback.framework import MisconfigurationException


class RecordsSamples(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        x, y, i = batch
        self.seen.append(i.tolist())
        return F.mse_loss(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _seen(make_trainer, callbacks) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g), torch.arange(64))
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(123))
    module = RecordsSamples()
    make_trainer(callbacks, max_steps=3).fit(module, loader)
    return module.seen


@pytest.mark.parametrize("settings", [{}, {"scan_batches": 0}])
def test_a_loader_with_a_seeded_generator_of_its_own_shuffles_as_without_memplan(make_trainer, settings):
    """DataLoader(shuffle=True, generator=torch.Generator().manual_seed(...)), the usual reproducible shuffle: the
    fit-start read advanced that generator (the user's object, shared with the loader training iterates), so training
    saw other samples (its weights moved by 0.16)."""
    assert _seen(make_trainer, [MemoryPlanner(**settings)]) == _seen(make_trainer, [])


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, generator=g), torch.randn(1, generator=g), torch.tensor(i)) for i in range(64)]


class Stream(IterableDataset):
    """A stream: what is read is gone (a queue, a socket; here a list's iterator)."""

    def __init__(self, copyable: bool = True) -> None:
        pairs = _pairs()
        self.it = iter(pairs) if copyable else (p for p in pairs)  # (a generator cannot be copied)

    def __iter__(self):
        return self.it


class Shards(IterableDataset):
    """Each pass starts at the next shard: a position that reading moves."""

    def __init__(self) -> None:
        self.pairs, self.passes = _pairs(), 0

    def __iter__(self):
        start = self.passes * 16 % 64
        self.passes += 1
        return iter(self.pairs[start:] + self.pairs[:start])


@pytest.mark.parametrize("dataset", [Stream, Shards])
def test_an_iterable_dataset_read_ahead_trains_on_the_samples_it_trains_on_without_memplan(make_trainer, dataset):
    """The fit-start read emptied a stream (training then ran epochs of no batch, for ever) and moved a cursor (other
    samples); it now reads a copy of the dataset."""
    def seen(callbacks):
        module = RecordsSamples()
        trainer = make_trainer(callbacks, max_steps=4, max_epochs=2)
        trainer.fit(module, DataLoader(dataset(), batch_size=8))
        assert trainer.global_step == 4
        return module.seen

    assert seen([MemoryPlanner()]) == seen([])


def test_an_iterable_dataset_that_cannot_be_copied_is_refused_naming_the_way_around(make_trainer):
    with pytest.raises(MisconfigurationException, match=r"IterableDataset \(Stream\) cannot be copied .*TypeError.*"
                                                        r"MemoryPlanner\(plan=\.\.\.\)"):
        make_trainer([MemoryPlanner()], max_steps=4, max_epochs=2).fit(
            RecordsSamples(), DataLoader(Stream(copyable=False), batch_size=8))
