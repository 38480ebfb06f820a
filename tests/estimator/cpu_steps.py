"""Helpers the CPU-estimate test modules share (test_estimate_cpu*.py): a small MLP step, its loss, and how an
estimate's notes say the kernel probe ran."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PROBED_NOTE = (
    "CPU kernel scratch (convolutions, LSTMs, attention, half matmuls, losses, ops copying a non-contiguous input): "
    "measured"
)
"""How an estimate's notes begin to say the kernel probe ran (memplan.estimator.kernels.probe)."""


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1000, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))


def mlp_batch():
    return torch.randn(256, 1000), torch.randint(0, 10, (256,))


def seeded_batch(samples: int, features: int, classes: int = 10):
    """(features, labels) drawn from a fixed seed: the same values on every call, so a truth and an estimate that each
    make their own take the same batch."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(samples, features, generator=g), torch.randint(0, classes, (samples,), generator=g)


def ce_loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])



def relative_error(estimated: int, truth: int) -> float:
    return abs(estimated - truth) / truth

