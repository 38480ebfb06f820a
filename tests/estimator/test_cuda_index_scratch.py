"""Advanced indexing's and sort's index buffers on a CUDA target (memplan.estimator.cuda.index_scratch), against the
H100's op-by-op readings (benchmarks/results/gpu_campaign_raw_h100/ops/, torch 2.11.0+cu130: peak inside the op
- max(before, after))."""
from __future__ import annotations

import pytest
import torch

from memplan.estimator.cuda.cub_sort import radix_sort_temp_bytes, segmented_radix_sort_temp_bytes
from memplan.estimator.cuda.op_scratch import CudaGpu, cuda_op_scratch, cuda_op_scratch_bytes

aten = torch.ops.aten


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(("self_shape", "values_shape"), [
    ((2048, 256), (2048, 256)),  # mixtral-moe-b4's backward of the routed tokens' gather, 4 layers each
    ((2048,), (2048,)),  # the routing weights' gather
    ((1024, 256), (2048, 256)),  # the hidden states', two experts per token
])
def test_index_put_with_accumulate_holds_four_index_buffers_and_cubs_block(self_shape, values_shape):
    """index_put_with_sort_kernel over 2048 int64 indices: the linear index, sorted_indices, orig_indices and
    arange(N) (16,384 B each) and cub's single-tile storage (one block); the H100 held 66,048 B in all twelve."""
    index = meta(2048, dtype=torch.int64)
    args = (meta(*self_shape), [index], meta(*values_shape), True)
    assert cuda_op_scratch_bytes(aten.index_put.default, args, {}) == 66_048
    assert cuda_op_scratch_bytes(aten.index_put.default, args[:3] + (False,), {}) == 0  # no sort without accumulate


def test_index_put_over_more_than_one_tile_holds_cubs_storage_for_the_sorts_bits():
    """From the source (Indexing.cu): radix_sort_pairs<int64, int64> over get_num_bits(largestIndex(self) /
    sliceSize) bits; past one tile cub keeps alternate key and value buffers (cuda/cub_sort.py). Top-2 routing of
    32K tokens into 1000 rows of 64: 65,536 indices over 10 bits, two 8-bit passes."""
    h100 = CudaGpu(compute_capability=(9, 0), sm_count=132)
    index = meta(65536, dtype=torch.int64)
    sort = cuda_op_scratch(aten.index_put_.default, (meta(1000, 64), [index], meta(65536, 64), True), {}, h100)[-1]
    cub = radix_sort_temp_bytes(65536, 8, 8, bits=10, compute_capability=(9, 0), sm_count=132)
    assert sort[-1] == cub > 2 * 65536 * 8  # the alternate keys and values beside bins and lookback
    single = cuda_op_scratch(aten.index_put_.default, (meta(1000, 64), [meta(2048, dtype=torch.int64)],
                                                        meta(2048, 64), True), {}, h100)[-1]
    assert single[-1] == 1  # one tile: one block, as the H100 read for mixtral-moe-b4


def test_index_put_copies_a_non_contiguous_value_and_widens_an_int32_index():
    index = meta(2048, dtype=torch.int32)
    values = meta(256, 2048).t()
    phases = cuda_op_scratch(aten.index_put.default, (meta(2048, 256), [index], values, True), {})
    assert phases[0] == (0, 2048 * 8, 2048 * 8, 2048 * 8)  # the widened index, remainder, * stride
    assert phases[1] == (0, 2048 * 8, values.numel() * 4, 0, 2048 * 8, 2048 * 8, 2048 * 8, 1)


def test_sort_of_a_short_dim_holds_one_arange_of_it():
    """mixtral-moe-b4 sorts its [2048] int64 expert assignments: fillSliceWithIndex's arange, 16,384 B on the H100."""
    assert cuda_op_scratch_bytes(aten.sort.default, (meta(2048, dtype=torch.int64),), {}) == 16_384
    assert cuda_op_scratch_bytes(aten.sort.stable, (meta(64, 2048),), {"stable": True, "dim": -1}) == 16_384
    assert cuda_op_scratch_bytes(aten.sort.default, (meta(64, 2048), 0), {}) == 512  # 64 along dim 0


def test_sort_of_a_long_dim_keeps_sortstables_index_buffers_and_cubs_storage():
    """Past 4096 along the dim, SortStable.cu's own index buffers beside cub's storage (cuda/cub_sort.py, tested
    there), on the default GPU (an A100's sm80)."""
    a100 = {"compute_capability": (8, 0), "sm_count": 108}
    one_row = cuda_op_scratch(aten.sort.default, (meta(10_000),), {})
    assert one_row == ((10_000 * 8, radix_sort_temp_bytes(10_000, 4, 8, **a100)),)  # reverse indices, cub's
    rows = cuda_op_scratch(aten.sort.default, (meta(8, 10_000),), {})
    n = 80_000  # 8 rows: by full sort, the int2 buffers, the keys cub.cuh allocates, then the segment-bit sort
    assert rows == ((n * 8, n * 8, n * 4, radix_sort_temp_bytes(n, 4, 8, **a100)),
                    (n * 8, n * 8, radix_sort_temp_bytes(n, 8, 0, bits=3, **a100)))
    many = cuda_op_scratch(aten.sort.default, (meta(256, 5000, dtype=torch.bfloat16),), {})
    n = 256 * 5000  # 256 rows: the reverse indices, then DeviceSegmentedRadixSort's extra keys and values
    assert many == ((n * 8, segmented_radix_sort_temp_bytes(n, 2, 8)),)
    strided = cuda_op_scratch(aten.sort.default, (meta(10_000, 2)[:, 0],), {})
    assert strided == ((10_000 * 4, 10_000 * 8, radix_sort_temp_bytes(10_000, 4, 8, **a100)),)  # Sort.cpp's copy


def test_sort_along_a_dim_that_is_not_innermost_holds_the_copy_and_outputs_at_its_strides():
    """Sort.cpp copies self to dim-last strides and sorts into values and indices buffers at those strides when the
    outputs' (self's) differ, copying them back after. Read on an H200 (benchmarks/results/gpu_rules.md): a
    [16384, 64] fp32 sort along dim 0 requested 50,541,055 bytes of temporaries at once; the rule without the two
    output buffers gave 37,958,144."""
    h200 = CudaGpu(compute_capability=(9, 0), sm_count=132)
    n = 16384 * 64
    phases = cuda_op_scratch(aten.sort.stable, (meta(16384, 64),), {"stable": False, "dim": 0}, h200)
    assert phases[0][:3] == (n * 4, n * 4, n * 8)  # the copy, values, indices at dim-last strides
    assert sum(phases[0]) == 50_541_055
    transposed = meta(64, 16384).t()  # dense with dim 0 innermost: sorted where it is, into outputs like it
    assert cuda_op_scratch(aten.sort.stable, (transposed,), {"stable": False, "dim": 0}, h200)[0][:2] == (n * 8, n * 8)


def test_indexing_with_two_broadcast_index_tensors_makes_each_contiguous():
    """bert-b16-ckpt: `mask[rows, cols]` over a [16, 128] bool with [16, 1, 1, 1] and [1, 1, 1, 128] int64 indices;
    their strides differ once broadcast, so AdvancedIndex copies both to [16, 1, 1, 128]: 32,768 B on the H100."""
    rows, cols = meta(16, 1, 1, 1, dtype=torch.int64), meta(1, 1, 1, 128, dtype=torch.int64)
    assert cuda_op_scratch_bytes(aten.index.Tensor, (meta(16, 128, dtype=torch.bool), [rows, cols]), {}) == 32_768
    same = meta(16, 128, dtype=torch.int64)
    assert cuda_op_scratch_bytes(aten.index.Tensor, (meta(16, 128), [same, same]), {}) == 0
    assert cuda_op_scratch_bytes(aten.index.Tensor, (meta(2048, 256), [meta(2048, dtype=torch.int64)]), {}) == 0


def test_a_boolean_mask_is_indexed_through_its_nonzero():
    """Read from ATen's expandTensors, not on a GPU: a real mask's set elements x its dims, int64, beside
    nonzero's count and cub's storage (a block each) while nonzero runs, then held through the kernel."""
    mask = torch.zeros(16, 128, dtype=torch.bool)
    mask[:, :100] = True
    phases = cuda_op_scratch(aten.index.Tensor, (meta(16, 128, 64), [mask]), {})
    assert phases == ((1600 * 2 * 8, 1, 1), (1600 * 2 * 8,))
    scalar = torch.tensor(0.0)
    assert cuda_op_scratch(aten.index_put_.default, (meta(16, 128), [mask], scalar, False), {}) == ()  # masked_fill_


def test_masked_scatter_holds_an_int64_prefix_sum_of_self_and_a_contiguous_mask():
    """From the source (IndexKernel.cpp `masked_scatter__cuda`, IndexKernel.cu): LLaVA-style image features scattered
    into [8, 512, 256] bf16 embeddings under the ids' mask broadcast over the hidden dim: the prefix sums (8 bytes an
    element of self, four times the bf16 embeddings), the broadcast mask made contiguous (a byte an element) and
    cub's scan storage (a block). Not read on a GPU."""
    embeds, n = meta(8, 512, 256, dtype=torch.bfloat16), 8 * 512 * 256
    mask = meta(8, 512, 1, dtype=torch.bool).expand(8, 512, 256)
    source = meta(210, 256, dtype=torch.bfloat16)
    for op in (aten.masked_scatter.default, aten.masked_scatter_.default):
        assert cuda_op_scratch(op, (embeds, mask, source), {}) == ((n * 8, n, 1), (n * 8, n, 0))
    full = meta(8, 512, 256, dtype=torch.bool)  # a mask of self's shape, contiguous: no copy
    strided = meta(256, 210, dtype=torch.bfloat16).t()  # a transposed source: copied once the scan's storage is freed
    assert cuda_op_scratch(aten.masked_scatter.default, (embeds, full, strided), {}) == (
        (n * 8, 0, 1), (n * 8, 0, 210 * 256 * 2))


def test_masked_scatter_backward_counts_the_batchs_mask_for_its_nonzero_and_selection():
    """The source's gradient (`masked_select` of the output's gradient under the mask, padded with zeros to the
    source's size): the mask's nonzero (int64, one row of 3 indices per selected element), then the selection
    and the zeros beside the output. A real mask (the batch's) is counted; a fake one counts every element."""
    grad = meta(8, 512, 256, dtype=torch.bfloat16)
    mask = torch.zeros(8, 512, 1, dtype=torch.bool)
    mask[:, :64] = True  # 64 image tokens a row: 8 x 64 x 256 elements selected
    selected = 8 * 64 * 256
    exact = cuda_op_scratch(aten.masked_scatter_backward.default, (grad, mask, [selected // 256, 256]), {})
    assert exact == ((selected * 3 * 8, 1, 1), (selected * 3 * 8,))  # the selection is the output itself
    larger = cuda_op_scratch(aten.masked_scatter_backward.default, (grad, mask, [4 * selected // 256, 256]), {})
    assert larger[-1] == (selected * 2, 3 * selected * 2)  # the selection and the zeros, beside cat's output
    unknown = cuda_op_scratch(aten.masked_scatter_backward.default,
                              (grad, meta(8, 512, 256, dtype=torch.bool), [8 * 64, 256]), {})
    assert unknown[0][0] == 8 * 64 * 256 * 3 * 8  # no values: as many as the source holds, the most the forward takes
    select = cuda_op_scratch(aten.masked_select.default, (grad, mask), {})
    assert select == ((selected * 3 * 8, 1, 1), (selected * 3 * 8,))
