"""Loss semantics and logged values when MemoryPlanner splits a batch into chunks: a split batch must
train, and log, as the whole batch does, for every reduction MemoryPlanner(loss_reduction=, mean_over=)
supports. Each split run is compared with the same module trained whole, without MemoryPlanner."""
from __future__ import annotations

import warnings

import pytest
import torch
from callback_sim import RecordingLogger, make_plan
from loss_sim import TokenLM, real_tokens, weighted_tokens, weights_of

from memplan.callback import MemoryPlanner
from memplan.callback.framework import MisconfigurationException

STEPS = 4


def train(make_trainer, tmp_path, name, reduction, planner=None):
    module = TokenLM(batch_size=8, reduction=reduction)
    logger = RecordingLogger(tmp_path / name)
    trainer = make_trainer([planner] if planner else [], max_steps=STEPS, logger=logger, log_every_n_steps=1,
                           default_root_dir=tmp_path / name)
    trainer.fit(module)
    logged = [m for m in logger.metrics if "train_loss" in m]
    return weights_of(module), logged


def assert_same_weights(got, expected, *, exact=True):
    for name in expected:
        if exact:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-12, msg=name)
    if not exact:
        assert any(not torch.allclose(got[n], expected[n], rtol=0, atol=1e-6) for n in expected)


# The loader's 8 samples (no batch_size attribute on TokenLM) run as 4 chunks of 2, whose
# real-token counts differ from their sample counts.
@pytest.mark.parametrize(("reduction", "options"), [
    ("sum", dict(loss_reduction="sum")),
    ("mean", dict(loss_reduction="mean", mean_over=weighted_tokens)),
])
def test_a_split_batch_trains_and_logs_as_the_whole_batch(make_trainer, tmp_path, reduction, options):
    whole, whole_logged = train(make_trainer, tmp_path, "whole", reduction)
    planner = MemoryPlanner(make_plan(2, 4), grow=False, adjust=False, **options)
    with pytest.warns(UserWarning, match="runs as chunks of 2"):
        split, split_logged = train(make_trainer, tmp_path, "split", reduction, planner)
    assert planner.layout.chunks == 4
    assert_same_weights(split, whole)
    # one logged row per step, describing the whole batch: the batch's loss, its 8 samples
    assert [m["step"] for m in split_logged] == [m["step"] for m in whole_logged]
    for got, expected in zip(split_logged, whole_logged):
        assert got["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-12)
        assert got["samples"] == expected["samples"] == 8


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_the_loss_is_recognised_by_default_and_a_split_batch_trains_as_the_whole(make_trainer, tmp_path, reduction):
    # cross_entropy(..., weight=batch['class_weights'], ignore_index=-100, reduction=...): recognised from a
    # trace of the step, each chunk weighted by its class-weighted count of real tokens (or summed)
    whole, _ = train(make_trainer, tmp_path, "whole", reduction)
    planner = MemoryPlanner(make_plan(2, 4), grow=False, adjust=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split, _ = train(make_trainer, tmp_path, "split", reduction, planner)
    assert_same_weights(split, whole)
    assert planner.exactness.reduction.kind == ("sum" if reduction == "sum" else "mean_count")
    assert "batch['class_weights']" in planner.exactness.reduction.describe or reduction == "sum"


@pytest.mark.parametrize(("reduction", "options"), [
    ("sum", dict(loss_reduction="mean")),  # a sum loss declared a per-sample mean
    ("mean", dict(loss_reduction="mean")),  # a token mean declared a mean over samples
    ("mean", dict(mean_over=real_tokens)),  # a class-weighted token mean weighted by token counts
])
def test_the_wrong_reduction_trains_differently(make_trainer, tmp_path, reduction, options):
    # the tests above can fail: a reduction that is not the loss's changes training
    whole, _ = train(make_trainer, tmp_path, "whole", reduction)
    planner = MemoryPlanner(make_plan(2, 4), grow=False, adjust=False, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split, _ = train(make_trainer, tmp_path, "split", reduction, planner)
    assert_same_weights(split, whole, exact=False)


def test_loss_arguments_are_checked():
    with pytest.raises(ValueError, match="loss_reduction"):
        MemoryPlanner(loss_reduction="token")
    with pytest.raises(ValueError, match="mean_over"):
        MemoryPlanner(mean_over=3)
    with pytest.raises(ValueError, match="mean_over"):
        MemoryPlanner(loss_reduction="sum", mean_over=real_tokens)


class ShortOfMemory(TokenLM):
    """SIMULATED device memory: a forward of more than 3 samples raises torch.OutOfMemoryError."""

    def training_step(self, batch, batch_idx):
        if len(batch["input_ids"]) > 3:
            raise torch.OutOfMemoryError("SIMULATED out of memory: more than 3 samples")
        return super().training_step(batch, batch_idx)


def test_a_batch_split_by_an_oom_retry_weighs_its_chunks_by_mean_over(make_trainer, tmp_path):
    whole, whole_logged = train(make_trainer, tmp_path, "whole", "mean")
    module = ShortOfMemory(batch_size=8)
    planner = MemoryPlanner(make_plan(8, 1), mean_over=weighted_tokens, every_n_steps=100, grow=False)
    logger = RecordingLogger(tmp_path / "retried")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([planner], max_steps=STEPS, logger=logger, log_every_n_steps=1).fit(module)
    retries = [line for line in planner.log_path.read_text().splitlines() if '"oom_retry"' in line]
    assert len(retries) == 2  # 8 -> 4 -> 2: the batch ran as chunks of 2
    assert_same_weights(weights_of(module), whole)
    logged = [m for m in logger.metrics if "train_loss" in m]
    assert [m["train_loss"] for m in logged] == pytest.approx([m["train_loss"] for m in whole_logged], rel=1e-12)


def test_the_first_split_warns_once_naming_batch_norm(make_trainer, tmp_path):
    class WithNorm(TokenLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.norm = torch.nn.BatchNorm1d(7, dtype=torch.float64)

    # by default (exact=True) refused: BatchNorm's statistics over a chunk are not the batch's
    with pytest.raises(MisconfigurationException, match=r"BatchNorm1d layers normalise over the batch they see.*"
                                                        r"MemoryPlanner\(exact=False\)"):
        make_trainer([MemoryPlanner(make_plan(2, 4), adjust=False)], max_steps=2).fit(WithNorm(batch_size=8))
    planner = MemoryPlanner(make_plan(2, 4), adjust=False, exact=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer([planner], max_steps=2).fit(WithNorm(batch_size=8))
    said = [str(w.message) for w in record if "runs as chunks of" in str(w.message)]
    assert len(said) == 1
    assert "BatchNorm1d layers normalise over each chunk" in said[0] and "contrastive" in said[0]


@pytest.mark.parametrize(("reduction", "options"), [
    ("sum", dict(loss_reduction="sum")),
    ("mean", dict(loss_reduction="mean", mean_over=weighted_tokens)),
])
def test_a_settable_batch_size_is_split_not_accumulated_for_a_loss_that_is_no_sample_mean(
        make_trainer, tmp_path, reduction, options):
    # With a batch-size attribute MemoryPlanner could set the loader's batch to the micro-batch and let
    # Lightning accumulate, but Lightning weighs each loaded batch 1/accumulate_grad_batches: a sum (x4 too
    # small) or a token mean (weighted by batches, not tokens) would train differently. It splits instead.
    whole, _ = train(make_trainer, tmp_path, "whole", reduction)
    planner = MemoryPlanner(make_plan(2, 4), grow=False, adjust=False, batch_arg_name="loader_batch", **options)
    with pytest.warns(UserWarning, match="runs as chunks of 2"):
        split, _ = train(make_trainer, tmp_path, "split", reduction, planner)
    layout = planner.layout
    assert (layout.loader_batch_size, layout.chunks, layout.accumulate_grad_batches) == (8, 4, 1)
    assert_same_weights(split, whole)


def test_the_loader_is_kept_only_where_the_plan_keeps_the_global_batch_it_runs():
    from memplan.callback.apply import layout_from_plan

    def layout(plan, keep):
        got = layout_from_plan(plan, world_size=1, loader_batch_size=8, settable=True, keep_accumulation=keep)
        return got.loader_batch_size, got.micro_batch_size, got.accumulate_grad_batches

    assert layout(make_plan(2, 4), keep=1) == (8, 2, 1)  # global 8 kept: split the loaded 8
    assert layout(make_plan(2, 8), keep=2) == (8, 2, 2)  # the Trainer's own accumulation of 2 kept
    assert layout(make_plan(2, 8), keep=1) == (2, 2, 8)  # another global batch: the plan as written
    assert layout(make_plan(2, 4), keep=None) == (2, 2, 4)  # a per-sample mean: Lightning accumulates
