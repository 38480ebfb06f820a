"""A batch or a model on a device other than the trace's is traced as if it were on the trace's device.

On a GPU machine MemoryPlanner traces the user's own module and Lightning's batch, which live on cuda:0,
on fake CPU tensors (its loss-reduction trace, MEMPLAN_TRACE_ON_CPU=1). CPU-only CI has no second device:
"meta" stands in for it here (a tensor on a device the trace is not on; it has no values, so the trace
makes it a fake there, where a real GPU tensor is copied with its values)."""
from __future__ import annotations

import dataclasses

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from memplan.demos import GPTLM
from memplan.estimator.api import estimate

TINY = dict(vocab_size=512, context=32, d_model=32, n_layers=2, n_heads=2, dropout=0.1)


def everything(result) -> dict:
    """Every field of an estimate but how long the trace took."""
    fields = dataclasses.asdict(result)
    fields.pop("trace_seconds")
    return fields


def on_meta(batch):
    return tuple(t.to("meta") for t in batch)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_a_batch_on_another_device_estimates_byte_for_byte_as_on_the_cpu(precision):
    model = GPTLM(**TINY)
    batch = model.example_batch(4)
    on_cpu = estimate(model, batch, device="cpu", precision=precision)
    elsewhere = estimate(model, on_meta(batch), device="cpu", precision=precision)
    assert everything(elsewhere) == everything(on_cpu)
    assert elsewhere.batch == 2 * 4 * TINY["context"] * 8  # input ids and labels, int64, counted once each


def test_a_batch_on_another_device_for_a_gpu_target_traced_on_the_cpu():
    model = GPTLM(**TINY)
    batch = model.example_batch(4)
    assert everything(estimate(model, on_meta(batch), device="A100-80GB", precision="bf16-mixed")) == everything(
        estimate(model, batch, device="A100-80GB", precision="bf16-mixed"))


def test_a_model_and_its_batch_both_on_another_device():
    with torch.device("meta"):  # (built there: Module.to("meta") would untie the tied embedding)
        elsewhere = GPTLM(**TINY)
    model = GPTLM(**TINY)
    batch = model.example_batch(4)
    assert everything(estimate(elsewhere, on_meta(batch), device="cpu")) == everything(
        estimate(model, batch, device="cpu"))


class _WeightedLoss(pl.LightningModule):
    """Class weights held as a plain attribute (not a buffer: Module.to does not move it), which a user
    moves to the GPU in a hook."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 5))
        self.class_weights = torch.linspace(0.5, 1.5, 5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y, weight=self.class_weights)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_plain_tensor_the_model_holds_on_another_device_is_traced_on_the_trace_device():
    model = _WeightedLoss()
    batch = (torch.randn(8, 16), torch.randint(0, 5, (8,)))
    on_cpu = estimate(model, batch, device="cpu")
    weights = model.class_weights = model.class_weights.to("meta")
    assert everything(estimate(model, on_meta(batch), device="cpu")) == everything(on_cpu)
    assert model.class_weights is weights  # the user's module is left as it was


class _PositionsOnSelfDevice(pl.LightningModule):
    """Makes its positions on `self.device`, as LightningModules do (cuda:0 on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(64, 16)
        self.pos = nn.Embedding(8, 16)
        self.head = nn.Linear(16, 64)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        positions = torch.arange(ids.shape[1], device=self.device)
        logits = self.head(self.tok(ids) + self.pos(positions))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_lightning_module_on_another_device_makes_its_step_tensors_on_the_trace_device():
    torch.manual_seed(0)
    batch = (torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)))
    with torch.device("meta"):
        elsewhere = _PositionsOnSelfDevice()
    assert elsewhere.device.type == "meta"
    assert everything(estimate(elsewhere, on_meta(batch), device="cpu")) == everything(
        estimate(_PositionsOnSelfDevice(), batch, device="cpu"))
    assert elsewhere.device.type == "meta"  # the user's module is left as it was
