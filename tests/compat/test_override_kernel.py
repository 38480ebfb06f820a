"""memplan.compat.torch.override_kernel: memplan's CUDA emulation replaces kernels torch itself registered from Python
(torch._meta_registrations' Meta kernel of `_cudnn_rnn`). torch 2.11's `Library.impl` refuses that unless
`allow_override=True` (every CUDA-target estimate failed there: the H200 campaign of session 9, torch 2.11.0+cu130);
releases before the flag check `torch.library._impls` alone (which ones: not checked here)."""
from __future__ import annotations

import gc

import pytest
import torch

import memplan.compat.torch as compat_torch
from memplan.compat.torch import destroy_library, override_kernel

OP = "memplan_override_test::twice"

needs_the_flag = pytest.mark.skipif(
    not compat_torch._IMPL_ALLOWS_OVERRIDE,
    reason="this torch's Library.impl has no allow_override; the 'no flag (older torch)' case is this torch's")


@pytest.fixture
def op_with_python_kernel():
    """A custom op whose CPU kernel is registered from Python, as torch registers its Python meta kernels."""
    definition = torch.library.Library("memplan_override_test", "DEF")
    definition.define("twice(Tensor x) -> Tensor")
    first = torch.library.Library("memplan_override_test", "IMPL")
    first.impl("twice", lambda x: x * 2, "CPU")
    yield torch.ops.memplan_override_test.twice.default
    destroy_library(first)
    destroy_library(definition)


@needs_the_flag
def test_a_kernel_registered_from_python_is_refused_without_the_override(op_with_python_kernel):
    lib = torch.library.Library("memplan_override_test", "IMPL")
    try:
        with pytest.raises(RuntimeError, match="already a kernel registered from python"):
            lib.impl("twice", lambda x: x * 3, "CPU", allow_override=False)  # torch 2.11's default
    finally:
        destroy_library(lib)


@pytest.mark.parametrize("flag", [pytest.param(True, marks=needs_the_flag), False],
                         ids=["allow_override flag", "no flag (older torch)"])
def test_override_kernel_replaces_it_and_destroying_restores_it(op_with_python_kernel, monkeypatch, flag):
    impl = torch.library.Library.impl
    if flag:  # torch 2.11's Library.impl: allow_override=False unless asked
        def old_impl(self, op_name, fn, dispatch_key="", *, with_keyset=False, allow_override=False):
            return impl(self, op_name, fn, dispatch_key, with_keyset=with_keyset, allow_override=allow_override)
    else:  # a torch before the flag: refuses any key in torch.library._impls
        def old_impl(self, op_name, fn, dispatch_key="", *, with_keyset=False):
            key = f"{self.ns}/{op_name.split('::')[-1]}/{dispatch_key}"
            if key in torch.library._impls:
                raise RuntimeError("This is not allowed since there's already a kernel registered from python")
            return impl(self, op_name, fn, dispatch_key, with_keyset=with_keyset)

        monkeypatch.setattr(compat_torch, "_IMPL_ALLOWS_OVERRIDE", False)
    monkeypatch.setattr(torch.library.Library, "impl", old_impl)
    x = torch.ones(2)
    lib = torch.library.Library("memplan_override_test", "IMPL")
    try:
        override_kernel(lib, "twice", lambda x: x * 3, "CPU")
        assert op_with_python_kernel(x).tolist() == [3.0, 3.0]
    finally:
        destroy_library(lib)
    assert op_with_python_kernel(x).tolist() == [2.0, 2.0]
    assert "memplan_override_test/twice/CPU" in torch.library._impls  # torch still records its own kernel


def test_an_emulated_estimate_leaves_torchs_record_of_its_own_meta_kernels():
    """memplan's CUDA emulation overrides torch's Python meta kernel of _cudnn_rnn; afterwards torch must still
    record it, or a later override in the user's process would no longer be refused."""
    from torch import nn

    from memplan.estimator.api import estimate

    assert "aten/_cudnn_rnn/Meta" in torch.library._impls
    estimate(nn.Linear(4, 4), torch.randn(2, 4), loss=lambda m, b: m(b).sum(), device="H100-80GB")
    gc.collect()  # (a library's finalizer drops its records when it is collected)
    assert "aten/_cudnn_rnn/Meta" in torch.library._impls
