"""Output layouts the real CPU kernel chooses and the meta kernel does not: each rule against the real kernel.

CPU batch norm makes its output (and the backward its grad_input) in the input's suggested memory format:
a transposed (N, L, C) activation comes out contiguous, where the meta kernel keeps the input's strides.
A later transpose + Linear then reshapes by a copy in the real run (saved for backward), by a view on fakes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import memplan.estimator.tracker as tracker
from memplan.estimator.api import estimate
from memplan.estimator.kernel_rules import CPU_LAYOUT_OPS, cpu_output_layout
from memplan.truth import measure_cpu_peak

aten = torch.ops.aten
C = 32

LAYOUTS = {
    "2d transposed": lambda: torch.randn(C, 8).t(),
    "3d transposed (N, L, C) -> (N, C, L)": lambda: torch.randn(8, 16, C).transpose(1, 2),
    "4d contiguous": lambda: torch.randn(4, C, 6, 5),
    "4d channels_last": lambda: torch.randn(4, C, 6, 5).contiguous(memory_format=torch.channels_last),
    "4d H and W swapped": lambda: torch.randn(4, C, 5, 6).transpose(2, 3),
    "5d channels_last_3d": lambda: torch.randn(2, C, 3, 4, 5).contiguous(memory_format=torch.channels_last_3d),
}


def _stats():
    return [torch.ones(C), torch.zeros(C), torch.zeros(C), torch.ones(C)]


OPS = {
    aten.native_batch_norm.default: lambda x, w, b, rm, rv: (x, w, b, rm, rv, True, 0.1, 1e-5),
    aten._native_batch_norm_legit.default: lambda x, w, b, rm, rv: (x, w, b, rm, rv, True, 0.1, 1e-5),
    aten._native_batch_norm_legit.no_stats: lambda x, w, b, rm, rv: (x, w, b, True, 0.1, 1e-5),
    aten._native_batch_norm_legit_no_training.default: lambda x, w, b, rm, rv: (x, w, b, rm, rv, 0.1, 1e-5),
    aten._native_batch_norm_legit_functional.default: lambda x, w, b, rm, rv: (x, w, b, rm, rv, True, 0.1, 1e-5),
    # grad_output contiguous, input in the layout under test: the CPU grad_input follows the input
    aten.native_batch_norm_backward.default: lambda x, w, b, rm, rv: (
        x.contiguous(), x, w, rm, rv, rm.clone(), rv.clone(), True, 1e-5, [True, True, True]),
}


def test_every_layout_rule_has_its_cases():
    assert CPU_LAYOUT_OPS == set(OPS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op", list(OPS), ids=str)
def test_batch_norm_output_layout_is_the_real_cpu_kernels(op, layout):
    real = op(*OPS[op](LAYOUTS[layout](), *_stats()))[0]
    mode = FakeTensorMode()
    with mode:
        args = OPS[op](mode.from_tensor(LAYOUTS[layout]()), *(mode.from_tensor(t) for t in _stats()))
        meta = op(*args)
        ruled = cpu_output_layout(op, args, meta)[0]
    assert (ruled.shape, ruled.stride(), ruled.dtype) == (real.shape, real.stride(), real.dtype)


class TransposedBatchNorm(nn.Module):
    """Sequence blocks normalising over channels with BatchNorm1d on (N, C, L), then a Linear on (N, L, C)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(bn=nn.BatchNorm1d(128), fc=nn.Linear(128, 128))) for _ in range(3))
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b["fc"](F.gelu(b["bn"](x.transpose(1, 2))).transpose(1, 2))
        return self.head(x.mean(1))


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 64, 128, generator=g), torch.randint(0, 10, (16,), generator=g)


def _ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def test_a_transposed_batch_norm_before_a_linear_matches_a_real_run(monkeypatch):
    truth = measure_cpu_peak(TransposedBatchNorm, _batch, loss=_ce)
    est = estimate(TransposedBatchNorm, _batch(), loss=_ce, device="cpu")
    assert abs(est.peak_allocated - truth) / truth < 0.001, (est.peak_allocated, truth)
    monkeypatch.setattr(tracker, "CPU_LAYOUT_OPS", frozenset())  # the meta kernel's strides: the copy is missed
    meta = estimate(TransposedBatchNorm, _batch(), loss=_ce, device="cpu")
    assert (meta.peak_allocated - truth) / truth < -0.05
