"""A CUDA sum's staging buffer (Reduce.cuh's global reduction), against the H100's op-by-op readings
(benchmarks/results/gpu_campaign_raw_h100/ops/, torch 2.11.0+cu130: peak inside the op - max(before, after))."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.api import estimate
from memplan.estimator.cuda.reductions import ReductionStaging

aten = torch.ops.aten
H100 = ReductionStaging.for_gpu("NVIDIA H100 80GB HBM3", (9, 0))


@pytest.mark.parametrize(("shape", "dtype", "dims", "measured"), [
    ([2048, 256], torch.float32, [0], 4_194_816),  # bert-b16-ckpt: a Linear(.., 256)'s bias gradient
    ([2048, 1024], torch.float32, [0], 16_777_728),  # bert-b16-ckpt: the feed-forward's Linear(.., 1024)
    ([32, 64, 5000], torch.float32, [0, 1], 81_920_512),  # lstm-b32: the 5000-word head's bias, the step's peak op
    ([1024, 768], torch.bfloat16, [0], 6_291_968),  # gpt2-b8-bf16mixed: bf16 input, fp32 accumulation
    ([4096, 64], torch.bfloat16, [0], 524_800),  # mixer-b16-bf16mixed: 64 outputs, 16-wide blocks
    ([16, 256, 128], torch.bfloat16, [0, 1], 4_194_816),  # mixer-b16-bf16mixed
    ([4, 256, 256], torch.float32, [0, 1], 2_097_664),  # llama-gqa-b4-bf16mixed, mixtral-moe-b4
])
def test_the_staging_of_a_bias_gradient_is_the_h100s_to_the_byte(shape, dtype, dims, measured):
    x = torch.empty(shape, dtype=dtype, device="meta")
    out = x.sum(dims, keepdim=True)
    assert H100.staging_bytes(aten.sum.dim_IntList, (x, dims, True), {}, out) == measured


def test_a_reduction_without_a_global_split_stages_nothing():
    """Along the contiguous dim (a row's mean in RMSNorm), or over few rows, one block per output suffices."""
    rows = torch.empty(2, 256, 512, device="meta")
    assert H100.staging_bytes(aten.mean.dim, (rows, [-1], True), {}, rows.mean(-1, keepdim=True)) == 0
    few = torch.empty(64, 256, device="meta")
    assert H100.staging_bytes(aten.sum.dim_IntList, (few, [0], True), {}, few.sum(0, keepdim=True)) == 0
    assert H100.staging_bytes(aten.add.Tensor, (few, few), {}, few) == 0


def test_a_transposed_input_is_reduced_along_its_contiguous_dim():
    """TensorIterator orders dims by stride: dim 0 of a transposed [256, 2048] is its fastest dim, so each
    block reduces its outputs along x and needs no staging, where the row-major input needs 4 MiB."""
    x = torch.empty(256, 2048, device="meta").t()
    contiguous = torch.empty(2048, 256, device="meta")
    staged = H100.staging_bytes(aten.sum.dim_IntList, (contiguous, [0], True), {}, contiguous.sum(0, keepdim=True))
    assert staged == 4_194_816
    assert H100.staging_bytes(aten.sum.dim_IntList, (x, [0], True), {}, x.sum(0, keepdim=True)) == 0


class Head(nn.Module):
    """Embedding -> Linear(128, 5000) on [32, 64] tokens: lstm-b32's head without the LSTM."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5000, 128)
        self.head = nn.Linear(128, 5000)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def first_logit(model, batch):
    """A loss that reads one logit per token: its gradient is the logits' size, the bias sum is the backward's peak."""
    return model(batch)[..., 0].mean()


def test_a_vocabulary_bias_gradient_raises_the_cuda_peak_by_its_staging(monkeypatch):
    """The head's bias gradient sums [32, 64, 5000] over the tokens: 78 MiB of staging on an H100, at the
    backward's peak (as in lstm-b32 on the GPU); a CPU target's estimate does not move."""
    tokens = torch.randint(0, 5000, (32, 64))
    with_staging = estimate(Head, tokens, loss=first_logit, optimizer="sgd", device="H100-80GB")
    cpu = estimate(Head, tokens, loss=first_logit, optimizer="sgd", device="cpu")
    monkeypatch.setattr(ReductionStaging, "staging_allocations", lambda self, func, args, kwargs, out: ())
    without = estimate(Head, tokens, loss=first_logit, optimizer="sgd", device="H100-80GB")
    assert with_staging.peak_allocated - without.peak_allocated >= 0.95 * 81_920_512
    assert estimate(Head, tokens, loss=first_logit, optimizer="sgd", device="cpu").peak_allocated == cpu.peak_allocated


def test_the_sm_count_comes_from_the_catalog_or_the_generation():
    assert ReductionStaging.for_gpu("H100-80GB", (9, 0)).sm_count == 132
    assert ReductionStaging.for_gpu("NVIDIA A100-SXM4-80GB", (8, 0)).sm_count == 108
    assert ReductionStaging.for_gpu("some future board", (10, 0)).sm_count == 148
    assert ReductionStaging.for_gpu("L4", (8, 9)).threads_per_sm == 1536


def _reserved_growth_of_a_sum(shape, dims):
    """Reserved and allocated bytes a CUDA-target trace adds at one sum of an input already allocated, on an H100."""
    from memplan.estimator.allocator import CachingAllocatorModel
    from memplan.estimator.fake import new_fake_mode
    from memplan.estimator.tracker import StorageTracker

    memory = CachingAllocatorModel()
    fake_mode = new_fake_mode()
    tracker = StorageTracker(memory, fake_mode, cpu_kernels=False)
    tracker.reductions = H100
    with fake_mode, tracker:
        x, bias = torch.empty(shape), torch.empty(shape[-1])
        tracker.track(x)
        tracker.track(bias)  # a small-pool segment with room, as a model's parameters leave one
        reserved, allocated = memory.reserved_bytes, memory.allocated_bytes
        memory.reset_peaks()
        out = x.sum(dims, keepdim=True)
    tracker.stop()
    return memory.reserved_bytes - reserved, memory.peak_allocated_bytes - allocated, out


def test_the_staging_buffer_and_its_semaphores_are_requests_of_their_own():
    """Reduce.cuh allocates the buffer and the semaphores one after the other: bert-b16-ckpt's feed-forward bias
    gradient (a [2048, 1024] float32 sum) takes a 16 MiB segment for its 16 MiB buffer, its 512 semaphore bytes going
    to the small pool, as the H100 reserved (+16 MiB at that op, gpu_campaign_raw_h100/ops/bert-b16-ckpt.json),
    not one 16 MiB + 512 B request rounded up to an 18 MiB segment. Both are held at once: the op's peak counts
    both, as before."""
    grew, peak, out = _reserved_growth_of_a_sum([2048, 1024], [0])
    assert grew == 16 * 1024 * 1024  # the input's 20 MiB segment has 12 MiB left: the buffer takes a segment of its own
    assert peak == 16_777_728 + out.untyped_storage().nbytes()  # buffer + semaphores (+ the 4 KiB output)
