"""Composite ops that take another path on fake tensors than on real ones.

ATen's composite ops pick an in-place variant only for plain tensors: `isTensorSubclassLike` is true
for a fake tensor (and under any dispatch mode), and then they use the out-of-place op "for
composite compliance". The out-of-place op allocates a second output where the real kernel reuses
the first, so a trace would count one output more than a real run holds.

`F.linear` is the one that matters (aten/src/ATen/native/Linear.cpp, torch 2.4 to 2.13): with a
bias and an input that is neither 2-D (addmm) nor contiguous (flattened into addmm), it runs
`matmul(input, weight.t())` and then adds the bias in place; on fake tensors it adds out of place.
That input is an RNN's batch-first output, or any transposed activation, fed to a Linear (MLP-Mixer's
token mixing). `RealCompositePaths` runs that case as the real kernel does, op for op. Under autocast
the arguments are cast (and the weight's cast cached) inside the call, so the call is left to run and
`linear_bias_add_in_place()` tells the storage tracker that its bias `add` is the real kernel's
`add_`: the matmul's output dies with it, and the trace counts the moment without the second output.
"""
from __future__ import annotations

import os
import threading

import torch
from torch.overrides import TorchFunctionMode

from memplan.compat.torch import linear_binding

_LINEAR = (linear_binding, torch.nn.functional.linear)


_STATE = threading.local()


def linear_bias_add_in_place() -> bool:
    """True inside an autocast `F.linear` whose real kernel adds its bias in place (see the module doc)."""
    return getattr(_STATE, "bias_add_in_place", False)


class RealCompositePaths(TorchFunctionMode):
    """While active, `F.linear` on a non-contiguous input adds its bias in place, as on real tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEAR:
            input, weight, bias = _linear_arguments(*args, **kwargs)
            path = _bias_add_path(input, bias)
            if path == "run in place":
                return torch.matmul(input, weight.t()).add_(bias)
            if path == "mark in place":
                before = linear_bias_add_in_place()
                _STATE.bias_add_in_place = True
                try:
                    return func(*args, **kwargs)
                finally:
                    _STATE.bias_add_in_place = before
        return func(*args, **kwargs)


def _linear_arguments(input, weight, bias=None):
    return input, weight, bias


def _bias_add_path(input, bias) -> str | None:
    """Whether ATen's `linear` ends in `output.add_(bias)` on real tensors, and how the trace follows it:
    "run in place" (no autocast: run the op's own ops), "mark in place" (autocast casts the arguments
    inside the call, so the call runs and its bias add is marked), or None (addmm, or out of place)."""
    if bias is None or not isinstance(input, torch.Tensor) or input.dim() in (0, 2) or input.is_contiguous():
        return None
    if input.dim() == 3 and os.environ.get("TORCH_LINEAR_FLATTEN_3D", "0") == "1":
        return None  # the env var flattens a non-contiguous 3-D input into addmm instead
    device = input.device.type
    if not torch.is_autocast_enabled(device):
        return "run in place"
    if type(bias).__name__ == "DTensor":
        return None  # a tensor-subclass bias takes the out-of-place add on real tensors too
    # autocast casts a floating input (not float64) to its dtype keeping the strides of a dense one
    # (else the copy is contiguous and goes to addmm); one already in that dtype is not cast
    if input.dtype == torch.get_autocast_dtype(device):
        return "mark in place"
    if input.is_floating_point() and input.dtype != torch.float64 and _non_overlapping_and_dense(input):
        return "mark in place"
    return None


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether some permutation of `t`'s dims is contiguous: `empty_like` (and so a cast) keeps its
    strides (c10 TensorImpl's is_non_overlapping_and_dense)."""
    expected = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride()) if d[0] != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True
