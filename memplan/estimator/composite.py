"""Composite ops that take another path on fake tensors than on real ones.

ATen's composite ops pick an in-place variant only for plain tensors: `isTensorSubclassLike` is true
for a fake tensor (and under any dispatch mode), and then they use the out-of-place op "for
composite compliance". The out-of-place op allocates a second output where the real kernel reuses
the first, so a trace would count one output more than a real run holds.

`F.linear` is the one that matters (aten/src/ATen/native/Linear.cpp, torch 2.4 to 2.13): with a
bias and an input that is neither 2-D (addmm) nor contiguous (flattened into addmm), it runs
`matmul(input, weight.t())` and then adds the bias in place; on fake tensors it adds out of place.
That input is an RNN's batch-first output, or any transposed activation, fed to a Linear.
`RealCompositePaths` runs that case as the real kernel does, op for op.
"""
from __future__ import annotations

import os

import torch
from torch.overrides import TorchFunctionMode

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


class RealCompositePaths(TorchFunctionMode):
    """While active, `F.linear` on a non-contiguous input adds its bias in place, as on real tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEAR:
            input, weight, bias = _linear_arguments(*args, **kwargs)
            if _adds_bias_in_place(input, bias):
                return torch.matmul(input, weight.t()).add_(bias)
        return func(*args, **kwargs)


def _linear_arguments(input, weight, bias=None):
    return input, weight, bias


def _adds_bias_in_place(input, bias) -> bool:
    """The branch of ATen's `linear` that ends in `output.add_(bias)` on real tensors (under autocast,
    which casts the arguments first, the op is left as it is)."""
    if bias is None or not isinstance(input, torch.Tensor) or input.dim() in (0, 2) or input.is_contiguous():
        return False
    if input.dim() == 3 and os.environ.get("TORCH_LINEAR_FLATTEN_3D", "0") == "1":
        return False  # the env var flattens a non-contiguous 3-D input into addmm instead
    return not torch.is_autocast_enabled(input.device.type)
