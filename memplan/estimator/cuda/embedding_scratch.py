"""Temporaries of CUDA's embedding backward over more than 3072 indices (a rule for cuda/op_scratch.py: per phase, the
bytes of each buffer held at once).

From the source, not read on a GPU (the zoo's token models train at most 3072 tokens a step, which take the direct
kernel: only the copies of a non-contiguous gradient or index, read on an H100). The H200's two GPT-2 small FSDP2 runs
at 8 x 1024 tokens (benchmarks/results/memory_gaps_gpu.md) take this path but peak elsewhere: their estimates are the
same with and without this rule (allocated +0.01 % fp32, +0.01 % bf16-mixed against the H200, emulated).
aten/src/ATen/native/cuda/Embedding.cu `embedding_dense_backward_cuda`: up to 3072 indices (and no
scale_grad_by_freq) a kernel adds into the zeroed gradient directly. Beyond, the indices are sorted with their
positions: `sorted_indices` and `orig_indices` (empty_like the indices), an `arange` of the positions and cub's
radix-sort storage over all the index's bits (`radix_sort_pairs(..., num_indices, false)`, the bit range left out;
cuda/cub_sort.py) — the arange and cub's storage are freed when the sort returns. With scale_grad_by_freq a `count`
buffer like the indices follows. Then EmbeddingBackwardKernel.cu `embedding_backward_cuda_kernel`, its two-pass
path: beside the gradient (the op's output) `segment_offsets` (one per index), a 0-dim int64 segment count, cub's
unique-by-key storage, `partials_per_segment` and `partials_per_segment_offset` (max_segments = min(indices,
num_weights) each), a 0-dim partial-segment count, cub's exclusive-sum storage, `partial_segment_offset`
(max_partial_segment = indices / 10 + max_segments) and `grad_weight_per_segment`, [max_partial_segment, dim] in the
gradient's op-math type (float32 for float16 and bfloat16), all held until the kernel returns. cub's unique-by-key
and scan storage (tile descriptors: a few hundred bytes at these sizes) are counted as one block each.

Not modelled: newer torch's fused atomic path (taken when the segments are too few to fill the GPU, MAX_ATOMIC_ACCUM
_BLOCKS_PER_SM = 4 blocks per SM, and not under deterministic algorithms), which holds a partial-to-segment index
instead of `grad_weight_per_segment` (and, for 16-bit gradients, a float32 copy of the whole gradient).
"""
from __future__ import annotations

import torch

from memplan.estimator.cuda.cub_sort import radix_sort_temp_bytes

DIRECT_KERNEL_INDICES = 3072
"""Embedding.cu: at most this many indices (without scale_grad_by_freq) take the direct kernel."""
_ROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu NROWS_PER_THREAD
_SMALL = 1  # a 0-dim count, or cub's storage for a scan / unique-by-key at these sizes: one block


def embedding_backward_scratch(grad, indices, num_weights, padding_idx, scale_grad_by_freq, *, gpu):
    """`embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)` on `gpu`: first
    `indices_.contiguous()` and `grad_.contiguous()` (copies where they are not; H100, lstm-b32: [32, 64, 128] fp32 +
    [32, 64] int64 = 1,064,960 B), held until the op returns."""
    n = indices.numel()
    copies = tuple(t.numel() * t.element_size() for t in (indices, grad) if not t.is_contiguous())
    if n == 0 or (n <= DIRECT_KERNEL_INDICES and not scale_grad_by_freq):
        return (copies,) if copies else ()
    index = indices.element_size()
    arch = {"compute_capability": gpu.compute_capability, "sm_count": gpu.sm_count}
    sorted_pair = (*copies, n * index, n * index)  # (the copies,) sorted_indices, orig_indices
    sort = (*sorted_pair, n * index, radix_sort_temp_bytes(n, index, index, **arch))  # + arange, cub's storage
    count = (n * index,) if scale_grad_by_freq else ()
    dim = grad.size(-1) if grad.dim() else 1
    segments = min(n, num_weights)
    partials = n // _ROWS_PER_THREAD + segments
    math = 4 if grad.dtype in (torch.float16, torch.bfloat16) else grad.element_size()
    held = (*sorted_pair, *count, n * index, _SMALL)  # + segment_offsets, the segment count
    per_segment = (segments * index, segments * index)  # partials_per_segment, partials_per_segment_offset
    return (sort,
            (*held, _SMALL),  # cub's unique-by-key storage
            (*held, *per_segment, _SMALL),  # cub's exclusive-sum storage
            (*held, *per_segment, _SMALL, partials * index, partials * dim * math))  # the two-pass buffers
