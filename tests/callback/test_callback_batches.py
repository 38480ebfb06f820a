"""Batches of every shape Lightning accepts, split into chunks by MemoryPlanner: each must train as
the whole batch does; a per-batch tensor travels whole; a batch that cannot be split is refused with
the fields named; the split is a hook a subclass overrides; a plan above the loader's batch is clamped."""
from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from callback_sim import IndexedData, build_net, make_plan, run_net, weights_of
from torch.utils.data import DataLoader

from memplan.callback import MemoryPlanner
from memplan.callback.framework import MisconfigurationException


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    y: torch.Tensor
    note: str = "travels whole"


def as_dict(x, y):
    # per-sample x and y, and a per-batch weight for each output feature (not of the batch size)
    return {"x": x, "y": y, "weights": torch.ones(3, dtype=torch.float64)}


SHAPES = {
    "tuple": lambda x, y: (x, y),
    "list": lambda x, y: [x, y],
    "dict": as_dict,
    "namedtuple": Pair,
    "dataclass": lambda x, y: Sample(x, y),
    "nested": lambda x, y: {"inputs": [x], "target": Pair(y, y)},
    # per-sample Python lists beside the tensors (ids, raw texts), and a per-batch tuple of another length
    "lists": lambda x, y: {"x": x, "y": y, "ids": [f"s{int(v * 1e6)}" for v in x[:, 0]],
                           "texts": tuple("t" * (i + 1) for i in range(len(x))), "image_size": (224, 224, 3)},
}


def unpack(batch):
    if isinstance(batch, (tuple, list)) and not isinstance(batch, Pair):
        return batch[0], batch[1]
    if isinstance(batch, dict) and "inputs" in batch:
        return batch["inputs"][0], batch["target"].y
    if isinstance(batch, dict) and "ids" in batch:  # each chunk (and each planning trace) gets its own samples' ids
        x = batch["x"]
        assert batch["ids"] == [f"s{int(v * 1e6)}" for v in x[:, 0]] and len(batch["texts"]) == len(x), batch
        assert batch["image_size"] == (224, 224, 3)
        return x, batch["y"]
    if isinstance(batch, dict):
        assert batch["weights"].shape == (3,)  # the per-batch tensor reached the chunk whole
        return batch["x"], batch["y"]
    return batch.x, batch.y


class Shaped(pl.LightningModule):
    """The float64 MLP of callback_sim on batches of the shape named."""

    def __init__(self, shape: str, batch: int = 8) -> None:
        super().__init__()
        self.shape, self.loader_batch = shape, batch
        self.net = build_net()
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = unpack(batch)
        self.sizes.append(len(x))
        return F.mse_loss(run_net(self.net, x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        make = SHAPES[self.shape]
        return DataLoader(IndexedData(), batch_size=self.loader_batch,
                          collate_fn=lambda s: make(torch.stack([a for a, _, _ in s]), torch.stack([b for _, b, _ in s])))


def fit(make_trainer, module, planner=None, steps=3):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*runs as chunks.*")
        make_trainer([planner] if planner else [], max_steps=steps).fit(module)
    return weights_of(module)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_batch_shape_splits_into_chunks_that_train_as_the_whole_batch(make_trainer, shape):
    whole = fit(make_trainer, Shaped(shape))
    module = Shaped(shape)
    split = fit(make_trainer, module, MemoryPlanner(make_plan(2, 4), adjust=False))
    assert module.sizes == [2] * 12
    for name, value in whole.items():
        torch.testing.assert_close(split[name], value, rtol=0, atol=1e-12, msg=name)


class Unsplittable(Shaped):
    def train_dataloader(self):
        # the samples are stacked along dim 1: no tensor's first dimension is the batch size
        return DataLoader(IndexedData(), batch_size=8, collate_fn=lambda s: {
            "x": torch.stack([a for a, _, _ in s], dim=1), "y": torch.stack([b for _, b, _ in s], dim=1)[0]})


def test_a_batch_with_no_batch_dimension_to_split_is_refused_naming_its_fields(make_trainer):
    with pytest.raises(MisconfigurationException) as caught:
        fit(make_trainer, Unsplittable("dict"), MemoryPlanner(make_plan(2, 4), adjust=False))
    message = str(caught.value)
    assert "batch['x'] (6, 8)" in message and "batch['y'] (8,)" in message  # 6 vs 8: a tie, named
    assert "batch_size_of" in message and "split_batch" in message


class TransposedPlanner(MemoryPlanner):
    """A user's own split, for the batch above: the samples are along dim 1 of x."""

    def batch_size_of(self, batch):
        return batch["y"].shape[0]

    def split_batch(self, batch, start, stop, batch_size):
        return {"x": batch["x"][:, start:stop], "y": batch["y"][start:stop]}


class TransposedModel(Unsplittable):
    def training_step(self, batch, batch_idx):
        x, y = batch["x"].T, batch["y"][:, None]
        self.sizes.append(len(x))
        return F.mse_loss(run_net(self.net, x), y)


def test_batch_size_of_and_split_batch_are_hooks_a_subclass_overrides(make_trainer):
    whole = fit(make_trainer, TransposedModel("dict"))
    module = TransposedModel("dict")
    split = fit(make_trainer, module, TransposedPlanner(make_plan(2, 4), adjust=False))
    assert module.sizes == [2] * 12
    for name, value in whole.items():
        torch.testing.assert_close(split[name], value, rtol=0, atol=1e-12, msg=name)


class SmallData(Shaped):
    """A `batch_size` attribute MemoryPlanner sets, but a dataset of 96 samples: a batch of 128 is 96."""

    def __init__(self) -> None:
        super().__init__("tuple")
        self.batch_size = 8

    def train_dataloader(self):
        return DataLoader(IndexedData(), batch_size=self.batch_size,
                          collate_fn=lambda s: (torch.stack([a for a, _, _ in s]), torch.stack([b for _, b, _ in s])))


def test_a_plan_above_the_loaders_batch_is_clamped_with_a_warning(make_trainer):
    module = SmallData()
    planner = MemoryPlanner(make_plan(128, 1), every_n_steps=1, grow=True, grow_patience=1)
    with pytest.warns(UserWarning, match="the planned micro-batch of 128 is clamped to it"):
        make_trainer([planner], max_steps=3).fit(module)
    assert module.batch_size == 128 and module.sizes == [96, 96, 96]
    assert (planner.layout.loader_batch_size, planner.layout.micro_batch_size) == (96, 96)
    assert planner.layout.global_batch_size == 96


def test_planning_uses_the_split_batch_a_subclass_overrides(make_trainer):
    # no tensor of this batch has the batch size first: only the user's own split can cut it for a trace
    planner = TransposedPlanner(grow=False)
    fit(make_trainer, TransposedModel("dict"), planner, steps=2)
    assert planner.plan is not None and planner.plan.global_batch_size == 8


@pytest.mark.parametrize("shape", ["dataclass", "dict", "nested", "lists"])
def test_planning_from_an_estimate_takes_every_batch_shape(make_trainer, shape):
    planner = MemoryPlanner(grow=False)
    module = Shaped(shape)
    fit(make_trainer, module, planner, steps=2)
    assert planner.plan is not None and planner.plan.global_batch_size == 8
    assert planner.plan.predicted_peak_bytes > sum(p.numel() * p.element_size() for p in module.parameters())


def test_a_plan_above_a_loader_that_keeps_its_batch_is_clamped_with_a_warning(make_trainer):
    module = Shaped("tuple", batch=8)  # no batch_size attribute: the loader keeps its 8
    planner = MemoryPlanner(make_plan(16, 1), adjust=False)
    with pytest.warns(UserWarning, match="the plan's micro-batch of 16 is above the 8 samples the train loader "
                                         "yields per batch; clamped to 8"):
        fit(make_trainer, module, planner, steps=2)
    assert (planner.layout.loader_batch_size, planner.layout.micro_batch_size) == (8, 8)
    assert module.sizes == [8] * 4 and planner.layout.accumulate_grad_batches == 2  # the global batch of 16 kept
