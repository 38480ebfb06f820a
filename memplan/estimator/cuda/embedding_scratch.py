"""Temporaries of CUDA's embedding backward over more than 3072 indices (a rule for cuda/op_scratch.py: per phase, the
bytes of each buffer held at once).

aten/src/ATen/native/cuda/Embedding.cu `embedding_dense_backward_cuda`: up to 3072 indices (and no
scale_grad_by_freq) a kernel adds into the zeroed gradient directly. Beyond, the indices are sorted with their
positions: `sorted_indices` and `orig_indices` (empty_like the indices), an `arange` of the positions and cub's
radix-sort storage over all the index's bits (`radix_sort_pairs(..., num_indices, false)`, the bit range left out;
cuda/cub_sort.py) — the arange and cub's storage are freed when the sort returns. With scale_grad_by_freq a `count`
buffer like the indices follows. Then EmbeddingBackwardKernel.cu `embedding_backward_cuda_kernel`: beside the
gradient (the op's output, zeroed) `segment_offsets` (one per index) and a 0-dim int64 segment count; cub's
unique-by-key, whose ATen wrapper (cuda/cub.cuh) allocates the unique keys it is not asked for (one per index) and
cub's storage; `partials_per_segment` and `partials_per_segment_offset` (max_segments = min(indices, num_weights)
each) with cub's exclusive-sum storage; a 0-dim partial-segment count and `partial_segment_offset`
(max_partial_segment = indices / 10 + max_segments). Then one of two paths, all held until the kernel returns:
- two-pass: `grad_weight_per_segment`, [max_partial_segment, dim] in the gradient's op-math type (float32 for float16
  and bfloat16);
- fused (torch >= 2.11, pytorch#172454): `partial_to_segment_idx` (one per partial segment) and, for 16-bit
  gradients, a float32 zeroed copy of the whole gradient the atomics add into. Taken where the two-pass's
  sum_and_scatter grid, ceil(max_segments x dim rounded up to the warp / block), is under 4 blocks per SM
  (MAX_ATOMIC_ACCUM_BLOCKS_PER_SM) and max_partial_segment exceeds 4 times that grid, never under deterministic
  algorithms (`deterministicAlgorithms()`: True and "warn" alike).

Read on an H200 (132 SMs, torch 2.11; benchmarks/results/gpu_rules.md, and in order with the C++ function that asked
for each: benchmarks/results/gpu_rules_raw/embedding_paths_h200.json): every buffer above, with its size, for
4,096-16,384 indices over 64-50,257 rows, both paths. cub's
unique-by-key and scan storage (1,279 B there) are counted as one block each: both are freed before the last phase.
"""
from __future__ import annotations

import torch

from memplan.compat.versions import version_tuple
from memplan.estimator.cuda.cub_sort import radix_sort_temp_bytes

DIRECT_KERNEL_INDICES = 3072
"""Embedding.cu: at most this many indices (without scale_grad_by_freq) take the direct kernel."""
FUSED_FROM = (2, 11)
"""The first torch with the fused atomic path (pytorch#172454, merged 2026-01-16; read on torch 2.11)."""
_ROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu NROWS_PER_THREAD
_ATOMIC_BLOCKS_PER_SM = 4  # MAX_ATOMIC_ACCUM_BLOCKS_PER_SM
_WARP = 32
_MAX_BLOCK = 1024
_COUNT = 8  # a 0-dim int64 count
_CUB_STORAGE = 1  # cub's storage for a unique-by-key or a scan at these sizes: one small block


def _fused(segments: int, partials: int, dim: int, *, gpu, deterministic) -> bool:
    """Whether torch takes the fused atomic path (EmbeddingBackwardKernel.cu `use_fused_kernel`)."""
    if deterministic or version_tuple(torch.__version__) < FUSED_FROM:
        return False
    stride_warped = -(-dim // _WARP) * _WARP
    block = min(stride_warped, _MAX_BLOCK)
    grid = -(-segments * stride_warped // block)
    return grid < gpu.sm_count * _ATOMIC_BLOCKS_PER_SM and partials > grid * 4


def embedding_backward_scratch(grad, indices, num_weights, padding_idx, scale_grad_by_freq, *, gpu,
                               deterministic=False):
    """`embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)` on `gpu`, with
    deterministic algorithms as `deterministic` says: first `indices_.contiguous()` and `grad_.contiguous()` (copies
    where they are not; H100, lstm-b32: [32, 64, 128] fp32 + [32, 64] int64 = 1,064,960 B), held until the op
    returns."""
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
    held = (*sorted_pair, *count, n * index, _COUNT)  # + segment_offsets, the segment count
    per_segment = (segments * index, segments * index)  # partials_per_segment, partials_per_segment_offset
    offsets = (*held, *per_segment, _COUNT, partials * index)  # + the partial count, partial_segment_offset
    half = grad.dtype in (torch.float16, torch.bfloat16)  # summed in float32
    if _fused(segments, partials, dim, gpu=gpu, deterministic=deterministic):
        last = (*offsets, partials * index, *((num_weights * dim * 4,) if half else ()))  # + partial_to_segment_idx
    else:
        last = (*offsets, partials * dim * (4 if half else grad.element_size()))  # + grad_weight_per_segment
    return (sort,
            (*held, n * index, _CUB_STORAGE),  # unique-by-key: its unused keys, cub's storage
            (*held, *per_segment, _CUB_STORAGE),  # cub's exclusive-sum storage
            last)
