"""The global-memory staging buffer of CUDA's reduction kernel (sum, mean over some dimensions).

aten/src/ATen/native/cuda/Reduce.cuh (torch 2.11), `gpu_reduce_kernel`: when `setReduceConfig` splits each
output's inputs over several thread blocks (`ctas_per_output > 1`, a "global reduce"), the kernel takes a
staging buffer of `ReduceConfig::global_memory_size()` bytes and a semaphore array of
`semaphore_size()` bytes from the caching allocator and frees both when it returns. No fake tensor shows
them, yet they count in max_memory_allocated: `x.sum(0)` over a (2048, 1024) fp32 gradient (a Linear
bias's gradient) holds 16 MiB + 512 B while it runs.

That happens for reductions over a dimension that is not the fastest-moving one (column sums: bias
gradients, `sum_to_size` in broadcasting backwards) with many inputs per output and few outputs. The
config depends on the GPU's multiprocessor count and threads per multiprocessor (`target_grid_size`).

Measured on an H100 80GB HBM3, torch 2.11.0+cu130 (benchmarks/results/gpu_campaign_raw_h100/ops/*.json,
each op's peak less its before/after): sum over dim 0 of (2048, 1024) fp32 16,777,728 B; of (2048, 256) fp32
4,194,816 B; of (1024, 1024) bf16 8,389,120 B; of (1024, 768) bf16 6,291,968 B; of (1024, 256) bf16
2,097,664 B; of (4096, 64) bf16 524,800 B; over dims (0, 1) of (16, 256, 128) bf16 4,194,816 B and of
(32, 64, 5000) fp32 81,920,512 B: `reduce_staging_bytes` gives each (tests/estimator/test_cuda_reduce.py).

Modelled: sum and mean (dim lists or all), floating inputs (accumulated in float, double for double).
Left out: the `vectorize_input` case's input_vec_size is taken as vt0 = 4 (it only sizes reductions along
the fastest dimension, whose staging is num_outputs x ctas x 4 B, small); 64-bit-indexed tensors (over
2**31 elements), which the kernel splits into sub-iterators.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

aten = torch.ops.aten

_REDUCTIONS = frozenset({aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default})
_MAX_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex double only)
_WARP = 32
_MIN_VALUES_PER_THREAD, _MAX_VALUES_PER_THREAD = 16, 256  # CUDA (not ROCm)
_VT0 = 4  # gpu_reduce_kernel's default vt0 and input_vec_size

# cudaDeviceProp.multiProcessorCount of the catalog's boards (NVIDIA's specifications); H100-80GB stands
# for the SXM board (132; the PCIe board has 114).
MULTIPROCESSORS = {
    "V100-16GB": 80, "V100-32GB": 80, "T4": 40, "A10G": 80, "A100-40GB": 108, "A100-80GB": 108, "A40": 84,
    "RTX-A6000": 84, "RTX-3090": 82, "L4": 58, "L40": 142, "L40S": 142, "RTX-4090": 128, "RTX-6000-Ada": 142,
    "H100-80GB": 132, "H100-NVL": 132, "H200": 132, "B200": 148,
}
_DEFAULT_MULTIPROCESSORS = 108
"""An uncatalogued GPU: an A100's count (the staging size depends on it only for reductions with many outputs)."""


def threads_per_multiprocessor(compute_capability: tuple[int, int]) -> int:
    """cudaDeviceProp.maxThreadsPerMultiProcessor by compute capability (CUDA C Programming Guide, table 21)."""
    if compute_capability == (7, 5):
        return 1024
    if compute_capability in ((8, 6), (8, 9)) or compute_capability[0] == 12:
        return 1536
    return 2048


@dataclass(frozen=True)
class ReduceDevice:
    """What setReduceConfig reads from the GPU."""

    multiprocessors: int
    """multiProcessorCount."""
    threads_per_multiprocessor: int
    """maxThreadsPerMultiProcessor."""

    @classmethod
    def for_gpu(cls, name: str, compute_capability: tuple[int, int]) -> ReduceDevice:
        return cls(MULTIPROCESSORS.get(name, _DEFAULT_MULTIPROCESSORS), threads_per_multiprocessor(compute_capability))


def _iterator_dims(x: torch.Tensor, reduced: set[int]) -> list[tuple[int, int, bool]]:
    """TensorIterator's dimensions for reducing `x` over `reduced`, fastest first: (size, input stride in
    bytes, reduced). reorder_dimensions puts the reduced dimensions first (the output's stride 0), each group
    by ascending input stride; coalesce_dimensions merges neighbours that are contiguous in the input."""
    dims = sorted(((x.size(d), x.stride(d) * x.element_size(), d in reduced) for d in range(x.dim()) if x.size(d) > 1),
                  key=lambda t: (not t[2], t[1]))
    merged: list[tuple[int, int, bool]] = []
    for size, stride, red in dims:
        if merged and merged[-1][2] == red and merged[-1][0] * merged[-1][1] == stride:
            merged[-1] = (merged[-1][0] * size, merged[-1][1], red)
        else:
            merged.append((size, stride, red))
    return merged


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _last_pow2(n: int) -> int:
    return max(1, 1 << (n.bit_length() - 1)) if n > 0 else 1


def reduce_staging_bytes(func, args, device: ReduceDevice | None) -> tuple[int, ...]:
    """(staging buffer, semaphores) bytes that CUDA's reduction kernel allocates while running `func` on
    `args` on `device`; () where it allocates none (no global reduce, not a modelled reduction, no device)."""
    if device is None or func not in _REDUCTIONS or not args or not isinstance(args[0], torch.Tensor):
        return ()
    x = args[0]
    if not x.is_floating_point() or x.numel() == 0 or x.numel() >= 2**31:
        return ()
    dims = args[1] if len(args) > 1 and func in (aten.sum.dim_IntList, aten.mean.dim) else None
    reduced = set(range(x.dim())) if not dims else {d % max(x.dim(), 1) for d in dims}
    it = _iterator_dims(x, reduced)
    if not it or not any(red for _, _, red in it):
        return ()
    acc_bytes = 8 if x.dtype == torch.float64 else 4
    num_reduce = sum(1 for _, _, red in it if red)
    outputs = 1
    for size, _, red in it:
        outputs *= 1 if red else size
    inputs = x.numel() // outputs
    on_fastest = num_reduce == len(it) or it[0][1] < it[num_reduce][1]
    dim0, dim1 = (inputs, outputs) if on_fastest else (outputs, inputs)
    fastest_stride = it[0][1] if on_fastest else it[num_reduce][1]
    out_vec = 1
    if fastest_stride == x.element_size():
        if on_fastest and dim0 >= 128 and num_reduce == 1:
            dim0 //= _VT0  # vectorize along input
        elif not on_fastest:
            out_vec = _output_vec_size(x, it, num_reduce)
            dim0 //= out_vec
    # set_block_dimension
    max_threads = _MAX_THREADS // out_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, _WARP)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    threads = width * height
    step_input, step_output = (width, 1) if on_fastest else (1, width)
    split_warps = _div_up(inputs, step_input) >= min(height * 16, _MAX_VALUES_PER_THREAD)
    if split_warps:
        step_input *= height
    else:
        step_output *= height
    grid = _div_up(outputs // out_vec, step_output)
    values_per_thread = _div_up(inputs, step_input)
    if not (split_warps and values_per_thread >= _MAX_VALUES_PER_THREAD):
        return ()
    target_grid = device.multiprocessors * (device.threads_per_multiprocessor // threads)
    if grid > target_grid:
        return ()
    ctas = max(min(_div_up(target_grid, grid), _div_up(values_per_thread, _MIN_VALUES_PER_THREAD)),
               _div_up(values_per_thread, _MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return ()
    staging = acc_bytes * outputs * ctas * (1 if on_fastest else width * out_vec)
    return staging, 4 * grid


def _output_vec_size(x: torch.Tensor, it: list[tuple[int, int, bool]], num_reduce: int) -> int:
    """get_output_vec_size: 4, halved until it divides the input's address (in elements; the allocator's
    blocks are 512-byte aligned, so the storage offset decides), the first output dimension's size and
    every input stride (in elements) but that dimension's."""
    vec = 4
    values = [x.storage_offset(), it[num_reduce][0]]
    values += [stride // x.element_size() for i, (_, stride, _) in enumerate(it) if i != num_reduce]
    for n in values:
        while n % vec:
            vec //= 2
    return vec
