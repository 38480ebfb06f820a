"""Loud rewrites: every change MemoryPlanner makes to the user's settings is one warning, before ->
after, and a line of the end-of-fit summary; strict=True refuses it, naming the setting."""
from __future__ import annotations

import logging
import warnings

import pytest
import pytorch_lightning as pl
import torch
from callback_sim import IndexedData, Regression, make_plan, weights_of
from torch.utils.data import DataLoader

from memplan.callback import MemoryPlanner
from memplan.callback.framework import MisconfigurationException


def rewrite_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("MemoryPlanner changes")]


def test_each_changed_setting_is_one_warning_and_a_summary_line(make_trainer, caplog):
    module = Regression(batch_size=16)
    planner = MemoryPlanner(make_plan(32, 2, checkpointing=True), grow=False)
    with warnings.catch_warnings(record=True) as record, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        make_trainer([planner], max_steps=1, accumulate_grad_batches=4).fit(module)
    said = rewrite_warnings(record)
    assert len(said) == 3
    assert said[0].startswith("MemoryPlanner changes `batch_size` (the train loader's batch size): 16 -> 32 (")
    assert said[1].startswith("MemoryPlanner changes Trainer(accumulate_grad_batches=...): 4 -> 2 (")
    assert said[2].startswith("MemoryPlanner changes activation checkpointing: off -> on (")
    assert module.batch_size == 32
    summary = next(r.getMessage() for r in caplog.records if "MemoryPlanner summary" in r.getMessage())
    assert "changed Trainer(accumulate_grad_batches=...): 4 -> 2" in summary
    assert "changed `batch_size` (the train loader's batch size): 16 -> 32" in summary
    assert [r.setting for r in planner.rewrites] == ["`batch_size` (the train loader's batch size)",
                                                     "Trainer(accumulate_grad_batches=...)", "activation checkpointing"]


def test_a_plan_that_keeps_the_settings_says_nothing(make_trainer):
    planner = MemoryPlanner(make_plan(16, 4), grow=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer([planner], max_steps=1, accumulate_grad_batches=4).fit(Regression(batch_size=16))
    assert rewrite_warnings(record) == [] and planner.rewrites == []


def test_strict_refuses_a_change_naming_the_setting(make_trainer):
    planner = MemoryPlanner(make_plan(32, 2), strict=True)
    with pytest.raises(MisconfigurationException, match=r"strict=True.*Trainer\(accumulate_grad_batches=...\): 4 -> 2"):
        make_trainer([planner], max_steps=1, accumulate_grad_batches=4).fit(Regression(batch_size=32))


def test_checkpointing_turned_on_mid_run_is_a_rewrite_and_strict_never_turns_it_on(make_trainer):
    # margin=0.99: every check lowers, 2 -> 1 -> checkpointing on
    planner = MemoryPlanner(make_plan(2, 1), every_n_steps=1, margin=0.99, grow=False)
    with pytest.warns(UserWarning, match=r"MemoryPlanner changes activation checkpointing: off -> on \(at step 2"):
        make_trainer([planner], max_steps=4).fit(Regression(batch_size=2))
    assert planner.rewrites[-1].setting == "activation checkpointing"
    strict = MemoryPlanner(make_plan(2, 1), every_n_steps=1, margin=0.99, grow=False, strict=True)
    make_trainer([strict], max_steps=4).fit(Regression(batch_size=2))
    assert strict.layout.micro_batch_size == 1 and not strict.layout.gradient_checkpointing and strict.rewrites == []


def test_a_precision_mismatch_is_in_the_summary(make_trainer, caplog):
    planner = MemoryPlanner(make_plan(8, 1, precision="bf16-mixed"), grow=False)
    with pytest.warns(UserWarning, match="the plan is for precision='bf16-mixed'"), caplog.at_level(logging.INFO):
        make_trainer([planner], max_steps=1).fit(Regression(batch_size=8))
    summary = next(r.getMessage() for r in caplog.records if "MemoryPlanner summary" in r.getMessage())
    assert "plan mismatch: the plan is for precision='bf16-mixed', the Trainer runs '32-true'" in summary


class OwnBatchSampler(Regression):
    """A `batch_size` attribute the loader does not read: its own batch sampler yields 8 (a bucketing sampler)."""

    def train_dataloader(self):
        from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

        from callback_sim import IndexedData

        data = IndexedData()
        return DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), batch_size=8, drop_last=False))


def test_a_loader_with_its_own_batch_sampler_keeps_its_batch_and_accumulation(make_trainer):
    # the attribute is 8 and the plan says 4 x accumulate 2: setting the attribute would change nothing the loader
    # does, and the accumulation raised to 2 would double the global batch (it did: 16 samples a step)
    from test_callback_chunking import assert_trained_like_full_batches

    module = OwnBatchSampler(batch_size=8)
    planner = MemoryPlanner(make_plan(4, 2), grow=False)
    trainer = make_trainer([planner], max_steps=3)
    trainer.fit(module)
    assert module.batch_size == 8 and trainer.accumulate_grad_batches == 1
    assert (planner.layout.loader_batch_size, planner.layout.micro_batch_size) == (8, 4)
    assert not planner.rewrites
    assert_trained_like_full_batches(module, 8, steps=3)


class HalvedShuffledLoader(Regression):
    """A loader that reads the attribute (halved, as a script dividing a global batch over 2 replicas does) and
    draws its order from the global generator each time it is built."""

    def train_dataloader(self):
        from torch.utils.data import DataLoader, Subset

        from callback_sim import IndexedData

        data = IndexedData()
        self.orders.append(torch.randperm(len(data)).tolist())
        return DataLoader(Subset(data, self.orders[-1]), batch_size=self.batch_size // 2)


def test_a_loader_scaling_the_attribute_keeps_its_batch_and_building_it_moves_no_generator(make_trainer, caplog):
    # the loader's batch is the attribute halved: setting it to the micro-batch would halve the global batch, so
    # the loader keeps its 8 and runs them as chunks of 4 (named at fit start); the check builds the loader twice
    # more and leaves the global generator where it was: the run's loader draws the order a run without it draws
    module = HalvedShuffledLoader(batch_size=16)
    module.orders = []
    planner = MemoryPlanner(make_plan(4, 2), grow=False)
    torch.manual_seed(5)
    with caplog.at_level(logging.INFO):
        make_trainer([planner], max_steps=1).fit(module)
    assert "it yields 8 for `batch_size`=16 and 16 for 32, not the attribute itself" in caplog.text
    assert module.batch_size == 16 and not planner.rewrites
    assert (planner.layout.loader_batch_size, planner.layout.micro_batch_size) == (8, 4)
    plain = HalvedShuffledLoader(batch_size=16)
    plain.orders = []
    torch.manual_seed(5)
    make_trainer([], max_steps=1).fit(plain)
    assert module.orders[-1] == plain.orders[-1] and len(module.orders) > len(plain.orders)


class Tail(Regression):
    """60 samples: batches of 8 leave a last batch of 4, which Lightning trains as one step's mean."""

    def train_dataloader(self):
        return DataLoader(IndexedData(60), batch_size=self.batch_size, shuffle=False)


@pytest.mark.parametrize("case", ["epoch tail", "limit_train_batches", "val_check_interval"])
def test_a_rewrite_that_changes_what_an_epoch_trains_is_not_made_and_the_batch_runs_as_chunks(make_trainer, case):
    """A batch of 8 planned as 2 with accumulation 4 trains other weights where the Trainer counts loaded batches
    (limit_train_batches=4: 16 samples an epoch instead of 64; val_check_interval=4: validation 4 times as often) or
    the epoch ends on a short batch (its gradient was quartered); the loaded batch is kept and runs as chunks."""
    module = Tail(batch_size=8) if case == "epoch tail" else Regression(batch_size=8)
    overrides = {"limit_train_batches": 4} if case == "limit_train_batches" else (
        {"val_check_interval": 4, "limit_val_batches": 0} if case == "val_check_interval" else {})
    planner = MemoryPlanner(make_plan(2, 4), grow=False, adjust=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([planner], max_steps=8, max_epochs=2, **overrides).fit(module)
    assert module.batch_size == 8 and planner.layout.chunks == 4
    assert {"epoch tail": "last batch"}.get(case, case) in planner.exactness.no_rewrite
    whole = Tail(batch_size=8) if case == "epoch tail" else Regression(batch_size=8)
    make_trainer([], max_steps=8, max_epochs=2, **overrides).fit(whole)
    assert module.step_samples == whole.step_samples
    for name, value in weights_of(whole).items():
        torch.testing.assert_close(weights_of(module)[name], value, rtol=0, atol=1e-12, msg=name)


class HparamsBatch(Regression):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__(batch_size=batch_size, with_attr=False)
        self.save_hyperparameters()

    def train_dataloader(self):
        return DataLoader(IndexedData(), batch_size=self.hparams.batch_size, shuffle=False)


def test_checkpoints_save_the_users_batch_size_not_the_rewritten_one(make_trainer, tmp_path):
    """The rewrite (batch 8 -> 2, accumulation 1 -> 4) is the fit's: every checkpoint saved hparams.batch_size=2
    without the accumulation (a Trainer argument), so a model loaded without memplan trained at a global batch of 2."""
    module = HparamsBatch(batch_size=8)
    seen = {}

    class Peek(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault("during", pl_module.hparams.batch_size)

    trainer = make_trainer([MemoryPlanner(make_plan(2, 4), grow=False, adjust=False), Peek()], max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    assert seen["during"] == 2 and trainer.accumulate_grad_batches == 4  # the rewrite ran
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    assert HparamsBatch.load_from_checkpoint(tmp_path / "last.ckpt").hparams.batch_size == 8
