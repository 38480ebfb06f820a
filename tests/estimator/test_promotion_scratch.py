"""CPU dtype-promotion copies (kernels/scratch.promotion_scratch_bytes) against the real CPU kernel's peak: an input
of another dtype is copied to the common one; `where`'s boolean condition is not an operand and is never copied, nor is
`masked_fill`'s mask (counted as a float copy, it read +34 % on a model filling a full-size mask made from an
activation)."""
from __future__ import annotations

import pytest
import torch

from memplan.estimator.kernels.scratch import promotion_scratch_bytes
from memplan.truth import counted_profile, peak_total_allocated

aten = torch.ops.aten


def _real_peak_above_inputs(fn) -> int:
    with counted_profile() as prof:
        fn()
    return peak_total_allocated(prof)


def _cases():
    x = torch.randn(4, 16, 32, 32)
    cond = x > 0
    return {
        "where, bool condition, same dtypes": (aten.where.self, (cond, x, x * 2)),
        "where, bfloat16 other": (aten.where.self, (cond, x, (x * 2).bfloat16())),
        "add, bfloat16 other": (aten.add.Tensor, (x, x.bfloat16())),
        "mul, same dtypes": (aten.mul.Tensor, (x, x)),
        "masked_fill, full-size bool mask": (aten.masked_fill.Scalar, (x, cond, 0.0)),
        "masked_fill, broadcast bool mask": (aten.masked_fill.Scalar, (x, cond[:1], -1e4)),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_promotion_scratch_is_what_the_real_cpu_kernel_holds_beside_its_output(case):
    func, args = _cases()[case]
    out_bytes = func(*args).nbytes
    real = _real_peak_above_inputs(lambda: func(*args))
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    assert real == out_bytes + promotion_scratch_bytes(func, tensors), (real, out_bytes)
