"""Every private torch name memplan uses, in one place.

The estimator traces a training step on fake tensors under a dispatch mode, emulates CUDA's autocast and
SDPA choice on CPU, and follows FSDP2's storage: all of that reaches below torch's public API. Each name
here says what it is for and the torch versions it is known for (memplan.compat.versions.TORCH_RANGE);
the rest of memplan imports them from here, so a torch that moves one fails on importing this module
(or, for the names read lazily, in the one function below that reads it), not deep in a trace.
tests/compat/test_compat_private_access.py keeps every other module off torch's private names.

Names bound here are the very objects torch has (no wrapper), so a per-op call costs what it did.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

# --- fake tensors and dispatch modes (torch 2.7-2.13) -------------------------------------------
from torch._subclasses.fake_tensor import (  # noqa: F401  (re-exported)
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    is_fake,
)
from torch.utils._python_dispatch import (  # noqa: F401  (re-exported)
    TorchDispatchMode,
    _disable_current_modes as disable_current_modes,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: F401  (torch 2.7-2.13; re-exported)
# elementwise type promotion and the memory format `empty_like` keeps (torch 2.7-2.13)
from torch._prims_common import (  # noqa: F401  (re-exported)
    ELEMENTWISE_TYPE_PROMOTION_KIND,
    elementwise_dtypes,
    suggest_memory_format,
)

from memplan.compat.versions import require

FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
"""The logger FakeTensorMode reports a rejected meta kernel to (torch 2.7-2.13)."""

OpOverload = torch._ops.OpOverload
"""`torch._ops.OpOverload` (torch 2.7-2.13): one overload of an operator (`torch.ops.aten.mm.default`)."""


def op_schema(op: Any) -> Any:
    """`OpOverload._schema` (torch 2.7-2.13): the op's FunctionSchema (`.arguments`, `.returns`)."""
    return op._schema


def op_packet(op: Any) -> Any:
    """`OpOverload._overloadpacket` (torch 2.7-2.13): the packet of all the op's overloads
    (`torch.ops.aten.mm`), whose `__name__` is 'aten.mm'."""
    return op._overloadpacket


# --- autograd, tensors and modules ---------------------------------------------------------------
current_autograd_node: Callable[[], Any] = torch._C._current_autograd_node
"""`torch._C._current_autograd_node()` (torch 2.7-2.13): the autograd Node running now, None outside the
backward."""


def is_view(tensor: torch.Tensor) -> bool:
    """`Tensor._is_view()` (torch 2.7-2.13): whether the tensor is a view of another's storage."""
    return tensor._is_view()


def sparse_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`Tensor._indices()`, `Tensor._values()` (torch 2.7-2.13) of a sparse COO tensor: the two dense tensors it
    holds (sparse_dim x nnz int64 indices; nnz x dense dims values), aliasing its own."""
    return tensor._indices(), tensor._values()


def owns_its_storage(tensor: torch.Tensor) -> bool:
    """`Tensor._base is None` (torch 2.7-2.13): the tensor is no view made from another tensor."""
    return tensor._base is None


def storage_key(tensor: torch.Tensor) -> int:
    """`UntypedStorage._cdata` (torch 2.7-2.13) of the tensor's storage: equal for tensors sharing one."""
    return tensor.untyped_storage()._cdata


DTENSOR_LOCAL_TENSOR = "_local_tensor"
"""`DTensor._local_tensor` (torch 2.7-2.13): the tensor holding a DTensor's shard, read without
dispatching an op (`to_local()` would)."""


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds a DTensor's storage (FSDP2's sharded parameters, gradients and optimizer state are
    DTensors), read through DTENSOR_LOCAL_TENSOR; any other tensor as it is."""
    return getattr(tensor, DTENSOR_LOCAL_TENSOR, tensor)

BatchNormBase: type[nn.Module] = nn.modules.batchnorm._BatchNorm
"""`torch.nn.modules.batchnorm._BatchNorm` (torch 2.7-2.13): the base of BatchNorm1d/2d/3d and SyncBatchNorm."""

COMPILED_CALL_ATTRIBUTE = "_compiled_call_impl"
"""`Module._compiled_call_impl` (torch 2.2-2.13): `module.compile()`'s compiled call, bound to the module."""


def parameter_slots(module: nn.Module) -> dict[str, Any]:
    """`Module._parameters` (torch 2.7-2.13): the module's own parameters by name, None slots included."""
    return module._parameters


def buffer_slots(module: nn.Module) -> dict[str, Any]:
    """`Module._buffers` (torch 2.7-2.13): the module's own buffers by name, None slots included."""
    return module._buffers


def child_slots(module: nn.Module) -> dict[str, Any]:
    """`Module._modules` (torch 2.7-2.13): the module's direct children by name, None slots included."""
    return module._modules


def module_call_code() -> Any:
    """The code object of `Module._call_impl` (torch 2.7-2.13), the frame each module's call runs in."""
    return nn.Module._call_impl.__code__


@contextlib.contextmanager
def replaced_module_apply(apply: Callable[..., Any]) -> Iterator[None]:
    """`Module._apply` (torch 2.7-2.13), which `.to()`, `.float()`, `.half()`... call, replaced by `apply`
    within the block."""
    original = nn.Module._apply
    nn.Module._apply = apply
    try:
        yield
    finally:
        nn.Module._apply = original


amp_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_
"""`torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)` (torch 2.7-2.13): the
in-place unscale GradScaler.unscale_ runs."""


def profiler_enabled() -> bool:
    """`torch.autograd.profiler._is_profiler_enabled` (torch 2.7-2.13), read now: a profiler is running."""
    return torch.autograd.profiler._is_profiler_enabled


# --- the dispatcher: autocast keys, registrations, libraries --------------------------------------
_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def excluding_autocast_cpu() -> Any:
    """`torch._C._ExcludeDispatchKeyGuard` of the AutocastCPU key (torch 2.7-2.13): a context in which
    ops skip CPU autocast's kernels (to redispatch below them)."""
    return torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU)


def dispatch_registrations(key: str) -> list[str]:
    """`torch._C._dispatch_get_registrations_for_dispatch_key(key)` (torch 2.7-2.13): the ops with a
    kernel on dispatch key `key` ('AutocastCPU'), as 'aten::name.overload'."""
    return torch._C._dispatch_get_registrations_for_dispatch_key(key)


def op_overload(namespace: str, name: str, overload: str = "default") -> Any:
    """`torch.ops.<namespace>.<name>.<overload>`, or None where this torch has no such op: `aten._grouped_mm` came
    in torch 2.8, and the `c10d` ops need torch's distributed package."""
    packet = getattr(getattr(torch.ops, namespace), name, None)
    return None if packet is None else getattr(packet, overload, None)


_IMPL_ALLOWS_OVERRIDE = "allow_override" in inspect.signature(torch.library.Library.impl).parameters


def override_kernel(lib: torch.library.Library, op_name: str, fn: Callable[..., Any], dispatch_key: str) -> None:
    """`lib.impl(op_name, fn, dispatch_key)` that replaces a kernel torch itself registered from Python for that key
    (torch._meta_registrations' Meta kernels: `_cudnn_rnn`'s). torch 2.13 allows it by default; torch 2.11 refuses
    it unless `allow_override=True` ("already a kernel registered from python overriding ...", read on the H200's
    torch 2.11.0); a torch without that flag checks `torch.library._impls`, the "ns/op/key" strings registered from
    Python, from which the key is dropped first. The earlier kernel comes back when `lib` is destroyed through
    `destroy_library`, which also puts back the key torch had recorded, so torch goes on refusing later overrides
    as it would have."""
    key = f"{lib.ns}/{op_name.split('::')[-1]}/{dispatch_key}"
    if key in torch.library._impls:
        lib.__dict__.setdefault("_memplan_restore", set()).add(key)
    if _IMPL_ALLOWS_OVERRIDE:
        lib.impl(op_name, fn, dispatch_key, allow_override=True)
        return
    torch.library._impls.discard(key)
    lib.impl(op_name, fn, dispatch_key)


def destroy_library(lib: torch.library.Library) -> None:
    """`Library._destroy()` (torch 2.7-2.13): drop every kernel `lib` registered; the Python-registration records of
    the kernels it overrode (`override_kernel`) are put back."""
    lib._destroy()
    restore = lib.__dict__.get("_memplan_restore", set())
    lib._op_impls.difference_update(restore)  # (the library's finalizer would drop them again when collected)
    torch.library._impls.update(restore)


def sdp_priority_order() -> tuple[int, ...] | None:
    """`torch._C._get_sdp_priority_order()` (torch 2.5-2.13, absent in 2.4: None): the order in which
    scaled_dot_product_attention tries its backends."""
    get_order = getattr(torch._C, "_get_sdp_priority_order", None)
    return tuple(get_order()) if get_order is not None else None


# --- distributed: fake process group and FSDP2 internals (read when first used) -----------------
def fake_store() -> Any:
    """`torch.testing._internal.distributed.fake_pg.FakeStore()` (torch 2.7-2.13): the store of the
    "fake" process-group backend, whose collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fsdp2_internals() -> tuple[Any, Any]:
    """The modules `torch.distributed.fsdp._fully_shard._fsdp_param` and `._fsdp_param_group` (torch
    2.7-2.13): FSDP2's `alloc_storage` / `free_storage`, which the estimate follows. ImportError where
    this torch lacks them."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    return _fsdp_param, _fsdp_param_group


def fsdp2_default_reshard() -> Any:
    """fully_shard's default `reshard_after_forward`: None where torch has it (torch 2.13: each module resharded
    after forward except the root, kept unsharded for the backward), True on torch 2.7, which refuses None and keeps
    the root unsharded in its lazy init whatever it was given. Passed for the root, it leaves the root as torch
    would."""
    from torch.distributed.fsdp import fully_shard

    return inspect.signature(fully_shard).parameters["reshard_after_forward"].default


def ensure_c10d_fake_kernels() -> None:
    """Meta kernels for torch's c10d collectives, which the FSDP2 trace runs on fake tensors (each returns its output
    and a `FakeWork`): torch 2.13 registers them when torch.distributed is imported
    (`torch.distributed._meta_registrations`); torch 2.7 only when `torch.distributed._tools.fake_collectives` is.
    Process-wide and permanent, as torch 2.13's own: Meta kernels, which no real tensor reaches."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("c10d::_allgather_base_", "Meta"):
        importlib.import_module("torch.distributed._tools.fake_collectives")  # (registers them on import)


def fsdp2_chunk_with_empty() -> Callable[..., Any]:
    """`torch.distributed.fsdp._fully_shard._fsdp_param._chunk_with_empty` (torch 2.7-2.13): how
    fully_shard splits a parameter into its ranks' shards."""
    return fsdp2_internals()[0]._chunk_with_empty


def set_fsdp2_chunk_with_empty(function: Callable[..., Any]) -> None:
    """Replace `_fsdp_param._chunk_with_empty` (torch 2.7-2.13) with `function`."""
    fsdp2_internals()[0]._chunk_with_empty = function


# --- DDP and gradients (read by MemoryPlanner) ------------------------------------------------------
def rebuilt_buckets_getter(ddp: torch.nn.parallel.DistributedDataParallel) -> Callable[[], bool]:
    """`DistributedDataParallel._has_rebuilt_buckets` (torch 2.7-2.13): whether DDP rebuilt its
    gradient buckets from the first synchronised backward yet. Returns a getter."""
    require(ddp, "_has_rebuilt_buckets", "torch")
    return lambda: ddp._has_rebuilt_buckets


def has_gradient_hooks(param: torch.nn.Parameter) -> bool:
    """Whether a parameter has gradient hooks: `Tensor._backward_hooks` (register_hook) and
    `Tensor._post_accumulate_grad_hooks` (register_post_accumulate_grad_hook, torch 2.1+) (torch 2.7-2.13)."""
    return bool(getattr(param, "_backward_hooks", None) or getattr(param, "_post_accumulate_grad_hooks", None))


def tensor_version(tensor: torch.Tensor) -> int:
    """`Tensor._version` (torch 2.7-2.13): the in-place write counter, to tell whether a failed
    backward wrote to a gradient."""
    return tensor._version


linear_binding: Callable[..., torch.Tensor] = torch._C._nn.linear
"""`torch._C._nn.linear` (torch 2.7-2.13): the C binding `F.linear` is, as a TorchFunctionMode sees it."""
@contextlib.contextmanager
def counting_checkpoint_calls(count: Callable[[], None]) -> Iterator[None]:
    """While open, every `torch.utils.checkpoint.checkpoint` call runs `count()` first, however the caller
    imported `checkpoint`: the non-reentrant path enters the module-level generator
    `torch.utils.checkpoint._checkpoint_without_reentrant_generator`, the reentrant path
    `CheckpointFunction.forward` (both looked up at call time; torch 2.7-2.13)."""
    import torch.utils.checkpoint as module

    require(module, "_checkpoint_without_reentrant_generator", "torch")
    generator = module._checkpoint_without_reentrant_generator
    forward = module.CheckpointFunction.__dict__["forward"]

    def counted_generator(*args, **kwargs):
        count()
        return generator(*args, **kwargs)

    def counted_forward(*args):
        count()
        return forward.__func__(*args)

    module._checkpoint_without_reentrant_generator = counted_generator
    module.CheckpointFunction.forward = staticmethod(counted_forward)
    try:
        yield
    finally:
        module._checkpoint_without_reentrant_generator = generator
        module.CheckpointFunction.forward = forward


@contextlib.contextmanager
def function_check_beside(mode: Any, encoder_check: Callable[[Any], bool]) -> Iterator[None]:
    """`torch.overrides.has_torch_function` (public) answering, while the block runs, as if `mode` (a TorchFunctionMode
    of memplan's, at the top of the mode stack) were not active, through `torch.overrides._pop_mode_temporarily`
    (torch 2.7-2.13): nn.MultiheadAttention and nn.TransformerEncoderLayer take their native fast path (eval mode, no
    gradient) only when it answers False, and any active mode makes it answer True. nn.TransformerEncoder's own check
    (whether to convert a padded batch to a nested tensor) gets `encoder_check(args)` instead."""
    overrides = torch.overrides
    original = overrides.has_torch_function
    encoder = nn.TransformerEncoder.forward.__code__

    def has_torch_function(args: Any) -> bool:
        if overrides._get_current_function_mode() is not mode:
            return original(args)
        if sys._getframe(1).f_code is encoder:
            return encoder_check(args)
        with overrides._pop_mode_temporarily():
            return original(args)

    overrides.has_torch_function = has_torch_function
    try:
        yield
    finally:
        overrides.has_torch_function = original


_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
"""The torch-function checks that torch's Python functions call by their own module globals (torch 2.4-2.13: bound when
the module was imported, so patching torch.overrides does not reach them)."""


@contextlib.contextmanager
def python_bodies_beside(mode: Any) -> Iterator[None]:
    """torch's functions written in Python (torch.nn.functional's, torch.functional's, Tensor's own such as
    `backward`, torch.autograd.grad) run their own bodies, with `mode` (a TorchFunctionMode of memplan's, at the top of
    the mode stack) still active, instead of handing the whole call to it: each check in their modules' globals
    answers, while `mode` is the current mode, as if it were not active (`torch.overrides._pop_mode_temporarily`,
    torch 2.4-2.13). A call handed to a mode runs with that mode popped, so the ops inside it would never reach it:
    F.multi_head_attention_forward's in-projection `linear`, or a whole backward with the checkpointed blocks it
    recomputes."""
    import torch._tensor
    import torch.autograd
    import torch.functional

    overrides = torch.overrides
    modules = (torch.nn.functional, torch.functional, torch._tensor, torch.autograd)
    originals = [(module, name, getattr(module, name)) for module in modules for name in _CHECKS
                 if hasattr(module, name)]

    def beside(original: Callable[..., bool]) -> Callable[..., bool]:
        def check(*args: Any) -> bool:
            if overrides._get_current_function_mode() is not mode:
                return original(*args)
            with overrides._pop_mode_temporarily():
                return original(*args)
        return check

    for module, name, original in originals:
        setattr(module, name, beside(original))
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


@contextlib.contextmanager
def parameter_deepcopy_for_fakes() -> Iterator[None]:
    """`copy.deepcopy` of a fake tensor that stands for an `nn.Parameter` copies as `Parameter.__deepcopy__` copies
    the real one: its data cloned and requires_grad kept, nothing else. A FakeTensor parameter is an instance of its
    own class (`Parameter(fake)` only marks it `_is_param`), so it took `Tensor.__deepcopy__`, which copies `.grad`
    too: a target network deep-copied inside the forward counted a gradient the real copy does not have (+20 % on
    a model whose peak is that forward, gradients alive). Patches `torch.Tensor.__deepcopy__` while active."""
    original = torch.Tensor.__deepcopy__

    def deepcopy(self: torch.Tensor, memo: dict) -> torch.Tensor:
        if type(self) is not FakeTensor or not getattr(self, "_is_param", False):
            return original(self, memo)
        if id(self) in memo:
            return memo[id(self)]
        result = torch.nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = result
        return result

    torch.Tensor.__deepcopy__ = deepcopy
    try:
        yield
    finally:
        torch.Tensor.__deepcopy__ = original
