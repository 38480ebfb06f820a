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

Backward formulas branch the same way (FunctionsManual's `areAnyTensorSubclassLike`).
`F.binary_cross_entropy_with_logits` is run as an autograd Function whose backward is the formula's in-place chain
(`_BCEWithLogitsInPlaceBackward`): out of place, its temporaries all live to the end of the C++ statement, twice
what the real backward holds with a pos_weight (+59 % on a multi-label head whose peak is that backward).
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch
from torch.overrides import TorchFunctionMode

from memplan.compat.torch import (function_check_beside, is_traceable_wrapper_subclass, linear_binding,
                                  parameter_deepcopy_for_fakes, python_bodies_beside)

_LINEAR = (linear_binding, torch.nn.functional.linear)


_STATE = threading.local()


def linear_bias_add_in_place() -> bool:
    """True inside an autocast `F.linear` whose real kernel adds its bias in place (see the module doc)."""
    return getattr(_STATE, "bias_add_in_place", False)


class RealCompositePaths(TorchFunctionMode):
    """While active, `F.linear` on a non-contiguous input adds its bias in place, as on real tensors; with
    `native_fast_paths`, torch.nn's attention modules take their native fast path where a real run takes it (in eval
    mode, under no_grad or with no weight needing a gradient: a frozen teacher or encoder), which this mode, being
    active, would otherwise keep them off (`_native_multi_head_attention`, `_transformer_encoder_layer_fwd`). A CPU
    target only: the CPU kernel probe measures those kernels' buffers (a frozen 2-layer nn.TransformerEncoder teacher
    read +12 % traced on the composite path, an nn.MultiheadAttention one -7.7 %); a CUDA trace keeps the composite
    path, whose buffers the CUDA rules know. nn.TransformerEncoder's conversion of a padded batch to a nested tensor
    (same conditions, with a padding mask) cannot be traced: the layers run on the padded batch; the notes say so."""

    def __init__(self, *, native_fast_paths: bool = False) -> None:
        super().__init__()
        self.nested_traced_dense = 0
        """Calls of nn.TransformerEncoder whose real run converts its batch to a nested tensor, traced padded."""
        self._native_fast_paths = native_fast_paths
        self._patches = contextlib.ExitStack()

    def __enter__(self):
        # torch's Python functions run their bodies under this mode (MHA's in-projection, a backward's recomputation)
        self._patches.enter_context(python_bodies_beside(self))
        self._patches.enter_context(parameter_deepcopy_for_fakes())  # a parameter deep-copied in the step
        if self._native_fast_paths:
            self._patches.enter_context(function_check_beside(self, self._encoder_check))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def _encoder_check(self, args) -> bool:
        """nn.TransformerEncoder asks only when every other condition of its nested path holds; the real run then
        converts unless grad mode is on and a weight needs a gradient. The trace never converts (True)."""
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in args)):
            self.nested_traced_dense += 1
        return True

    def notes(self) -> list[str]:
        if not self.nested_traced_dense:
            return []
        return ["nn.TransformerEncoder with a padding mask in eval mode without gradients: a real run converts the "
                "batch to a nested tensor (padding dropped, converted back at the end), which a trace cannot follow; "
                "traced on the padded batch, that part of the estimate is approximate (a frozen 2-layer encoder "
                "teacher: -3 %)"]

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
        if func in _BCE_WITH_LOGITS:
            parse = _bce_arguments if func is _BCE_WITH_LOGITS[0] else _bce_op_arguments
            call = _autocast_to_float32(parse(*args, **kwargs))
            if call[4] >= 0 and _bce_runs_in_place(*call[:4]):
                return _BCEWithLogitsInPlaceBackward.apply(*call)
        return func(*args, **kwargs)


_BCE_WITH_LOGITS = (torch.nn.functional.binary_cross_entropy_with_logits, torch.binary_cross_entropy_with_logits)
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _bce_arguments(input, target, weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None):
    legacy = size_average is not None or reduce is not None  # (deprecated arguments: left to the op itself)
    return input, target, weight, pos_weight, -1 if legacy else _REDUCTIONS.get(reduction, -1)


def _bce_op_arguments(input, target, weight=None, pos_weight=None, reduction=1):
    """The op F.binary_cross_entropy_with_logits calls (its body runs under the mode: python_bodies_beside)."""
    return input, target, weight, pos_weight, reduction


def _autocast_to_float32(call: tuple) -> tuple:
    """The loss's arguments as autocast gives them to the op (binary_cross_entropy_with_logits runs in float32 under
    autocast: each lower-precision floating argument cast, a copy autograd records); as they are without autocast."""
    input = call[0]
    if not isinstance(input, torch.Tensor) or not torch.is_autocast_enabled(input.device.type):
        return call
    return tuple(t.to(torch.float32) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                 for t in call[:4]) + call[4:]


def _bce_runs_in_place(input, target, weight, pos_weight) -> bool:
    """Whether the real backward of this call runs FunctionsManual's in-place chain, which the trace then runs too:
    a plain-tensor (not DTensor) float32 input that needs a gradient, and nothing else that does."""
    tensors = [t for t in (input, target, weight, pos_weight) if isinstance(t, torch.Tensor)]
    if not (isinstance(input, torch.Tensor) and isinstance(target, torch.Tensor) and input.requires_grad):
        return False
    if any(t.requires_grad for t in tensors[1:]) or any(is_traceable_wrapper_subclass(t) for t in tensors):
        return False
    return all(t.dtype == torch.float32 for t in tensors if t.is_floating_point())


class _BCEWithLogitsInPlaceBackward(torch.autograd.Function):
    """`binary_cross_entropy_with_logits` whose backward is FunctionsManual's, op for op, on the path a real run takes
    (torch 2.4-2.13 `binary_cross_entropy_with_logits_backward`). Under any dispatch mode, and so under the trace,
    the formula takes its out-of-place chain (`areAnyTensorSubclassLike`), whose C++ temporaries all live to the end
    of the statement: six tensors of the logits' size at once where the real in-place chain holds three (with
    pos_weight: `t`, `t + 1` and the sigmoid; +25 % on a model whose peak is that backward). The forward is the op
    itself (the same output, the same saved tensors)."""

    @staticmethod
    def forward(ctx, input, target, weight, pos_weight, reduction):
        ctx.save_for_backward(input, target, weight, pos_weight)
        ctx.reduction = reduction
        return torch.ops.aten.binary_cross_entropy_with_logits(input, target, weight, pos_weight, reduction)

    @staticmethod
    def backward(ctx, grad):
        input, target, weight, pos_weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # a double backward: the real formula is out of place too
            return torch.ops.aten.binary_cross_entropy_with_logits_backward(
                grad, input, target, weight, pos_weight, ctx.reduction), None, None, None, None
        if pos_weight is not None:
            t = pos_weight.mul(target)
            # `t.add(1)`, made in the logits' fake so that the in-place chain stays in one storage: with a real
            # target and pos_weight (the batch's, a constant) it would be real, and an in-place op on a real tensor
            # with a fake operand makes a new fake (one more tensor of the logits' size, counted at once)
            grad_input = torch.empty_like(input).copy_(t).add_(1).sub_(target).mul_(input.sigmoid()).sub_(t)
            del t
        else:
            grad_input = input.sigmoid().sub_(target)
        grad_input.mul_(grad)
        if weight is not None:
            grad_input.mul_(weight)
        if ctx.reduction == _REDUCTIONS["mean"]:
            grad_input.div_(input.numel())
        return grad_input, None, None, None, None


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
