"""Get a fake-tensor copy of the user's model without allocating a single weight."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.estimator.errors import EstimateError
from memplan.estimator.fake_copy import copy_module_tree


def new_fake_mode() -> FakeTensorMode:
    # allow_non_fake_inputs: the user's real batch meets fake weights inside ops.
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_model(
    model: nn.Module | Callable[[], nn.Module],
    fake_mode: FakeTensorMode,
    *,
    device: torch.device,
    param_dtype: torch.dtype,
) -> nn.Module:
    """A structural copy of `model` whose parameters and buffers are fake tensors on `device`.

    A real (or meta-device) module is copied as fake_copy.py describes: its modules copied, its
    parameters and buffers fresh fakes, every other attribute shared with the original, which is
    never changed (no tensor data and no user state is copied). A zero-argument callable is
    called under the fake mode, so the model is born fake. '-true' precisions get floating-point
    parameters in `param_dtype`, as Lightning's HalfPrecision converts the module.
    """
    if isinstance(model, nn.Module):
        built = _fake_copy(model, fake_mode, device, param_dtype)
    elif callable(model):
        with fake_mode, device, _InitScalarsAsZero():
            try:
                built = model()
            except Exception as err:  # the user's builder: report it as theirs, with its own message
                raise EstimateError(
                    f"model: the callable that builds the model raised {type(err).__name__}: {err}. "
                    "Check that calling it with no arguments builds the model"
                ) from err
        if not isinstance(built, nn.Module):
            raise EstimateError(
                f"model: the callable returned {type(built).__name__}, not an nn.Module; it must build "
                "and return the model"
            )
        # Always re-made from fresh fakes: a builder that deep-copies layers under the fake mode
        # (nn.TransformerEncoder's clones) leaves parameters whose views report a storage object of
        # their own, which the tracker would count again as activations.
        built = _fake_copy(built, fake_mode, device, param_dtype)
    else:
        raise EstimateError(
            f"model must be an nn.Module or a zero-argument callable that builds one; got {type(model).__name__}"
        )
    return built.train()


def _fake_copy(model: nn.Module, fake_mode: FakeTensorMode, device: torch.device, dtype: torch.dtype) -> nn.Module:
    with fake_mode:
        return copy_module_tree(model, lambda t: _fake_like(t, device, dtype), device=device)


def _fake_like(tensor: torch.Tensor, device: torch.device, float_dtype: torch.dtype) -> torch.Tensor:
    """A fake tensor shaped like `tensor` on `device` (call under the fake mode). Floating-point
    tensors take `float_dtype` when it is not float32, as `module.to(dtype)` would give them."""
    dtype = float_dtype if tensor.is_floating_point() and float_dtype != torch.float32 else tensor.dtype
    return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=dtype, device=device)


class _InitScalarsAsZero(TorchDispatchMode):
    """While a model is built on fake tensors, answer `.item()` with zero.

    Weight initialisers sometimes read a value back (a truncation bound, a norm); a fake tensor has
    none to give. Initial values never change how much memory a step takes, so any number will do.
    Only the build runs under this mode, never the traced step."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return False if dtype == torch.bool else (0.0 if dtype.is_floating_point else 0)
        return func(*args, **(kwargs or {}))
