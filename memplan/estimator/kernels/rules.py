"""Ops whose fake kernel disagrees with the real one, and the rule memplan follows for each.

A fake tensor runs an op's meta kernel. Where that kernel refuses inputs the real kernel takes (or
gives another output), the trace would fail, or count other bytes, for a step that runs. Each entry
of RULES names the op, what the installed torch does wrong, and a function that gives the output the
real kernel gives. tests/estimator/test_kernel_rules.py runs each rule against the real kernel of the
installed torch, and checks that the fake kernel still disagrees: an upgrade that fixes or changes an
op fails that test, so the rule is removed or changed rather than silently kept.

Known for torch 2.13.0.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from memplan.compat.torch import OpOverload, op_overload, suggest_memory_format
from memplan.estimator.kernels import sparse

Rule = Callable[..., object]
"""rule(func, args, kwargs) -> outputs; called under the fake mode, in place of func."""


@dataclass(frozen=True, kw_only=True)
class KernelRule:
    """One op whose fake kernel the trace must not call as it is."""

    op: OpOverload
    """The aten overload the rule replaces."""
    disagreement: str
    """What the installed torch's fake kernel does that the real kernel does not."""
    run: Rule
    """Gives the real kernel's outputs (shapes, strides, dtypes) as fakes."""


_META_DTYPE = torch.bfloat16
"""The only non-scaled dtype `_meta_grouped_mm_common` accepts (torch/_meta_registrations.py)."""


def _as_meta_dtype(t: torch.Tensor) -> torch.Tensor:
    """A bf16 stand-in for `t` whose strides in bytes equal `t`'s, so the meta kernel's 16-byte stride
    checks (written in elements of the input's dtype) judge the stand-in as the real kernel judges `t`."""
    if t.dtype == _META_DTYPE:
        return t
    scale = t.element_size() / _META_DTYPE.itemsize
    strides = [s if s == 1 else s * scale for s in t.stride()]
    if any(s != int(s) for s in strides):  # 1-byte dtypes: no byte-equivalent bf16 layout; let the meta judge
        return t
    return torch.empty_strided(tuple(t.shape), tuple(int(s) for s in strides), dtype=_META_DTYPE, device=t.device)


def _grouped_mm(func, args, kwargs):
    """The real kernels (CPU, and CUDA's fallback) take float32/float16/bfloat16 and return mat_a's dtype;
    the meta kernel checks dtype == bfloat16 first (and refuses any other out_dtype). Run the meta on
    byte-equivalent bf16 stand-ins, so every other check (ranks, contraction size, strides, group
    counts) is still the meta kernel's own, and give its output back in mat_a's dtype."""
    mat_a, mat_b, *rest = args
    dtype = mat_a.dtype
    if mat_b.dtype != dtype or dtype not in (torch.float32, torch.float16) or kwargs.get("out_dtype") or len(rest) > 2:
        return func(*args, **kwargs)  # the meta's own verdict where the real kernel has no other answer
    out = func(_as_meta_dtype(mat_a), _as_meta_dtype(mat_b), *rest, **kwargs)
    return _like_in_dtype(out, dtype)


def _like_in_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`out` re-made in `dtype`: contiguous as the CPU kernel makes it, or with the last dimension padded
    to 16 bytes as `_create_grouped_mm_output_tensor` does on CUDA builds."""
    if out.is_contiguous():
        return torch.empty(tuple(out.shape), dtype=dtype, device=out.device)
    alignment = 16 // dtype.itemsize
    padded = -(-out.shape[-1] // alignment) * alignment
    strides = (out.shape[1] * padded, padded, 1) if out.dim() == 3 else (padded, 1)
    return torch.empty_strided(tuple(out.shape), strides, dtype=dtype, device=out.device)


def _same_dtype_matmul(func, args, kwargs):
    """The real matmul kernels (CPU and CUDA) refuse floating operands of different dtypes (a bf16
    activation times a float32 weight outside autocast raises "expected m1 and m2 to have the same
    dtype"); the meta kernels return the first operand's dtype, so a step that cannot run would be
    estimated. Raise as the real kernel does: the estimate's error then names the op and the dtypes."""
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if len(set(dtypes)) > 1:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise RuntimeError(
            f"{func.__name__} got operands of different dtypes ({names}): the real kernel refuses them, so this step "
            "cannot run. Cast one operand (or run the op under autocast, e.g. precision='bf16-mixed')")
    return func(*args, **kwargs)


_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.mv.default)
"""Matmuls whose real kernels require one dtype for all floating operands and whose fake kernels do not
(torch 2.13; bmm, baddbmm, addmv and dot refuse mixed dtypes in their fake kernels too)."""


RULES: dict[OpOverload, KernelRule] = {
    rule.op: rule
    for rule in (
        KernelRule(
            op=op_overload("aten", "_grouped_mm"),
            disagreement="the fake kernel accepts only bfloat16; the real CPU kernel also runs float32 and float16 "
            "(transformers' default MoE experts path calls it in float32 on CPU)",
            run=_grouped_mm,
        ),
        *(KernelRule(
            op=op,
            disagreement="the fake kernel takes floating operands of different dtypes (bf16 @ float32) and returns "
            "the first one's dtype; the real kernel raises",
            run=_same_dtype_matmul,
        ) for op in _MATMULS),
        *(KernelRule(op=op, disagreement="the fake kernel gives a sparse tensor's result no entries (nnz 0)", run=run)
          for op, run in ((torch.ops.aten.clone.default, sparse.clone),
                          (torch.ops.aten._coalesce.default, sparse.coalesce),
                          (torch.ops.aten.sparse_mask.default, sparse.sparse_mask))),
        KernelRule(op=torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.default, run=sparse.construct,
                   disagreement="the fake sparse tensor keeps no values of the real indices it is made from"),
        KernelRule(op=torch.ops.aten._embedding_bag_backward.default, run=sparse.embedding_bag_backward,
                   disagreement="with sparse=True, the fake kernel's gradient has no entries (refused by name)"),
    )
    if rule.op is not None  # (a torch without the op: torch < 2.8 has no _grouped_mm)
}


def rule_for(func) -> KernelRule | None:
    return RULES.get(func)


# --------------------------------------------------------------------------------------------------
# CPU output layouts: where the real CPU kernel lays its output out differently from the meta kernel.
# The bytes are the same; what differs is whether a later view needs a copy (a transposed batch-norm
# output feeding a Linear is reshaped by a copy in the real run, by a view on the fakes).

aten = torch.ops.aten

_BATCH_NORMS = {  # op -> index of the argument whose layout the CPU kernel suggests for output 0
    aten.native_batch_norm.default: 0,
    aten._native_batch_norm_legit.default: 0,
    aten._native_batch_norm_legit.no_stats: 0,
    aten._native_batch_norm_legit_no_training.default: 0,
    aten._native_batch_norm_legit_functional.default: 0,
    aten.native_batch_norm_backward.default: 1,
}
"""CPU batch norm (aten/src/ATen/native/Normalization.cpp) makes its output, and the backward its grad_input,
with `at::empty_like(input, input.suggest_memory_format())`: channels-last stays channels-last, any other
layout (a transposed (N, L, C) activation) comes out contiguous. The meta kernels keep the input's strides."""

_LOG_SIGMOIDS = (aten.log_sigmoid_forward.default, aten.log_sigmoid_backward.default)
"""CPU log_sigmoid (aten/src/ATen/native/Activation.cpp) makes its output and buffer contiguous whatever the
input's layout (it computes on a contiguous copy of a non-contiguous input: scratch the kernel probe
measures); its backward's grad_input follows grad_output's layout, where the meta kernel follows the input's."""

_LAYER_NORM = aten.native_layer_norm.default
"""CPU layer_norm (aten/src/ATen/native/layer_norm.cpp) on a float16/bfloat16 input with a float32 weight or bias (a
LayerNorm under CPU autocast, which does not cast it) keeps its saved mean and rstd in float32
(`param_scalar_type`); the meta kernel gives them the input's dtype, half their size (-0.33 % on a bf16-mixed
Swin V2, -4.3 % on a stack of narrow LayerNorms)."""

_GROUP_NORM, _GROUP_NORM_BACKWARD = aten.native_group_norm.default, aten.native_group_norm_backward.default
"""CPU group_norm (aten/src/ATen/native/group_norm.cpp) is mixed-type as layer_norm is: on a float16/bfloat16 input
with a float32 weight (a GroupNorm under CPU autocast, which does not cast it) its mean and rstd are float32, and its
backward's grad_input has the input's dtype, where the meta kernels give the statistics the input's dtype and the
grad_input float32 (+48 % on a bf16-mixed model whose peak is that backward: a float32 gradient and its cast)."""

CPU_LAYOUT_OPS = frozenset(_BATCH_NORMS) | frozenset(_LOG_SIGMOIDS) | {_LAYER_NORM, _GROUP_NORM, _GROUP_NORM_BACKWARD}


def cpu_output_layout(func, args: tuple, out):
    """`out` re-made in the layout (and, for layer_norm's statistics, the dtype) the real CPU kernel gives it, where
    it differs."""
    if func is _LAYER_NORM:
        return _layer_norm_statistics(args, out, args[2:4])
    if func is _GROUP_NORM:
        return _layer_norm_statistics(args, out, args[1:3])
    if func is _GROUP_NORM_BACKWARD:
        grad_input, input = out[0], args[1]
        if grad_input is None or grad_input.dtype == input.dtype:
            return out
        return (torch.empty_like(grad_input, dtype=input.dtype), *out[1:])
    if func is aten.log_sigmoid_forward.default:
        return tuple(t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
                     for t in out)
    if func is aten.log_sigmoid_backward.default:
        grad_output = args[0]
        return out if out.stride() == grad_output.stride() else torch.empty_like(grad_output, dtype=out.dtype)
    index = _BATCH_NORMS.get(func)
    if index is None or not isinstance(out, tuple) or not isinstance(out[0], torch.Tensor):
        return out
    first, source = out[0], args[index]
    fmt = suggest_memory_format(source)
    if first.is_contiguous(memory_format=fmt):
        return out
    return (torch.empty_like(first, memory_format=fmt), *out[1:])


def _layer_norm_statistics(args: tuple, out, params: tuple):
    """native_layer_norm's or native_group_norm's (output, mean, rstd), mean and rstd in float32 where the CPU kernel
    is mixed-type (`params`: its weight and bias)."""
    input, params = args[0], [a for a in params if isinstance(a, torch.Tensor)]
    mixed = input.dtype in (torch.float16, torch.bfloat16) and any(p.dtype == torch.float32 for p in params)
    if not mixed or out[1].dtype == torch.float32:
        return out
    return (out[0], *(torch.empty_like(t, dtype=torch.float32) for t in out[1:]))
