"""Temporaries of CUDA's advanced indexing and sort: index buffers that ATen allocates inside the op and frees
before it returns. Rules for cuda/op_scratch.py (same form: per phase, the bytes of each buffer held at once).

Read from ATen (torch 2.11) and checked against the H100's op-by-op readings (benchmarks/results/
gpu_campaign_raw_h100/ops/, peak inside the op - max(before, after); benchmarks/results/op_transients.md):

- Index tensors, on CUDA (TensorAdvancedIndexing.cpp `AdvancedIndex`): two or more whose strides differ once
  broadcast together (`all_strides_match`) are each made contiguous at the broadcast shape. H100, bert-b16-ckpt
  `mask[rows, cols]` over a [16, 128] bool with [16, 1, 1, 1] and [1, 1, 1, 128] int64 indices: 2 x 16,384 =
  32,768 B.
- A boolean (or uint8) mask index: `expandTensors` (aten/src/ATen/native/IndexingUtils.h) replaces it by
  `index.nonzero()`, one int64 buffer of nnz x mask.dim() (nonzero_cuda writes a [dim, nnz] buffer and returns
  its transpose), held while the op runs; while nonzero runs, its count and cub's storage beside it (a block
  each, Nonzero.cu). From the source, not read on a GPU (no zoo case indexes with a mask). nnz is counted where
  the mask is real (the batch's masks); for a fake mask, index_put's value length there, else every element.
- `index_put` / `index_put_` with accumulate=True (or deterministic algorithms, warn-only too, and more than one
  value; the trace's setting: estimator/determinism.py) runs
  `index_put_with_sort_kernel` (aten/src/ATen/native/cuda/Indexing.cu): `makeLinearIndex` computes the linear
  index (`wrapIndexOnce`: `index.remainder(size)`, then `* stride`: two int64 buffers of the index count N, a
  third while a second index is added in), then holds it beside `sorted_indices`, `orig_indices` (empty_like)
  and `range` (arange(N)), N int64 each, and cub's radix sort storage (`radix_sort_pairs`); a non-contiguous
  self or value is copied first, an int32 index widened to int64. H100, mixtral-moe-b4 (N = 2048, twelve ops,
  three shapes of self): 4 x 16,384 + 512 = 66,048 B. cub's storage is one 512-byte block for that single-tile
  sort; over more than one tile (2,304 pairs on sm80+) it is sized as cuda/cub_sort.py sizes it (alternate key
  and value buffers, bins, lookback) for the sort's bits, get_num_bits(largestIndex(self) / sliceSize): from the
  source, not read on a GPU. Without accumulate, `index_put_` builds an AdvancedIndex as `index` does (a mask's
  nonzero, the copies of index tensors whose strides differ); a scalar value into one mask is `masked_fill_`.
- `masked_scatter` / `masked_scatter_` (IndexKernel.cpp `masked_scatter__cuda`, IndexKernel.cu
  `launch_masked_scatter_kernel`): an int64 prefix sum of the mask at self's shape, the broadcast mask made
  contiguous, cub's scan storage and a copy of a non-contiguous source. Its backward for the source
  (`masked_scatter_backward`, composite) is `masked_select` (the mask's nonzero, as for `index`, then the
  selection) padded with zeros to the source's size. Multimodal decoders (LLaVA and ~100 transformers families)
  scatter image features into the token embeddings so, under a mask from the batch's ids: for bf16 embeddings the
  forward's prefix sums are four times the embeddings. From the source, not read on a GPU
  (benchmarks/gpu_rules.py has the cases for the next one).
- `sort` (aten/src/ATen/native/cuda/Sort.cpp `sort_cuda_kernel`): a dim of at most 4096 (Sort.h
  `should_use_small_sort`) sorts in place in the outputs after `fillSliceWithIndex` fills the indices from an
  `arange(size(dim))` (int64, freed at once). H100, mixtral-moe-b4 [2048] int64: 16,384 B. Longer dims take
  SortStable.cu's cub sorts (`do_launch_stable_sort_kernel`): a copy of a self whose sorted dim is not innermost
  and dense (Sort.cpp), SortStable.cu's own index buffers (8 bytes per element: one row's reverse indices for a
  single row or rows of 1,000,000 or more, `segmented_sort_large_segments`; two int2 index-and-segment buffers
  for under 128 rows, `segmented_sort_pairs_by_full_sort`, whose `radix_sort_pairs` is given no keys output and
  allocates one (aten/src/ATen/cuda/cub.cuh / cub.cu `radix_sort_pairs_impl`: `keys_out_owner`), then a second
  phase sorting the int2 pairs as int64 keys over the segment bits; reverse indices beyond, `segmented_sort_pairs`),
  and cub's temporary storage, sized as CUB sizes it (cuda/cub_sort.py: beyond one tile, an extra key and value
  buffer of the whole sort, plus bins and lookback). Where the copy is made and the outputs' strides (self's)
  differ from it, values and indices buffers at the copy's strides too (Sort.cpp `values_tmp`, `indices_tmp`).
  Read on an H200 (torch 2.11): 9 sorts over all three paths as the rule requests (benchmarks/results/gpu_rules.md;
  before the output buffers, a [16384, 64] sort along dim 0 read 25 % over the rule). `argsort` and `msort`
  reach `sort` (composite).
"""
from __future__ import annotations

import math

import torch

from memplan.compat.torch import disable_current_modes
from memplan.estimator import known_values
from memplan.estimator.cuda.cub_sort import radix_sort_temp_bytes, segmented_radix_sort_temp_bytes
from memplan.estimator.determinism import sorts_index_put

aten = torch.ops.aten

_I64 = 8
_CUB_BLOCK = 1
"""cub's temporary storage for a single-tile radix sort: a request of a few bytes, one 512-byte block."""
_SMALL_SORT = 4096


def index_scratch(self, indices):
    """`index.Tensor`: each mask's nonzero, then AdvancedIndex's contiguous copies of the index tensors."""
    masks = _mask_nonzeros(self, indices, None)
    return (*_nonzero_phases(masks), (*masks, *_stride_copies(self, indices, masks)))


def index_put_scratch(self, indices, values, accumulate=False, unsafe=False, *, gpu, deterministic=False):
    """`index_put` / `index_put_` / `_index_put_impl_` on `gpu`: with accumulate (or `deterministic` algorithms,
    warn-only too, and more than one value), `index_put_with_sort_kernel`'s phases; else the masks' nonzero buffers
    (none where a scalar goes into one mask: masked_fill_)."""
    sort = accumulate or (sorts_index_put(deterministic) and values.numel() > 1)
    if not sort:
        if _is_masked_fill(indices, values):
            return ()
        masks = _mask_nonzeros(self, indices, values)
        return (*_nonzero_phases(masks), (*masks, *_stride_copies(self, indices, masks)))
    defined = [i for i in indices if i is not None]
    count = _index_count(self, indices, values)
    if not defined or not count or self.numel() == 0:
        return ()
    self_copy = 0 if self.is_contiguous() else _nbytes(self)
    masks = _mask_nonzeros(self, indices, values)
    nonzero = tuple((self_copy, *phase) for phase in _nonzero_phases(masks))
    held = [self_copy, *masks]
    held += [count * _I64 for i in defined if i.dtype == torch.int32]  # makeLinearIndex: i.to(kLong)
    n = count * _I64
    linear = (*held, n, n) if len(defined) == 1 else (*held, n, n, n)  # remainder, * stride (, += into the sum)
    value_copy = 0 if values.is_contiguous() and values.numel() >= count * _slice(self, indices) else \
        count * _slice(self, indices) * values.element_size()
    permuted = 0 if _adjacent(indices) else _nbytes(self)  # transposeToFront: src_ = src.contiguous()
    # radix_sort_pairs<int64_t, int64_t> over get_num_bits(largestIndex(self_) / sliceSize) bits (Indexing.cu)
    bits = max(1, ((self.numel() - 1) // max(1, _elements_after(self, indices))).bit_length())
    cub = radix_sort_temp_bytes(count, _I64, _I64, bits=bits, compute_capability=gpu.compute_capability,
                                sm_count=gpu.sm_count)
    sort = (self_copy, n, value_copy, permuted, n, n, n, cub)  # linear, sorted, orig, range, cub's storage
    return (*nonzero, linear, sort)


def masked_select_scratch(self, mask):
    """`masked_select` (IndexKernel.cpp `masked_select_out_cuda_impl`): the mask and self broadcast together, then
    `index_out(self, [mask])`: the mask's nonzero, held while the selection is written (the op's output)."""
    masks = [_nonzero_count(_broadcast(mask, self), self, None, 0) * max(mask.dim(), self.dim()) * _I64]
    return (*_nonzero_phases(masks), tuple(masks))


def masked_scatter_scratch(self, mask, source):
    """`masked_scatter` / `masked_scatter_` (IndexKernel.cpp `masked_scatter__cuda`, IndexKernel.cu
    `launch_masked_scatter_kernel`; the out-of-place op clones self first, its output): an int64 prefix sum of the
    mask at self's shape (`maskPrefixSum`), the mask made contiguous at self's shape (a copy where it was broadcast
    or strided) and cub's scan storage (one block: its tile states, a few hundred KB over tens of millions of
    elements, are not modelled), then, the scan's storage freed, a copy of a non-contiguous source."""
    expanded = _broadcast(mask, self)  # (the out-of-place op broadcasts self too)
    if expanded.numel() == 0:
        return ()
    prefix = expanded.numel() * _I64
    mask_copy = 0 if expanded.is_contiguous() else expanded.numel() * mask.element_size()
    source_copy = 0 if source.is_contiguous() else _nbytes(source)  # made after the scan's storage is freed
    return ((prefix, mask_copy, _CUB_BLOCK), (prefix, mask_copy, source_copy))


def masked_scatter_backward_scratch(grad, mask, sizes):
    """`masked_scatter_backward` (FunctionsManual / TensorAdvancedIndexing.cpp `masked_scatter_backward_symint`,
    composite): `grad.masked_select(mask)` (its nonzero, then the selection), then zeros for the rest of the
    elements, both held while `cat` writes the output. The selection's count is the mask's where it has values (the
    batch's own mask, LLaVA's image tokens; a buffer's); a mask without values counts as many as the source holds
    (the most the forward accepts: no zeros and no cat, the selection is then the output). The phases before the
    output exists are counted beside it, as the other rules here count theirs."""
    numel = math.prod(sizes)
    expanded = _broadcast(mask, grad)
    selected = min(_nonzero_count(expanded, grad, None, 0), numel)  # the forward checked: at most the source's size
    nonzero = [selected * expanded.dim() * _I64]
    selection = selected * grad.element_size()
    rest = (numel - selected) * grad.element_size()
    if rest <= 0:  # every element selected: the selection is the output (viewed), no zeros and no cat
        return (*_nonzero_phases(nonzero), tuple(nonzero))
    return (*_nonzero_phases(nonzero), (*nonzero, selection), (selection, rest))


def _broadcast(mask, self):
    """The mask as the op broadcasts it against self (expand_outplace); a mask with values (the batch's, a buffer's
    carried value: memplan.estimator.known_values) keeps them (its count)."""
    shape = torch.broadcast_shapes(mask.shape, self.shape)
    values = known_values.values_of(mask)
    if values is not None:
        with disable_current_modes():
            return values.expand(shape)
    return _meta(mask).expand(shape)


def sort_scratch(self, *args, gpu, **kwargs):
    """`sort.default(self, dim=-1, descending=False)` / `sort.stable(self, *, stable, dim=-1, descending=False)` on
    `gpu` (a cuda.op_scratch.CudaGpu: cub's tiles depend on its architecture)."""
    dim = args[0] if args and not isinstance(args[0], bool) and isinstance(args[0], int) else kwargs.get("dim", -1)
    if self.dim() == 0 or self.numel() == 0:
        return ()
    length = self.size(dim)
    if length <= _SMALL_SORT:
        return ((length * _I64,),)  # fillSliceWithIndex's arange
    n, key = self.numel(), self.element_size()
    # Sort.cpp: a self not dense with the sorted dim innermost is copied to dim-last strides, and outputs whose
    # strides differ from that copy's get a values and an indices buffer at them (copied back after the sort)
    held = () if _dense(self) and self.stride(dim) == 1 else (_nbytes(self),)
    if held and _output_strides(self, dim) != _dim_last_strides(self, dim):
        held += (n * key, n * _I64)
    arch = {"compute_capability": gpu.compute_capability, "sm_count": gpu.sm_count}
    segments = n // length
    if segments == 1 or length >= 1_000_000:  # segmented_sort_large_segments: one row's reverse indices, then
        # radix_sort_pairs<scalar_t, int64_t> row by row (each row's cub storage freed before the next)
        return ((*held, length * _I64, radix_sort_temp_bytes(length, key, _I64, **arch)),)
    if segments < 128:  # segmented_sort_pairs_by_full_sort: two int2 (index, segment) buffers; radix_sort_pairs
        # <scalar_t, int2> with keys_out = nullptr allocates the sorted keys (cub.cuh), then cub's storage; then
        # radix_sort_keys<int64_t> over the segment bits
        pairs = (*held, n * _I64, n * _I64, n * key, radix_sort_temp_bytes(n, key, _I64, **arch))
        bits = max(1, math.ceil(math.log2(segments)))
        return pairs, (*held, n * _I64, n * _I64, radix_sort_temp_bytes(n, _I64, 0, bits=bits, **arch))
    # segmented_sort_pairs: the reverse indices, then DeviceSegmentedRadixSort's storage
    return ((*held, n * _I64, segmented_radix_sort_temp_bytes(n, key, _I64)),)


def _output_strides(self, dim: int) -> tuple[int, ...]:
    """The strides sort's meta function gives its outputs (Sorting.cpp: self's when dense, else inferred dense)."""
    with disable_current_modes():
        return aten.sort.stable(_meta(self), stable=True, dim=dim)[0].stride()


def _dim_last_strides(self, dim: int) -> tuple[int, ...]:
    """Sort.cpp `infer_dense_strides_dim_last`: dense strides in self's stride order (stable, descending), `dim`
    innermost."""
    order = sorted(range(self.dim()), key=lambda d: -1 if d == dim % self.dim() else self.stride(d), reverse=True)
    strides, step = [0] * self.dim(), 1
    for d in reversed(order):
        strides[d], step = step, step * self.size(d)
    return tuple(strides)


def _positions(indices):
    """(index, the first dim of self it indexes) for each index tensor: None and a plain index take one dim, a
    bool / uint8 mask as many as it has."""
    position = 0
    for index in indices:
        if index is not None:
            yield index, position
        position += index.dim() if index is not None and _is_mask(index) else 1


def _is_mask(index: torch.Tensor) -> bool:
    return index.dtype in (torch.bool, torch.uint8)


def _mask_nonzeros(self, indices, values) -> list[int]:
    """Bytes of `nonzero()` of each bool / uint8 index: nnz x its dims, int64."""
    return [_nonzero_count(index, self, values, position) * index.dim() * _I64
            for index, position in _positions(indices) if _is_mask(index)]


def _nonzero_phases(masks: list[int]) -> tuple[tuple[int, ...], ...]:
    """nonzero_cuda_out_impl, mask by mask: its output beside the count (`num_nonzeros`) and cub's
    DeviceSelect storage, a block each, the masks before it still held."""
    return tuple((*masks[:i], nbytes, _CUB_BLOCK, _CUB_BLOCK) for i, nbytes in enumerate(masks))


def _stride_copies(self, indices, masks: list[int]) -> list[int]:
    """AdvancedIndex (TensorAdvancedIndexing.cpp): on CUDA, two or more index tensors whose strides differ after
    broadcasting (`all_strides_match`) are each made contiguous (`indices[i].contiguous()`); a mask's nonzero
    columns share one layout."""
    plain = [i for i in indices if i is not None and i.dtype not in (torch.bool, torch.uint8)]
    if masks or len(plain) < 2:
        return []
    with disable_current_modes():
        expanded = torch.broadcast_tensors(*(_meta(i) for i in plain))
    if all(t.stride() == expanded[0].stride() for t in expanded[1:]):
        return []
    return [t.numel() * t.element_size() for t in expanded if not t.is_contiguous()]


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _nonzero_count(mask, self, values, position: int) -> int:
    """The mask's set elements: counted where the mask has values (the batch's own masks, a buffer's carried value);
    else the value's length there (index_put), or every element (an upper bound)."""
    known = known_values.values_of(mask)
    if known is not None:
        with disable_current_modes():  # count it outside the fake mode
            return int(torch.count_nonzero(known))
    if values is not None and values.dim() > 0:
        lead = values.dim() - (self.dim() - mask.dim() + 1)
        if 0 <= lead + position < values.dim() and values.size(lead + position) > 1:
            return values.size(lead + position)
    return mask.numel()


def _index_count(self, indices, values) -> int:
    """N: the elements of the broadcast index (a mask's nonzero count)."""
    return max((_nonzero_count(index, self, values, position) if _is_mask(index) else index.numel()
                for index, position in _positions(indices)), default=0)


def _slice(self, indices) -> int:
    """Elements of self per index position: the dims before the first index and after the indexed ones
    (computeLinearIndex's nElemBefore x nElemAfter)."""
    defined = [i for i, index in enumerate(indices) if index is not None]
    if not defined:
        return self.numel()
    covered = sum(index.dim() if index.dtype in (torch.bool, torch.uint8) else 1 for index in indices if index is not None)
    before = defined[0]
    total = 1
    for size in (*self.shape[:before], *self.shape[before + covered:]):
        total *= size
    return total


def _elements_after(self, indices) -> int:
    """computeLinearIndex's sliceSize (nElemAfter): the elements of the dims after the indexed ones, all the dims not
    indexed where the indices are not adjacent (transposeToFront moves the indexed dims first)."""
    indexed = {position + k for index, position in _positions(indices)
               for k in range(index.dim() if _is_mask(index) else 1)}
    last = max(indexed, default=-1)
    total = 1
    for d, size in enumerate(self.shape):
        if d not in indexed and (d > last or not _adjacent(indices)):
            total *= size
    return total


def _adjacent(indices) -> bool:
    """hasContiguousSubspace: the defined indices are next to each other."""
    defined = [i for i, index in enumerate(indices) if index is not None]
    return not defined or defined[-1] - defined[0] + 1 == len(defined)


def _is_masked_fill(indices, values) -> bool:
    """canDispatchToMaskedFill (TensorAdvancedIndexing.cpp): one bool mask and a one-element value."""
    defined = [i for i in indices if i is not None]
    return (len(defined) == 1 and defined[0].dtype == torch.bool and values.numel() == 1
            and (values.dim() == 0 or values.device.type == "cpu"))


def _dense(t: torch.Tensor) -> bool:
    """is_non_overlapping_and_dense: some order of the dims lays the elements out without gaps or overlap."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


RULES = {
    aten.index.Tensor: index_scratch,
    aten.index_put.default: index_put_scratch,
    aten.index_put_.default: index_put_scratch,
    aten._index_put_impl_.default: index_put_scratch,
    aten.masked_select.default: masked_select_scratch,
    aten.masked_scatter.default: masked_scatter_scratch,
    aten.masked_scatter_.default: masked_scatter_scratch,
    aten.masked_scatter_backward.default: masked_scatter_backward_scratch,
    aten.sort.default: sort_scratch,
    aten.sort.stable: sort_scratch,
}
"""The indexing and sort rules, by the aten op that runs them."""
