"""CPU kernels whose scratch is a copy of an input they make first, probed only where they make it (the kernel probe,
memplan.estimator.kernels.probe, runs them on real tensors and counts what they hold beside their outputs)."""
from __future__ import annotations

import torch

aten = torch.ops.aten
HALF = frozenset({torch.float16, torch.bfloat16})
HALF_MEANS = frozenset({torch.ops.aten.mean.dim, torch.ops.aten.mean.default})
"""CPU's mean of a float16/bfloat16 tensor sums a float32 copy of its input (4 bytes an element)."""
LAYOUT_OPS = frozenset({
    torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default,
    torch.ops.aten._softmax_backward_data.default, torch.ops.aten._log_softmax_backward_data.default,
    torch.ops.aten.native_layer_norm.default, torch.ops.aten.native_layer_norm_backward.default,
    torch.ops.aten.gelu_backward.default,
    torch.ops.aten.log_sigmoid_forward.default, torch.ops.aten.log_sigmoid_backward.default,
    *(getattr(torch.ops.aten, name).default for name in (
        "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "max_pool3d_with_indices",
        "max_pool3d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward", "avg_pool3d", "avg_pool3d_backward",
        "adaptive_max_pool2d", "adaptive_max_pool2d_backward", "adaptive_max_pool3d", "adaptive_max_pool3d_backward",
        "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d",
        "_adaptive_avg_pool3d_backward", "reflection_pad2d", "reflection_pad2d_backward", "reflection_pad3d",
        "reflection_pad3d_backward", "replication_pad2d", "replication_pad2d_backward", "replication_pad3d",
        "replication_pad3d_backward", "native_group_norm", "native_group_norm_backward")),
})
"""CPU kernels that copy a non-contiguous input to a contiguous one (or compute into a contiguous
buffer and copy out): 2 x the tensor for an erf gelu_backward whose gradient is transposed, 1 x for
softmax, log_softmax, their backwards, layer_norm and log_sigmoid; pooling, padding and group norm copy an input
to another's layout (a channels_last CNN flattened after max_pool2d: -22 % without it). Probed only when an input
is non-contiguous (a channels_last tensor is not)."""
_CAST_REDUCTIONS = frozenset({aten.sum.default, aten.sum.dim_IntList, aten.count_nonzero.default,
                               aten.count_nonzero.dim_IntList})
"""CPU reductions (ReduceOps.cpp make_reduction) cast an input of another dtype than their result's whole before
reducing: a bool or int32 sum first copies its input to int64, 8 bytes an element (a count of an activation's positive
entries read -32 %); count_nonzero first compares its input with 0, a bool tensor of its size, then sums that."""
_NOT_CAST = frozenset({torch.int64, *HALF, torch.float32, torch.float64, torch.complex64, torch.complex128})


def copies_an_input(func, args: tuple) -> bool:
    """Whether the CPU kernel of `func` copies an input first, with these arguments."""
    if func in HALF_MEANS:  # CPU's mean of a half-precision input sums a float32 copy of it
        return isinstance(args[0], torch.Tensor) and args[0].dtype in HALF
    if func in _CAST_REDUCTIONS:
        return isinstance(args[0], torch.Tensor) and (func.overloadpacket is aten.count_nonzero
                                                      or args[0].dtype not in _NOT_CAST)
    return func in LAYOUT_OPS and any(isinstance(a, torch.Tensor) and not a.is_contiguous() for a in args)
