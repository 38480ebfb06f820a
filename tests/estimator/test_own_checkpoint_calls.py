"""A model that calls torch.utils.checkpoint inside its own forward: the estimate says so
(`own_checkpoint_calls`), however `checkpoint` was imported, reentrant or not, and memplan's own
wrapping of blocks is not mistaken for it."""
from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint as imported_checkpoint

from memplan.estimator import estimate


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Four blocks; `how` says how the forward checkpoints them itself (None: it does not)."""

    def __init__(self, how: str | None) -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Linear(16, 16)  # so a reentrant checkpoint's input requires grad
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            if self.how == "imported":  # `from torch.utils.checkpoint import checkpoint`
                x = imported_checkpoint(block, x, use_reentrant=False)
            elif self.how == "module":
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            elif self.how == "reentrant":
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
            else:
                x = block(x)
        return self.head(x).pow(2).mean()


def _batch():
    return torch.randn(8, 16, requires_grad=False)


def _estimate(how, **kwargs):
    return estimate(lambda: Net(how), _batch(), device="cpu", optimizer="sgd", loss=lambda model, batch: model(batch), **kwargs)


@pytest.mark.parametrize("how", ["imported", "module", "reentrant"])
def test_checkpoint_calls_inside_the_forward_are_counted(how):
    est = _estimate(how)
    assert est.own_checkpoint_calls >= 4  # one per block and step, whatever the import


def test_a_model_that_does_not_checkpoint_has_none_and_memplans_wrapping_is_not_counted():
    assert _estimate(None).own_checkpoint_calls == 0
    wrapped = _estimate(None, checkpointing=True)
    assert wrapped.checkpoint_mode == "full" and wrapped.own_checkpoint_calls == 0


def test_checkpoint_is_restored_after_the_trace():
    _estimate("module")
    assert torch.utils.checkpoint._checkpoint_without_reentrant_generator.__module__ == "torch.utils.checkpoint"
    assert torch.utils.checkpoint.CheckpointFunction.forward.__module__ == "torch.utils.checkpoint"
