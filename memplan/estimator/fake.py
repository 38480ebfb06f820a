"""Get a fake-tensor copy of the user's model without allocating a single weight."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from memplan.compat.torch import (
    FAKE_TENSOR_LOGGER,
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,
    TorchDispatchMode,
    disable_current_modes,
    op_schema,
)
from memplan.batching import map_tensors
from memplan.estimator.errors import EstimateError
from memplan.estimator.fake_copy import copy_module_tree
from memplan.estimator.op_tensors import tensors_in
from memplan.estimator.tracker import REAL_FACTORY_MAX_NUMEL


@contextlib.contextmanager
def quiet_fake_tensor_log():
    """FakeTensorMode logs a full traceback at ERROR when a meta kernel rejects its inputs (a batch the
    model cannot take); memplan turns that failure into one EstimateError, so the log is noise."""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


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
    called under the fake mode, so the model is born fake (small tensors of its configuration
    real: _BuildMode). '-true' precisions get floating-point
    parameters in `param_dtype`, as Lightning's HalfPrecision converts the module.
    """
    if isinstance(model, nn.Module):
        built = _fake_copy(model, fake_mode, device, param_dtype)
    elif callable(model):
        build = _BuildMode()
        try:
            with fake_mode, device, build:
                built = model()
        except Exception as err:  # the user's builder: report it as theirs, with its own message
            built = _built_on_meta(model)  # (torch refuses some conversions of fake parameters that meta allows)
            if built is None:
                cause = (f"{type(err).__name__}: {err} (while building on fake tensors, before any training step "
                         f"ran{build.answered_reads()})")
                raise EstimateError(
                    argument="model", stage="build", cause=cause, detail=f"the callable that builds the model raised "
                    f"{cause}", fix="Check that calling it with no arguments builds the model; if it does, this is "
                    "memplan's to fix: report it with this message"
                ) from err
        if not isinstance(built, nn.Module):
            raise EstimateError(argument="model", stage="build", detail=f"the callable returned "
                                f"{type(built).__name__}, not an nn.Module; it must build and return the model")
        # Always re-made from fresh fakes: a builder that deep-copies layers under the fake mode
        # (nn.TransformerEncoder's clones) leaves parameters whose views report a storage object of
        # their own, which the tracker would count again as activations.
        built = _fake_copy(built, fake_mode, device, param_dtype)
    else:
        raise EstimateError(
            f"model must be an nn.Module or a zero-argument callable that builds one; got {type(model).__name__}"
        )
    return built.train()


def batch_on_device(batch: Any, device: torch.device, fake_mode: FakeTensorMode) -> Any:
    """`batch` with every tensor on the trace's `device`, whatever device the user's batch is on (call with
    the trace's dispatch modes disabled). A tensor elsewhere is moved by `Tensor.to(device)`, as Lightning's
    `transfer_batch_to_device` moves a batch (dtype and shape kept, the strides of a dense tensor kept, a
    view copied as its own elements): a real one (on a GPU, while the trace runs on the CPU) keeps its
    values, which the trace reads where the batch decides a shape; a meta one, which has none, becomes a
    fake on `device`. A real tensor already there is copied, storage for storage (`own_copies`), so an
    in-place op of the step (`x.mul_(2)`) leaves the caller's batch as it was. `Tensor.to` and
    `Tensor.clone` are what a loss watcher follows (memplan.callback.loss_reduction)."""
    copies: dict[int, torch.UntypedStorage] = {}
    return map_tensors(batch, lambda t: _own_copy(t, copies) if t.device == device
                       else to_trace_device(t, device, fake_mode))


def _own_copy(tensor: torch.Tensor, copies: dict[int, torch.UntypedStorage]) -> torch.Tensor:
    """A real `tensor` on its own copy of its storage (`copies`: the storages copied so far, by the data
    pointer of the original, so tensors that share one still do). One that is its storage's only view
    (the common batch) is copied by `Tensor.clone`, which a torch-function watcher sees; a view into a
    larger storage keeps that whole storage, copied, as the caller's tensor does."""
    if type(tensor) is not torch.Tensor or tensor.device.type == "meta" or tensor.layout != torch.strided \
            or tensor.is_nested or tensor.is_quantized:
        return tensor  # (a fake, a meta, a sparse or a subclass tensor: as the caller's)
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    whole = tensor.storage_offset() == 0 and tensor.is_contiguous() \
        and tensor.numel() * tensor.element_size() == storage.nbytes()
    if whole and key not in copies:
        copy = tensor.detach().clone().requires_grad_(tensor.requires_grad)
        copies[key] = copy.untyped_storage()
        return copy
    if key not in copies:
        copies[key] = storage.clone()
    with torch.no_grad():
        copy = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
            copies[key], tensor.storage_offset(), tensor.shape, tensor.stride())
    return copy.requires_grad_(tensor.requires_grad)


def to_trace_device(tensor: torch.Tensor, device: torch.device, fake_mode: FakeTensorMode) -> torch.Tensor:
    """`tensor.to(device)`: a real copy with its values, or, for a meta tensor (no values), a fake."""
    if tensor.device.type == "meta":
        with fake_mode:
            return tensor.to(device)
    with disable_current_modes():
        return tensor.to(device)


def _built_on_meta(build: Callable[[], nn.Module]) -> nn.Module | None:
    """The model `build` makes on the meta device, or None where that fails too. For a builder that fails
    on fake tensors only: `module.to(dtype)` swaps a fake parameter for its converted copy, which torch
    refuses where the fake mode holds a weak reference to it ("Couldn't swap Conv2d.weight"), while a
    meta parameter is converted in place. Values read back from meta tensors raise, so this comes second."""
    try:
        with torch.device("meta"):
            built = build()
    except Exception:
        return None
    return built if isinstance(built, nn.Module) else None


def _fake_copy(model: nn.Module, fake_mode: FakeTensorMode, device: torch.device, dtype: torch.dtype) -> nn.Module:
    with fake_mode:
        return copy_module_tree(model, lambda t: _fake_like(t, device, dtype), device=device,
                                move=lambda t: to_trace_device(t, device, fake_mode))


def _fake_like(tensor: torch.Tensor, device: torch.device, float_dtype: torch.dtype) -> torch.Tensor:
    """A fake tensor shaped like `tensor` on `device` (call under the fake mode). Floating-point
    tensors take `float_dtype` when it is not float32, as `module.to(dtype)` would give them."""
    dtype = float_dtype if tensor.is_floating_point() and float_dtype != torch.float32 else tensor.dtype
    return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=dtype, device=device)


class _BuildMode(TorchDispatchMode):
    """While a model is built: small tensors the builder computes from its own numbers are real, and
    a value read back from a fake weight is answered.

    A builder computes structure from tensors of its configuration (`torch.tensor(config.depths)
    .cumsum(0).tolist()` for a backbone's stage boundaries, `torch.linspace(0, rate, depth)` for its
    drop-path rates): as in the trace (memplan.estimator.tracker), an op whose tensor inputs are all
    real runs for real, and a factory with no tensor input and at most REAL_FACTORY_MAX_NUMEL elements
    on the CPU is made real, so those numbers are the real ones and the model has the real structure.
    Weights stay fake (and every parameter and buffer, real or not, is re-made a fresh fake after the
    build). A value read back from a fake (a truncation bound, a norm, a parametrization's `allclose`
    check) has none to give: a check is taken as passing (True) and a number as 0, except that `any()` of
    a fake reads False: no element is exceptional, so a NaN check passes and a rejection loop ends
    (`nn.init.trunc_normal_` resamples `while mask.any()`: read as True, it never ended, and a model with
    a large weight so initialised waited out a 60 s alarm). Initial values never change how much memory a
    step takes. Only the build runs under this mode, never the traced step."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        """Values read back from fake tensors and answered (reported if the builder fails)."""
        self._any_results = WeakIdKeyDictionary()
        """Storages of `any()` results on fakes: their value reads False."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = tensors_in((args, kwargs))
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with disable_current_modes():
                return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
            dtype = args[0].dtype
            if args[0].untyped_storage() in self._any_results:
                return False
            return True if dtype == torch.bool else (0.0 if dtype.is_floating_point else 0)
        try:
            out = func(*args, **kwargs)
        except DataDependentOutputException:
            if [str(r.type) for r in op_schema(func).returns] != ["bool"]:
                raise
            self.reads += 1  # `allclose`, `equal` on fake weights: a check, taken as passing
            return True
        if func.overloadpacket is torch.ops.aten.any and isinstance(out, FakeTensor):
            self._any_results[out.untyped_storage()] = None
        if not tensors and isinstance(out, torch.Tensor) and out.numel() <= REAL_FACTORY_MAX_NUMEL \
                and out.device.type == "cpu":
            with disable_current_modes():
                return func(*args, **kwargs)
        return out

    def answered_reads(self) -> str:
        """For the builder's error message: the values it read back from fake tensors, if any."""
        if not self.reads:
            return ""
        return (f"; it read {self.reads} value(s) back from fake weights (`.item()`, `.tolist()`, `allclose`), "
                "answered with 0 or True, which may be why")
