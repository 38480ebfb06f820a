"""CUDA's embedding backward over more than 3072 indices (memplan/estimator/cuda/embedding_scratch.py): the sort's
buffers, then the two-pass or the fused kernel's, from Embedding.cu and EmbeddingBackwardKernel.cu. The H200's
readings of 7 such backwards (both paths, deterministic or not) are checked byte for byte against the rule in
tests/benchmarks/test_gpu_rules.py; these tests check which path the rule takes and that an estimate counts it."""
from __future__ import annotations

import torch
from torch import nn

import memplan.estimator.cuda.embedding_scratch as embedding_scratch
import memplan.estimator.cuda.op_scratch as op_scratch
from memplan.estimator.api import estimate
from memplan.estimator.cuda.cub_sort import radix_sort_temp_bytes
from memplan.estimator.cuda.op_scratch import CudaGpu, cuda_op_scratch

aten = torch.ops.aten
BACKWARD = aten.embedding_dense_backward.default
H100 = CudaGpu(compute_capability=(9, 0), sm_count=132)


def _args(tokens: int, vocab: int, dim: int, dtype=torch.float32, scale=False):
    grad = torch.empty(tokens, dim, dtype=dtype, device="meta")
    return (grad, torch.empty(tokens, dtype=torch.int64, device="meta"), vocab, -1, scale)


def test_up_to_3072_indices_the_direct_kernel_holds_nothing():
    assert cuda_op_scratch(BACKWARD, _args(3072, 50257, 768), {}, H100) == ()
    assert cuda_op_scratch(BACKWARD, _args(3072, 50257, 768, scale=True), {}, H100) != ()  # counts sort anyway


def test_beyond_3072_the_sort_then_the_two_pass_buffers():
    n, vocab, dim = 8192, 50257, 768  # GPT-2 small, 8 x 1024 tokens
    phases = cuda_op_scratch(BACKWARD, _args(n, vocab, dim), {}, H100)
    assert phases[0] == (n * 8, n * 8, n * 8, radix_sort_temp_bytes(n, 8, 8, compute_capability=(9, 0),
                                                                     sm_count=132))
    partials = n // 10 + min(n, vocab)  # max_partial_segment
    assert phases[-1][-2:] == (partials * 8, partials * dim * 4)  # partial_segment_offset, grad_weight_per_segment
    assert max(sum(p) for p in phases) == sum(phases[-1])
    few_rows = cuda_op_scratch(BACKWARD, _args(n, 500, dim), {}, H100)[-1]  # segments: min(indices, num_weights)
    assert few_rows[-1] == (n // 10 + 500) * dim * 4


def test_unique_by_key_holds_the_unique_keys_it_is_not_asked_for():
    n = 8192
    phases = cuda_op_scratch(BACKWARD, _args(n, 50257, 768), {}, H100)
    assert phases[1] == (n * 8, n * 8, n * 8, 8, n * 8, 1)  # sorted, orig, segment_offsets, count; keys, cub


def test_few_rows_over_many_indices_take_the_fused_atomic_path(monkeypatch):
    """H200 (132 SMs) reading: 4096 indices into 64 rows of 256 hold partial_to_segment_idx (473 x 8 B) where the
    two-pass path holds [473, 256] float32 partial sums; 400 rows (809 partials, not over 4 x 400 blocks) do not."""
    monkeypatch.setattr(embedding_scratch, "FUSED_FROM", (0, 0))  # as torch >= 2.11 runs it, whatever is installed
    h200 = CudaGpu(compute_capability=(9, 0), sm_count=132)
    partials = 4096 // 10 + 64
    fused = cuda_op_scratch(BACKWARD, _args(4096, 64, 256), {}, h200)[-1]
    assert fused[-2:] == (partials * 8, partials * 8)  # partial_segment_offset, partial_to_segment_idx
    two_pass = cuda_op_scratch(BACKWARD, _args(4096, 400, 256), {}, h200)[-1]
    assert two_pass[-1] == (4096 // 10 + 400) * 256 * 4
    bf16 = cuda_op_scratch(BACKWARD, _args(16384, 400, 256, torch.bfloat16), {}, h200)[-1]
    assert bf16[-1] == 400 * 256 * 4  # the float32 gradient the atomics add into


def test_deterministic_algorithms_and_older_torch_keep_the_two_pass_path(monkeypatch):
    monkeypatch.setattr(embedding_scratch, "FUSED_FROM", (0, 0))
    h200 = CudaGpu(compute_capability=(9, 0), sm_count=132)
    per_segment = (16384 // 10 + 400) * 256 * 4
    assert cuda_op_scratch(BACKWARD, _args(16384, 400, 256), {}, h200)[-1][-1] == (16384 // 10 + 400) * 8
    for deterministic in (True, "warn"):  # deterministicAlgorithms() is on for warn_only too
        last = cuda_op_scratch(BACKWARD, _args(16384, 400, 256), {}, h200, deterministic=deterministic)[-1]
        assert last[-1] == per_segment
    monkeypatch.setattr(embedding_scratch, "FUSED_FROM", (99, 0))  # a torch before the fused path
    assert cuda_op_scratch(BACKWARD, _args(16384, 400, 256), {}, h200)[-1][-1] == per_segment


def test_copies_of_a_non_contiguous_gradient_and_index_are_held_through_the_sort():
    grad = torch.empty(64, 32, 128, device="meta").transpose(0, 1)  # lstm-b32's [32, 64, 128] gradient, transposed
    indices = torch.empty(64, 32, dtype=torch.int64, device="meta").t()
    assert cuda_op_scratch(BACKWARD, (grad, indices, 1000, -1, False), {}, H100) == ((16_384, 1_048_576),)  # H100
    big = torch.empty(64, 4096, 128, device="meta").transpose(0, 1)  # 262,144 indices: the sort path
    big_indices = torch.empty(64, 4096, dtype=torch.int64, device="meta").t()
    for phase in cuda_op_scratch(BACKWARD, (big, big_indices, 1000, -1, False), {}, H100):
        assert phase[:2] == (262_144 * 8, 262_144 * 128 * 4)


def test_16_bit_gradients_are_summed_per_segment_in_float32():
    n, vocab, dim = 16384, 128256, 4096  # Llama-3's embedding, 4 x 4096 tokens
    bf16 = cuda_op_scratch(BACKWARD, _args(n, vocab, dim, torch.bfloat16), {}, H100)[-1][-1]
    assert bf16 == (n // 10 + n) * dim * 4  # 282 MiB


def test_an_estimate_counts_them_where_the_backward_peaks(monkeypatch):
    torch.manual_seed(0)
    model = nn.Embedding(20_000, 256)
    batch = torch.randint(0, 20_000, (4, 2048))  # 8192 indices

    def peak() -> int:
        return estimate(model, batch, loss=lambda m, b: m(b).sum(), optimizer="sgd",
                        device="H100-80GB").peak_allocated

    with_rule = peak()
    monkeypatch.delitem(op_scratch._RULES, BACKWARD)
    without = peak()
    assert with_rule - without >= (8192 // 10 + 8192) * 256 * 4  # at least grad_weight_per_segment
