"""Helpers for the tests of emulate_cuda (test_cuda_semantics.py, test_cuda_sdpa.py): the dtypes, what autograd
saves while a function runs, CUDA autocast emulated on CPU, and the real/fake tensor modes each test runs in."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.estimator.cuda.semantics import emulate_cuda

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def saved_tensors(fn):
    """fn()'s result and the (shape, dtype) of every tensor autograd saved while it ran."""
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return result, saved


@contextlib.contextmanager
def cuda_autocast(dtype=BF16, compute_capability=(9, 0)):
    with emulate_cuda(compute_capability=compute_capability, autocast_dtype=dtype):
        with torch.autocast("cpu", dtype=dtype):
            yield


def fake_mode():
    return FakeTensorMode(allow_non_fake_inputs=True)


def modes():
    """Real CPU tensors, then fake ones."""
    return pytest.mark.parametrize("mode", [contextlib.nullcontext, fake_mode], ids=["real", "fake"])
