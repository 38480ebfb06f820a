"""Emulated CUDA autocast with ops of other libraries (torchvision::nms and the like): an op outside aten with
an AutocastCPU kernel no longer breaks the emulation; CUDA autocast leaves it alone unless the op has its own
AutocastCUDA kernel. torchvision is not installed here: the ops are defined in a test namespace."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import memplan
from memplan.estimator.target import TRACE_ON_CPU_ENV

_names = itertools.count()


class _Op:
    """A fresh op 'memplan_test::scale_N(Tensor x) -> Tensor' (x * 2) with a fake kernel that records the dtype
    it is called with, and autograd; `rules` are the devices given an autocast rule casting to float32
    (torch.library.register_autocast, as a library registers one)."""

    def __init__(self, lib: torch.library.Library, rules: tuple[str, ...]) -> None:
        self.name = f"scale_{next(_names)}"
        self.seen: list[torch.dtype] = []
        lib.define(f"{self.name}(Tensor x) -> Tensor")
        lib.impl(self.name, lambda x: x * 2, "CPU")
        qualified = f"memplan_test::{self.name}"

        def fake(x):
            self.seen.append(x.dtype)
            return torch.empty_like(x)

        torch.library.register_fake(qualified, fake, lib=lib)
        torch.library.register_autograd(qualified, lambda ctx, grad: grad * 2, lib=lib)
        for device in rules:
            torch.library.register_autocast(qualified, device, torch.float32, lib=lib)
        self.op = getattr(torch.ops.memplan_test, self.name).default


@pytest.fixture
def make_op(monkeypatch):
    monkeypatch.setenv(TRACE_ON_CPU_ENV, "1")  # emulated also where this torch has a GPU
    lib = torch.library.Library("memplan_test", "FRAGMENT")
    yield lambda *rules: _Op(lib, rules)
    lib._destroy()


class _Model(nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.op = op
        self.linear = nn.Linear(256, 256)

    def forward(self, x):
        h = self.op(self.linear(x))  # bf16 in, under autocast
        return (h * h).float().mean()  # mul saves h, in the dtype the op returned


def _estimate(op) -> memplan.MemoryEstimate:
    return memplan.estimate(_Model(op), torch.randn(4096, 256), loss=lambda model, batch: model(batch),
                            optimizer="adamw", precision="bf16-mixed", device="A100-80GB")


def test_an_op_with_only_a_cpu_autocast_rule_is_left_alone_as_cuda_autocast_does(make_op):
    with_cpu_rule, without_rule = make_op("cpu"), make_op()
    estimate = _estimate(with_cpu_rule.op)  # failed: impl("memplan_test::scale_0", ...) does not match aten
    assert with_cpu_rule.seen and set(with_cpu_rule.seen) == {torch.bfloat16}  # not cast to float32
    assert estimate.activations == _estimate(without_rule.op).activations
    # the library's own CPU rule is back once the estimate is done
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert with_cpu_rule.op(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32


def test_an_op_with_its_own_cuda_autocast_rule_keeps_its_cpu_one(make_op):
    with_both = make_op("cpu", "cuda")
    estimate = _estimate(with_both.op)
    assert with_both.seen and set(with_both.seen) == {torch.float32}
    # mul saves h in float32 (4 MiB) instead of bfloat16 (2 MiB): what the forward leaves for backward (the step's
    # peak is in the backward, at the Linear bias gradient's column sum and its staging buffer, estimator.cuda.reduce)
    assert estimate.forward_activations - _estimate(make_op().op).forward_activations == 4096 * 256 * 2
