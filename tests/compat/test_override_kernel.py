"""memplan.compat.torch.override_kernel: memplan's CUDA emulation replaces kernels torch itself registered from Python
(torch._meta_registrations' Meta kernel of `_cudnn_rnn`). torch 2.11-2.12's `Library.impl` refuses that unless
`allow_override=True` (every CUDA-target estimate failed there: the H200 campaign of session 9, torch 2.11.0+cu130);
torch 2.4-2.10 have no flag and check `torch.library._impls`."""
from __future__ import annotations

import pytest
import torch

import memplan.compat.torch as compat_torch
from memplan.compat.torch import destroy_library, override_kernel

OP = "memplan_override_test::twice"


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


def test_a_kernel_registered_from_python_is_refused_without_the_override(op_with_python_kernel):
    lib = torch.library.Library("memplan_override_test", "IMPL")
    try:
        with pytest.raises(RuntimeError, match="already a kernel registered from python"):
            lib.impl("twice", lambda x: x * 3, "CPU", allow_override=False)  # torch 2.11-2.12's default
    finally:
        destroy_library(lib)


@pytest.mark.parametrize("flag", [True, False], ids=["allow_override flag", "no flag (torch 2.4-2.10)"])
def test_override_kernel_replaces_it_and_destroying_restores_it(op_with_python_kernel, monkeypatch, flag):
    impl = torch.library.Library.impl
    if flag:  # torch 2.11-2.12's Library.impl: allow_override=False unless asked
        def old_impl(self, op_name, fn, dispatch_key="", *, with_keyset=False, allow_override=False):
            return impl(self, op_name, fn, dispatch_key, with_keyset=with_keyset, allow_override=allow_override)
    else:  # torch 2.4-2.10's: no allow_override, refuses any key in torch.library._impls
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
