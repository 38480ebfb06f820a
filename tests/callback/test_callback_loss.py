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


@pytest.mark.parametrize(("reduction", "options"), [
    ("sum", dict()),  # a sum loss weighted as a per-sample mean
    ("mean", dict()),  # a token mean weighted by samples
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
