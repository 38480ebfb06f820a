"""CUDA's autocast policy, installed on the AutocastCPU dispatch key.

CPU and CUDA autocast cast different op lists. Under CPU autocast, layer_norm, softmax, sum, exp ...
run in bf16; CUDA runs them in fp32, and that changes which tensors exist and what autograd saves.

Mechanism. Every op whose CUDA policy differs from its CPU policy gets a Python kernel on the
AutocastCPU key (registered through a `torch.library.Library` that the caller destroys on exit). The
kernel casts as CUDA's C++ wrapper would, then calls the op again with AutocastCPU excluded, like
`WrapFunction_::call` in aten/src/ATen/autocast_mode.h. AutocastCPU sits above Autograd, so autograd
records the casts exactly as it does for CUDA. Ops whose policy is the same on both (mm, linear,
conv2d, the fp32 losses ...) keep their C++ kernels, weight-cast cache included. Ops that only CPU
autocasts (cat, stack, cross_entropy_loss, fft_*, linalg_* ...) get a fallthrough, as on CUDA.

Sources (torch 2.13): the CUDA lists are AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE and AT_FORALL_PROMOTE in
aten/src/ATen/autocast_mode.h (shipped as torch/include/ATen/autocast_mode.h, lines ~820-960);
`TORCH_LIBRARY_IMPL(aten, Autocast, m)` and `TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)` in
aten/src/ATen/autocast_mode.cpp give the CUDA extras and the CPU policies. The ops CPU wraps are read
at runtime from the dispatcher, so a newer torch's additions fall through instead of leaking CPU policy.

Ops of other libraries (torchvision::nms, a user's torch.library op) with an AutocastCPU kernel: CUDA autocast
runs the op's own AutocastCUDA kernel where it has one, and otherwise does not touch the op. Without one
the op falls through here, as on CUDA. With one, its AutocastCPU kernel is kept: a C++ AutocastCUDA kernel
casts only CUDA tensors, so it cannot run on the trace's CPU tensors, and the library's CPU rule is the
nearest known (torchvision registers one template, cast to float32, on both keys). An op with an
AutocastCUDA kernel and no AutocastCPU kernel is not cast here (its CUDA rule is not known on CPU).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from memplan.compat.torch import (
    OpOverload, destroy_library, dispatch_registrations, excluding_autocast_cpu, is_view, op_schema, override_kernel,
)

# --- CUDA policy (aten/src/ATen/autocast_mode.h, torch 2.13) -------------------------------------
LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu",
    "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
    "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)  # plus cudnn_convolution(_transpose) in autocast_mode.cpp: CUDA-only ops, never reached from CPU
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
    "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist",
    "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
)
BANNED = ("binary_cross_entropy",)  # autocast_mode.cpp: binary_cross_entropy_banned

# Ops the CPU C++ kernels already cast exactly as CUDA does (the KERNEL_CPU list in
# autocast_mode.cpp): lower_precision_fp or fp32 on both. Everything else CUDA wraps gets a Python
# kernel; e.g. prod is fp32 on CPU but fp32_set_opt_dtype on CUDA, grid_sampler fp32 vs promote.
SAME_ON_CPU = frozenset({
    "_convolution.deprecated", "addbmm", "addmm", "baddbmm", "bmm", "conv1d", "conv2d", "conv3d",
    "conv_tbc", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
    "linalg_vecdot", "linear", "matmul", "mm", "prelu", "scaled_dot_product_attention",
    "binary_cross_entropy_with_logits", "cdist", "cosine_embedding_loss", "hinge_embedding_loss",
    "huber_loss", "kl_div", "l1_loss", "margin_ranking_loss", "mse_loss", "multi_margin_loss",
    "multilabel_margin_loss", "nll_loss", "nll_loss2d", "poisson_nll_loss", "smooth_l1_loss",
    "soft_margin_loss", "triplet_margin_loss",
})

_BCE_BANNED = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)  # the error CUDA autocast raises (autocast_mode.cpp, binary_cross_entropy_banned)


def cuda_policy() -> dict[str, str]:
    """Every op CUDA autocast wraps (as 'name.overload'), mapped to its policy name."""
    policy = {name: "lower_precision_fp" for name in LOWER_PRECISION_FP}
    policy |= {name: "fp32" for name in FP32}
    policy |= {name: "fp32_set_opt_dtype" for name in FP32_SET_OPT_DTYPE}
    policy |= {name: "fp32_append_dtype" for name in FP32_APPEND_DTYPE}
    policy |= {name: "promote" for name in PROMOTE}
    policy |= {name: "banned" for name in BANNED}
    return policy


def cpu_autocast_ops() -> set[str]:
    """The aten ops with a kernel on AutocastCPU in this torch build, as 'name.overload'."""
    registered = dispatch_registrations("AutocastCPU")
    return {name.removeprefix("aten::") for name in registered if name.startswith("aten::")}


def other_cpu_autocast_ops() -> set[str]:
    """The ops outside aten with a kernel on AutocastCPU and none on AutocastCUDA, as 'namespace::name.overload':
    those CUDA autocast does not touch (see the module's docstring)."""
    on_cuda = set(dispatch_registrations("AutocastCUDA"))
    return {name for name in dispatch_registrations("AutocastCPU")
            if not name.startswith("aten::") and name not in on_cuda}


class KernelLibraries:
    """One `torch.library.Library(namespace, "IMPL")` per namespace, opened when first used (a library registers
    kernels for its own namespace's ops only); `destroy()` drops every kernel they registered."""

    def __init__(self) -> None:
        self._open: dict[str, torch.library.Library] = {}

    def library(self, namespace: str) -> torch.library.Library:
        """The library registering kernels for `namespace`'s ops."""
        if namespace not in self._open:
            self._open[namespace] = torch.library.Library(namespace, "IMPL")
        return self._open[namespace]

    def impl(self, qualified_name: str, kernel, dispatch_key: str) -> None:
        """Register `kernel` for 'namespace::name.overload' on `dispatch_key`."""
        namespace, _, name = qualified_name.partition("::")
        override_kernel(self.library(namespace), name, kernel, dispatch_key)

    def destroy(self) -> None:
        for lib in reversed(self._open.values()):
            destroy_library(lib)
        self._open.clear()


class CastCache:
    """Python twin of autocast's weight-cast cache (`cached_cast` in autocast_mode.cpp).

    CUDA caches the lower-precision cast of an fp32 leaf that requires grad for the whole autocast
    region, so a weight reused in a loop (an LSTMCell over time steps) is cast once. The C++ cache
    serves the ops whose CPU policy is kept; this one serves the Python kernels. It is cleared when the
    outermost torch.autocast exits (see `wrap_clear_autocast_cache`) and when the emulation ends.
    """

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        hit = self._casts.get(id(tensor))
        if hit is not None and hit[0]() is tensor and hit[1].dtype == dtype:
            return hit[1]
        casted = tensor.to(dtype)
        self._casts[id(tensor)] = (weakref.ref(tensor), casted)
        return casted

    def clear(self) -> None:
        self._casts.clear()


def wrap_clear_autocast_cache(cache: CastCache) -> Callable[[], None]:
    """A `torch.clear_autocast_cache` that also clears `cache`; torch.autocast.__exit__ calls it
    (torch/amp/autocast_mode.py) when the outermost autocast region ends."""
    original = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:
        cache.clear()
        original()

    return clear_autocast_cache


def register_cuda_autocast(libraries: KernelLibraries, *, lower_dtype: torch.dtype, cache: CastCache) -> None:
    """Install CUDA's autocast policy on AutocastCPU through `libraries` (destroy them to remove it)."""
    cpu_ops = cpu_autocast_ops()
    policies = cuda_policy()
    lib = libraries.library("aten")
    for name, policy in policies.items():
        if name in SAME_ON_CPU and name in cpu_ops:
            continue
        override_kernel(lib, name, _make_kernel(name, policy, lower_dtype, cache), "AutocastCPU")
    for name in sorted(cpu_ops - policies.keys()):
        override_kernel(lib, name, torch.library.fallthrough_kernel, "AutocastCPU")
    for name in sorted(other_cpu_autocast_ops()):
        libraries.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")


@dataclass
class _Arg:
    """One schema argument of a call. kind: tensor / opt_tensor / tensor_list / dtype / other, the
    overload sets of `cached_cast` and `prioritize` in autocast_mode.h (a Tensor?[] such as
    index_put's indices is neither cast nor weighed)."""

    name: str
    kind: str
    kwarg_only: bool
    value: object


_KINDS = {"Tensor": "tensor", "Optional[Tensor]": "opt_tensor", "List[Tensor]": "tensor_list"}


def _overload(name: str) -> OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _binder(op: OpOverload):
    """A function (args, kwargs) -> [_Arg] covering every schema argument. The dispatcher hands a
    Python kernel its positional arguments without trailing defaults and kwarg-only ones by name;
    defaults are filled in so that a policy can set `dtype` or redispatch to another overload."""
    schema = []
    for arg in op_schema(op).arguments:
        kind = "dtype" if arg.name == "dtype" and str(arg.type) == "Optional[int]" else _KINDS.get(str(arg.type), "other")
        schema.append((arg.name, kind, arg.kwarg_only, arg.default_value if arg.has_default_value() else None))

    def bind(args, kwargs) -> list[_Arg]:
        return [
            _Arg(name, kind, kwarg_only, args[i] if i < len(args) else kwargs.get(name, default))
            for i, (name, kind, kwarg_only, default) in enumerate(schema)
        ]

    return bind


def _is_eligible(value: object) -> bool:
    """`is_eligible` for CPU: a floating CPU tensor (real or fake) that is not double."""
    return (
        isinstance(value, torch.Tensor) and value.is_floating_point() and value.device.type == "cpu"
        and value.dtype != torch.float64
    )


def _make_kernel(name: str, policy: str, lower_dtype: torch.dtype, cache: CastCache):
    """The WrapFunction_<policy>::call of autocast_mode.h, for CPU tensors, as a Python kernel."""
    op = _overload(name)
    bind = _binder(op)
    redispatch = _overload(FP32_APPEND_DTYPE[name]) if policy == "fp32_append_dtype" else op

    def cached_cast(to_dtype: torch.dtype, value):
        if isinstance(value, (list, tuple)):
            return type(value)(cached_cast(to_dtype, v) for v in value)
        if not _is_eligible(value) or value.dtype == to_dtype:
            return value
        if (
            to_dtype == lower_dtype and value.dtype == torch.float32 and value.requires_grad
            and value.is_leaf and not is_view(value) and torch.is_autocast_cache_enabled()
        ):
            return cache.cast(value, to_dtype)
        return value.to(to_dtype)

    def kernel(*args, **kwargs):
        if torch.get_autocast_dtype("cpu") != lower_dtype:
            raise RuntimeError(
                f"emulate_cuda(autocast_dtype={lower_dtype}) but torch.autocast('cpu') runs with "
                f"dtype={torch.get_autocast_dtype('cpu')}; pass the same dtype to both"
            )
        if policy == "banned":
            raise RuntimeError(_BCE_BANNED)
        bound = bind(args, kwargs)
        first = bound[0].value
        if policy in ("lower_precision_fp", "fp32", "promote"):
            to_dtype = {"lower_precision_fp": lower_dtype, "fp32": torch.float32}.get(policy)
            to_dtype = to_dtype or _promote_type(bound, lower_dtype)
            for arg in bound:
                if arg.kind in ("tensor", "opt_tensor", "tensor_list"):
                    arg.value = cached_cast(to_dtype, arg.value)
        elif policy == "fp32_set_opt_dtype" and _is_eligible(first):
            for arg in bound:  # an explicit dtype is respected
                if arg.kind == "dtype" and arg.value is None:
                    arg.value = torch.float32
        elif policy == "fp32_append_dtype":
            bound.append(_Arg("dtype", "dtype", True, torch.float32 if _is_eligible(first) else first.dtype))
        call_args = [arg.value for arg in bound if not arg.kwarg_only]
        call_kwargs = {arg.name: arg.value for arg in bound if arg.kwarg_only}
        with excluding_autocast_cpu():
            return redispatch(*call_args, **call_kwargs)

    kernel.__name__ = f"cuda_autocast_{name.replace('.', '_')}"
    return kernel


def _promote_type(bound: list[_Arg], lower_dtype: torch.dtype) -> torch.dtype:
    """`promote_type` in autocast_mode.h: the widest floating type among Tensor and Tensor[]
    arguments (Tensor? arguments are cast but not weighed); doubles are ignored."""
    current = lower_dtype
    for arg in bound:
        tensors = arg.value if arg.kind == "tensor_list" else [arg.value] if arg.kind == "tensor" else []
        for tensor in tensors:
            if not _is_eligible(tensor):
                continue
            if torch.float32 in (current, tensor.dtype):
                current = torch.float32
            elif not current == tensor.dtype == lower_dtype:
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current
