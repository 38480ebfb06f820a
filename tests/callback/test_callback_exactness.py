"""Safe by default: MemoryPlanner splits or rewrites a batch only where that trains exactly as the user's
settings (memplan.callback.exactness); elsewhere it keeps the batch, or refuses naming the argument that
allows the change. The recognised losses (memplan.callback.loss_reduction) are checked end to end: a
split batch must give the weights the whole batch gives."""
from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from callback_sim import IndexedData, Regression, make_plan, run_net
from torch.utils.data import DataLoader, Dataset

from memplan.callback import MemoryPlanner
from memplan.callback.framework import MisconfigurationException
from memplan.callback.loss_reduction import LossWatcher

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH, SAMPLES = 40, 12, 64


class PaddedText(Dataset):
    """Token sequences of 2..LENGTH real tokens, right-padded; labels -100 on the padding (as a
    DataCollatorForLanguageModeling-style collate makes them)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, VOCAB, (SAMPLES, LENGTH), generator=g)
        self.lengths = [2 + (i * 7) % (LENGTH - 1) for i in range(SAMPLES)]

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        ids, n = self.ids[i].clone(), self.lengths[i]
        ids[n:] = 0
        mask = (torch.arange(LENGTH) < n).long()
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class CausalLM(pl.LightningModule):
    """A tiny GPT-2 from its config class, held as `self.model`, trained on its own loss (`labels=`)."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.loader_batch = batch_size
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return DataLoader(PaddedText(), batch_size=self.loader_batch)


def fit(make_trainer, module, callbacks=(), steps=4):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(list(callbacks), max_steps=steps).fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items() if v.is_floating_point()}


def relative_update_difference(after: dict, reference: dict, before: dict) -> float:
    """|(after - before) - (reference - before)| / |reference - before| over all weights."""
    diff = sum(((after[k] - reference[k]).double() ** 2).sum() for k in reference) ** 0.5
    update = sum(((reference[k] - before[k]).double() ** 2).sum() for k in reference) ** 0.5
    return float(diff / update)


def test_a_causal_lms_own_loss_splits_exactly_with_padding(make_trainer):
    """transformers' causal-LM loss is a mean over the shifted labels that are not -100: chunks of 2 of a
    padded batch of 8, weighted by their own count of such labels, train as the whole batch (before, the
    default weighting by samples trained 21-23 % differently)."""
    before = {k: v.clone() for k, v in CausalLM().state_dict().items() if v.is_floating_point()}
    whole = fit(make_trainer, CausalLM())
    planner = MemoryPlanner(make_plan(2, 4), adjust=False)  # the loader's 8 as chunks of 2
    split = fit(make_trainer, CausalLM(), [planner])
    assert planner.layout.chunks == 4 and planner.exactness.reduction.kind == "mean_count"
    assert "batch['labels']" in planner.exactness.reduction.describe
    assert relative_update_difference(split, whole, before) <= 1e-5
    # the weighting by samples, which MemoryPlanner(loss_reduction='mean') declares, is measurably off
    by_samples = fit(make_trainer, CausalLM(), [MemoryPlanner(make_plan(2, 4), adjust=False, loss_reduction="mean")])
    assert relative_update_difference(by_samples, whole, before) > 1e-3


class HandWrittenMean(Regression):
    """A mean squared error written out: memplan cannot tell how it reduces."""

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return ((run_net(self.net, x) - y) ** 2).mean()


def test_an_unrecognised_loss_is_not_split_and_the_argument_that_allows_it_is_named(make_trainer):
    module = HandWrittenMean(batch_size=8, with_attr=False)  # the loader keeps 8: a plan of 2 must split it
    with pytest.raises(MisconfigurationException, match=r"cannot tell how the loss reduces.*"
                                                        r"MemoryPlanner\(loss_reduction='mean'\)"):
        fit(make_trainer, module, [MemoryPlanner(make_plan(2, 4), adjust=False)])
    declared = MemoryPlanner(make_plan(2, 4), adjust=False, loss_reduction="mean")  # the user says so: split
    fit(make_trainer, HandWrittenMean(batch_size=8, with_attr=False), [declared])
    assert declared.layout.chunks == 4


def test_planning_keeps_the_loaders_batch_where_a_split_is_not_exact(make_trainer):
    """Planning now: the first trace recognises nothing, so the planner is asked again with the loader's
    batch as the least micro-batch (checkpointing is then its only lever)."""
    requests = []

    def planner(request, estimate):
        requests.append(request)
        estimate(micro_batch_size=2, precision="32-true", checkpointing=False, world_size=1)
        return make_plan(request.min_micro_batch_size or 2, 16 // (request.min_micro_batch_size or 2))

    module = HandWrittenMean(batch_size=8, with_attr=False)
    memory_planner = MemoryPlanner(planner=planner, global_batch_size=16, grow=False)
    fit(make_trainer, module, [memory_planner], steps=2)
    assert [r.min_micro_batch_size for r in requests] == [None, 8]
    assert memory_planner.layout.micro_batch_size == 8 and memory_planner.layout.chunks == 1
    assert memory_planner.exactness.reduction.kind == "unknown"


class DropLast(Regression):
    def train_dataloader(self):
        return DataLoader(IndexedData(), batch_size=self.batch_size, drop_last=True)


def test_a_rewrite_that_would_drop_other_samples_each_epoch_is_not_made(make_trainer):
    # 96 samples: batches of 10 see 90 an epoch, the plan's batches of 5 would see 95. Kept at 10, split in chunks
    module = DropLast(batch_size=10)
    planner = MemoryPlanner(make_plan(5, 2), adjust=False)
    fit(make_trainer, module, [planner], steps=2)
    assert module.batch_size == 10 and planner.layout.chunks == 2
    assert "drop_last=True" in planner.exactness.no_rewrite and "95 of its 96 samples instead of 90" in planner.exactness.no_rewrite


def test_unrecognised_shapes_of_loss_say_unknown():
    """The class of losses not recognised: several terms, targets not from the batch (contrastive)."""
    lin = torch.nn.Linear(4, 4)
    batch = {"x": torch.randn(3, 4), "y": torch.tensor([0, 1, 2])}

    def reduction_of(step):
        watcher = LossWatcher()
        watcher.watch(batch, 3)
        with watcher:
            step(batch).backward()
        return watcher.reduction()

    assert reduction_of(lambda b: F.cross_entropy(lin(b["x"]), b["y"])).kind == "mean_count"
    assert reduction_of(lambda b: F.cross_entropy(lin(b["x"]), b["y"], reduction="sum") * 0.5).kind == "sum"
    assert reduction_of(lambda b: F.mse_loss(lin(b["x"]), b["x"])).kind == "mean_samples"
    contrastive = reduction_of(lambda b: F.cross_entropy(lin(b["x"]) @ lin(b["x"]).T, torch.arange(3)))
    assert contrastive.kind == "unknown" and "cross_entropy" in contrastive.describe
    assert reduction_of(lambda b: F.cross_entropy(lin(b["x"]), b["y"]) + lin(b["x"]).pow(2).mean()).kind == "unknown"
    # divided by a count taken from the batch: a mean memplan does not follow
    assert reduction_of(lambda b: F.cross_entropy(lin(b["x"]), b["y"], reduction="sum") / (b["y"] >= 0).sum()
                        ).kind == "unknown"
    # divided (or multiplied) by the batch's size as a number: `x.shape[0]` is a Python int, like a constant
    for scaled in (lambda b: F.mse_loss(lin(b["x"]), b["x"], reduction="sum") / b["x"].shape[0],
                   lambda b: F.mse_loss(lin(b["x"]), b["x"], reduction="sum") / len(b["x"]),
                   lambda b: F.mse_loss(lin(b["x"]), b["x"]) * b["x"].shape[0],
                   lambda b: F.cross_entropy(lin(b["x"]), b["y"], reduction="sum") / (b["x"].shape[0] * 4)):
        refused = reduction_of(scaled)
        assert refused.kind == "unknown" and "a multiple of the 3 samples traced" in refused.describe
    assert reduction_of(lambda b: F.mse_loss(lin(b["x"]), b["x"], reduction="sum") / 8.0).kind == "sum"  # a constant
