"""CPU linear algebra's own buffers (matrix_exp's Pade terms, LAPACK's work arrays): probed, as convolutions are.

A model whose weight is the matrix exponential of a parameter (as parametrizations.orthogonal makes one) peaks
inside matrix_exp's backward, which exponentiates a matrix twice the size; a trace of fake tensors sees none of
the kernel's buffers there (the held-out sweep's orthogonal RNN read -9.9 %).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator.api import estimate
from memplan.estimator.kernels import probe as kernel_probe
from memplan.truth import measure_cpu_peak


class ExpWeight(nn.Module):
    """y = x @ exp(A): A's 1-norm is far past theta_18, so matrix_exp takes its largest path, as the probe does."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(192, 192, generator=torch.Generator().manual_seed(0)))
        self.head = nn.Linear(192, 10)

    def forward(self, x):
        return self.head(x @ torch.linalg.matrix_exp(self.a * 0.1))


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 192, generator=g), torch.randint(0, 10, (8,), generator=g)


def _ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def test_a_peak_inside_matrix_exp_is_counted(monkeypatch):
    truth = measure_cpu_peak(ExpWeight, _batch, loss=_ce)
    est = estimate(ExpWeight, _batch(), loss=_ce, device="cpu")
    assert abs(est.peak_allocated - truth) / truth < 0.001, (est.peak_allocated, truth)
    assert any("matrix_exp" in note for note in est.notes)
    monkeypatch.setattr(kernel_probe, "_PROBED_OPS", kernel_probe._PROBED_OPS - kernel_probe._LINALG)
    unprobed = estimate(ExpWeight, _batch(), loss=_ce, device="cpu")
    assert (unprobed.peak_allocated - truth) / truth < -0.05


@pytest.mark.parametrize("op, make", [
    (torch.ops.aten.linalg_qr.default, lambda g: (torch.randn(96, 48, generator=g),)),
    (torch.ops.aten._linalg_svd.default, lambda g: (torch.randn(96, 48, generator=g),)),
    (torch.ops.aten._linalg_eigh.default, lambda g: (torch.randn(64, 64, generator=g) * 2,)),
    (torch.ops.aten._linalg_solve_ex.default,
     lambda g: (torch.randn(64, 64, generator=g) + 64 * torch.eye(64), torch.randn(64, 8, generator=g))),
])
def test_lapack_scratch_depends_on_the_shape_alone(op, make, monkeypatch):
    """The probe runs LAPACK ops on zeros: their buffers must be what random inputs of that shape take."""
    args = make(torch.Generator().manual_seed(0))
    on_zeros = kernel_probe._measure(op, args, {})
    monkeypatch.setattr(kernel_probe, "_real", lambda value: value)  # the probe's run on the values themselves
    assert on_zeros == kernel_probe._measure(op, args, {}) > 0


def test_matrix_exp_is_probed_at_its_largest_path(monkeypatch):
    small = torch.full((64, 64), 1e-8)
    monkeypatch.setattr(kernel_probe, "_worst_case_input", lambda a: a.copy_(small))
    at_small_norm = kernel_probe._measure(torch.ops.aten.linalg_matrix_exp.default, (small,), {})
    monkeypatch.undo()
    worst = kernel_probe._measure(torch.ops.aten.linalg_matrix_exp.default, (small,), {})
    assert worst >= 2 * at_small_norm > 0


def test_linear_algebra_probes_count_their_work_so_the_flop_limit_bounds_them():
    # a 2048-wide orthogonal weight exponentiates a 4096 x 4096 matrix in its backward: ~10^12 FLOP, past the
    # per-op limit, so it is not run at fit start (named in the notes as skipped); a 64-wide one is probed
    probe = kernel_probe

    for func in probe._LINALG:
        big, small = torch.empty(4096, 4096, device="meta"), torch.empty(64, 64, device="meta")
        assert probe._forward_flops(func, probe._flops(func, (big,), None)) > probe.PROBE_MAX_FLOPS, func
        assert 0 < probe._forward_flops(func, probe._flops(func, (small,), None)) < probe.PROBE_MAX_FLOPS, func
