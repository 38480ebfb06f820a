"""Merging a split batch's `self.log` calls into the whole batch's (memplan.callback.logged)."""
from __future__ import annotations

import pytest
import torch

from memplan.callback.logged import merge_logged


def call(name, value, **kwargs):
    return (name, value), kwargs


def values(calls):
    return {args[0]: (args[1] if len(args) > 1 else kwargs["value"]) for args, kwargs in calls}


def test_values_merge_by_their_reduce_fx_with_the_losses_weights():
    chunks = [
        (0.25, [call("loss", torch.tensor(4.0)), call("n", 2, reduce_fx="sum"), call("top", 1.0, reduce_fx="max")]),
        (0.75, [call("loss", torch.tensor(8.0)), call("n", 6, reduce_fx="sum"), call("top", 3.0, reduce_fx=torch.max)]),
    ]
    merged = values(merge_logged(chunks, summed_loss=False))
    assert merged["loss"].item() == pytest.approx(0.25 * 4 + 0.75 * 8) and merged["n"] == 8 and merged["top"] == 3.0
    # a sum loss: each chunk weighs 1 and the loss logged is the batch's sum
    assert values(merge_logged(chunks, summed_loss=True))["loss"].item() == 12.0


def test_a_key_logged_by_some_chunks_is_their_weighted_mean_and_batch_size_adds_up():
    chunks = [(0.5, [call("acc", 1.0, batch_size=3)]), (0.25, [call("acc", 0.0, batch_size=1)]), (0.25, [])]
    ((args, kwargs),) = merge_logged(chunks, summed_loss=False)
    assert args[1] == pytest.approx(2 / 3) and kwargs["batch_size"] == 4


def test_what_cannot_be_merged_keeps_the_last_chunks_value_with_a_warning():
    metric = object()  # stands in for a torchmetrics Metric object
    chunks = [(0.5, [call("acc", metric)]), (0.5, [call("acc", metric)])]
    with pytest.warns(UserWarning, match=r"self.log\('acc', ...\) .* logs the last chunk's value"):
        ((args, _),) = merge_logged(chunks, summed_loss=False)
    assert args[1] is metric
