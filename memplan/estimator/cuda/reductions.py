"""The staging buffer a CUDA reduction kernel takes through the caching allocator while it runs.

aten/src/ATen/native/cuda/Reduce.cuh (torch 2.x) `gpu_reduce_kernel`: when `setReduceConfig` splits each
output's inputs across several thread blocks (`config.should_global_reduce()`), the kernel allocates a
staging buffer of `global_memory_size()` = sizeof(arg_t) x num_outputs x ctas_per_output (x block.x x
output_vec_size when the block does not reduce along x) and `semaphore_size()` = 4 x grid.x bytes, both
through `CUDACachingAllocator`, and frees them when it returns. A Linear's bias gradient (`sum` over the
batch rows, keepdim) takes one: 16 MiB for [2048, 1024] fp32, 78 MiB for a 5000-word vocabulary's bias over
2048 tokens, measured to the byte on an H100 (benchmarks/results/gpu_campaign_raw_h100/ops/, every sum row;
benchmarks/results/op_transients.md). The configuration depends on the reduction's shape and strides (as
TensorIterator reorders and coalesces them), the accumulate type and the GPU's SM count and threads per SM.

Modelled: sum and mean (arg_t: float for half / bfloat16 inputs, the dtype itself otherwise). Not modelled:
other reductions of Reduce.cuh (amax, argmax, norm, var: other arg_t), and a reduction over 2**31 elements
or more, which the kernel splits into 32-bit-indexable pieces (each with its own staging).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

_REDUCTIONS = frozenset({
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default,
})
_MAX_NUM_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS (256 only for complex double)
_WARP = 32
_INPUT_VEC = 4  # gpu_reduce_kernel's default vt0 / input_vec_size on CUDA
_MIN_VALUES_PER_THREAD, _MAX_VALUES_PER_THREAD = 16, 256
_ALIGN = 512  # the caching allocator's kMinBlockSize


class ReductionStaging:
    """The staging bytes of each sum / mean on one GPU model."""

    def __init__(self, *, sm_count: int, threads_per_sm: int) -> None:
        self.sm_count, self.threads_per_sm = sm_count, threads_per_sm

    @classmethod
    def for_gpu(cls, name: str, compute_capability: tuple[int, int]) -> ReductionStaging:
        """The GPU named `name` (a catalog name or NVML's), of `compute_capability` (its SMs: the hardware
        catalog's)."""
        from memplan.hardware.catalog import max_threads_per_sm, streaming_multiprocessors

        return cls(sm_count=streaming_multiprocessors(name, compute_capability),
                   threads_per_sm=max_threads_per_sm(compute_capability))

    def staging_bytes(self, func, args, kwargs, out) -> int:
        """Bytes (block-rounded) the CUDA kernel of `func` allocates while it runs: 0 for all but sum / mean."""
        return sum(_rounded(n) for n in self.staging_allocations(func, args, kwargs, out))

    def staging_allocations(self, func, args, kwargs, out) -> tuple[int, ...]:
        """The requests the CUDA kernel of `func` makes of the caching allocator while it runs, in order: its staging
        buffer, then its semaphores (each a request of its own: a 16 MiB buffer takes a 16 MiB block, not a 2 MiB
        rounded 18 MiB one), both held until it returns; () for all but a sum / mean that splits across blocks."""
        if func not in _REDUCTIONS or not isinstance(out, torch.Tensor) or not isinstance(args[0], torch.Tensor):
            return ()
        x = args[0]
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if x.numel() == 0 or x.numel() >= 2 ** 31 or x.dtype.is_complex:
            return ()
        lowp = x.dtype in (torch.float16, torch.bfloat16) and out.dtype == torch.float32
        scalar = x.dtype if lowp or x.dtype == out.dtype else out.dtype  # make_reduction casts the input otherwise
        arg_size = 4 if scalar in (torch.float16, torch.bfloat16) else scalar.itemsize  # sum's / mean's acc type
        shape, in_strides, out_strides = _iterator_dims(list(x.shape), list(x.stride()), dims)
        buffer, semaphores = self._config(shape, in_strides, out_strides, x.storage_offset(), arg_size)
        return (buffer, semaphores) if buffer else ()

    def _config(self, shape, in_strides, out_strides, offset, arg_size) -> tuple[int, int]:
        """setReduceConfig's (global_memory_size, semaphore_size) for a TensorIterator of these dims."""
        ndim = len(shape)
        reduce_dims = sum(1 for s in out_strides if s == 0)
        numel = _prod(shape)
        num_outputs = _prod(n for n, s in zip(shape, out_strides) if s != 0)
        inputs_per_output = numel // num_outputs
        if ndim == 0:
            fastest, dim0, dim1, stride = True, 1, 1, 1
        else:
            fastest = reduce_dims == ndim or in_strides[0] < in_strides[reduce_dims]
            dim0, dim1 = (inputs_per_output, num_outputs) if fastest else (num_outputs, inputs_per_output)
            stride = in_strides[0] if fastest else in_strides[reduce_dims]
        vec = 1
        if stride == 1:
            if fastest and dim0 >= 128 and reduce_dims == 1:
                dim0 //= _INPUT_VEC
            elif not fastest:
                vec = _output_vec_size(shape, in_strides, reduce_dims, offset)
                dim0 //= vec
        max_threads = _MAX_NUM_THREADS // vec
        dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
        dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
        width = min(dim0_pow2, _WARP)
        height = min(dim1_pow2, max_threads // width)
        width = min(dim0_pow2, max_threads // height)
        step_input = step_output = 1
        if ndim == 0 or fastest:
            step_input *= width
            block_x_reduce = True
        else:
            step_output *= width
            block_x_reduce = False
        if _div_up(inputs_per_output, step_input) >= min(height * 16, _MAX_VALUES_PER_THREAD):
            step_input *= height
            split_warps = True
        else:
            step_output *= height
            split_warps = False
        grid_x = _div_up(num_outputs // vec, step_output)
        target_grid = self.sm_count * (self.threads_per_sm // (width * height))
        per_thread = _div_up(inputs_per_output, step_input)
        if not (split_warps and per_thread >= _MAX_VALUES_PER_THREAD and grid_x <= target_grid):
            return 0, 0
        ctas = max(min(_div_up(target_grid, grid_x), _div_up(per_thread, _MIN_VALUES_PER_THREAD)),
                   _div_up(per_thread, _MAX_VALUES_PER_THREAD))
        if ctas <= 1:
            return 0, 0
        size = arg_size * num_outputs * ctas * (1 if block_x_reduce else width * vec)
        return size, 4 * grid_x


def _iterator_dims(shape: list[int], strides: list[int], dims) -> tuple[list[int], list[int], list[int]]:
    """TensorIterator::reduce_op's dims (fastest first) after reorder_dimensions and coalesce_dimensions:
    (shape, input strides, output strides in elements; 0 on a reduced dim). `dims` None or []: all."""
    ndim = len(shape)
    if ndim == 0:
        return [], [], []
    reduced = {d % ndim for d in dims} if dims else set(range(ndim))
    out_strides, running = [0] * ndim, 1
    for d in reversed(range(ndim)):  # the output is allocated contiguous (keepdim sizes), reduced dims restrided to 0
        if d not in reduced:
            out_strides[d], running = running, running * shape[d]

    def should_swap(d0: int, d1: int) -> int:
        if (out_strides[d0] == 0) != (out_strides[d1] == 0):  # reduced dims first
            return 1 if out_strides[d1] == 0 else -1
        for ops in (out_strides, strides):
            s0, s1 = ops[d0], ops[d1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(reversed(range(ndim)))
    for i in range(1, ndim):  # TensorIteratorBase::reorder_dimensions' insertion sort
        d1 = i
        for d0 in range(i - 1, -1, -1):
            order = should_swap(perm[d0], perm[d1])
            if order > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif order < 0:
                break
    sh = [shape[p] for p in perm]
    ops = [[out_strides[p] for p in perm], [strides[p] for p in perm]]
    prev = 0
    for d in range(1, ndim):  # coalesce_dimensions
        if sh[prev] == 1 or sh[d] == 1 or all(sh[prev] * s[prev] == s[d] for s in ops):
            if sh[prev] == 1:
                for s in ops:
                    s[prev] = s[d]
            sh[prev] *= sh[d]
        else:
            prev += 1
            sh[prev] = sh[d]
            for s in ops:
                s[prev] = s[d]
    return sh[:prev + 1], ops[1][:prev + 1], ops[0][:prev + 1]


def _output_vec_size(shape, in_strides, reduce_dims: int, offset: int) -> int:
    """get_output_vec_size: 4, halved until it divides the input's element offset (its storage is block
    aligned), the size of the first dim kept and the input's strides (in elements) of every other dim."""
    vec = 4
    for n in (offset, shape[reduce_dims], *(s for j, s in enumerate(in_strides) if j != reduce_dims)):
        while n % vec:
            vec //= 2
    return vec


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _rounded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
