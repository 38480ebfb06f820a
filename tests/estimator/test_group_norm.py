"""CPU group norm against real runs (memplan.truth): under bf16-mixed a GroupNorm keeps its float32 weight (CPU autocast
does not cast group_norm), and the mixed-type CPU kernel keeps float32 statistics and gives the backward's grad_input
the input's dtype, where the meta kernels give bf16 statistics and a float32 grad_input (+48 %: a float32 gradient and
its cast); its backward also holds N x C sums, now probed (-0.77 % fp32)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from cpu_steps import ce_loss, seeded_batch

from memplan.estimator.api import estimate
from memplan.estimator.kernels.rules import cpu_output_layout
from memplan.truth import measure_cpu_peak

aten = torch.ops.aten


class Grouped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(64, 1024)
        self.g = nn.GroupNorm(8, 32)
        self.h = nn.Linear(1024, 10)

    def forward(self, x):
        return self.h(self.g(self.a(x).view(-1, 32, 32)).flatten(1))


def _batch():
    return seeded_batch(256, 64)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true", "bf16-true"])
def test_group_norm_estimate_is_the_real_cpu_peak(precision):
    est = estimate(Grouped, _batch(), loss=ce_loss, device="cpu", precision=precision, optimizer="sgd")
    truth = measure_cpu_peak(Grouped, _batch, loss=ce_loss, precision=precision, optimizer="sgd")
    assert abs(est.peak_allocated - truth) / truth < 0.0005, (est.peak_allocated, truth)


@pytest.mark.parametrize("input_dtype, weight_dtype", [
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32)])
def test_group_norm_rule_gives_the_real_kernels_dtypes(input_dtype, weight_dtype):
    def run(device):
        x = torch.randn(4, 32, 16, device=device).to(input_dtype)
        w, b = torch.ones(32, device=device, dtype=weight_dtype), torch.zeros(32, device=device, dtype=weight_dtype)
        args = (x, w, b, 4, 32, 16, 8, 1e-5)
        out = cpu_output_layout(aten.native_group_norm.default, args, aten.native_group_norm.default(*args))
        back = (torch.ones_like(out[0]), x, out[1], out[2], w, 4, 32, 16, 8, [True, True, True])
        grads = cpu_output_layout(aten.native_group_norm_backward.default, back,
                                  aten.native_group_norm_backward.default(*back))
        return [t.dtype for t in (*out, *grads)]

    assert run("meta") == run("cpu")
