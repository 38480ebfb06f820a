"""Temporaries inside CUDA ops (cuda/op_scratch.py) and the optimizer counters torch keeps on the host
(cuda/host_state.py), against the H100's op-by-op readings (benchmarks/results/gpu_campaign_raw_h100/ops/,
torch 2.11.0+cu130: peak inside the op - max(before, after))."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.api import estimate
from memplan.estimator.cuda.host_state import host_state_tensors
from memplan.estimator.cuda.op_scratch import cuda_op_scratch, cuda_op_scratch_bytes
from memplan.estimator.kernels.scratch import cuda_contiguous_copies

aten = torch.ops.aten


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(("shape", "measured"), [
    ((2, 8, 256, 256), 4_194_304),  # llama-gqa-b2: eager attention's probabilities, 4 layers
    ((4, 8, 256, 256), 8_388_608),  # mixtral-moe-b4
    ((1024, 4), 16_384),  # mixtral-moe-b4: the router's softmax over 4 experts
])
def test_softmax_backward_holds_the_product_of_grad_and_output(shape, measured):
    grad = meta(*shape)
    assert cuda_op_scratch_bytes(aten._softmax_backward_data.default, (grad, meta(*shape), -1, torch.float32), {}) == measured


def test_softmax_backward_also_makes_a_transposed_output_and_product_contiguous():
    """Both inputs transposed alike: the product takes their layout, and host_softmax_backward copies it and
    the output before launching: three input sizes where a contiguous pair holds one."""
    t = meta(4, 64, 32).transpose(1, 2)
    nbytes = t.numel() * 4
    assert cuda_op_scratch_bytes(aten._softmax_backward_data.default, (t, t, -1, torch.float32), {}) == 3 * nbytes
    assert cuda_op_scratch_bytes(aten._log_softmax_backward_data.default, (t, t, -1, torch.float32), {}) == 0


@pytest.mark.parametrize(("shape", "measured"), [
    ((2, 8, 256, 256), 1_053_184),  # llama-gqa-b2 (SDPA's math backend on fp32 with a mask)
    ((4, 8, 256, 256), 2_105_856),  # mixtral-moe-b4
])
def test_safe_softmax_holds_its_masks_and_a_zero(shape, measured):
    assert cuda_op_scratch_bytes(aten._safe_softmax.default, (meta(*shape), -1), {}) == measured


def test_efficient_attention_backward_in_fp32_holds_the_delta_product():
    """bert-b16-ckpt: q, k, v, out and grad_out [16, 4, 128, 64] fp32, heads-transposed views of
    [16, 128, 4, 64]; the H100 held 2,162,688 bytes inside the op, 4 layers alike."""
    view = meta(16, 128, 4, 64).transpose(1, 2)
    args = (view, view, view, view, meta(16, 4, 128, 128), view, meta(16, 4, 128), meta((), dtype=torch.int64),
            meta((), dtype=torch.int64), 0.1, [True, True, True, False])
    func = aten._scaled_dot_product_efficient_attention_backward.default
    assert cuda_op_scratch_bytes(func, args, {}) == 2_162_688
    contiguous = meta(16, 4, 128, 64)  # a grad_out whose [B, M, H, K] view is not contiguous is copied first
    copied = cuda_op_scratch_bytes(func, (contiguous, *args[1:]), {})
    assert copied == 2_162_688 + contiguous.numel() * 4


@pytest.mark.parametrize(("q_shape", "kv_heads", "gpu"), [
    ((8, 4, 128, 64), 4, 1_065_472),  # gpt2-b8-bf16mixed, 4 layers alike
    ((4, 8, 256, 32), 2, 2_130_432),  # llama-gqa-b4-bf16mixed: 2 key/value heads
])
def test_flash_attention_backward_holds_its_dq_accumulator_and_softmax_d(q_shape, kv_heads, gpu):
    """mha_bwd: softmax_d [B, H, S128] fp32, dq_accum [B, S128, H, D32] fp32, and under GQA dK and dV at the query's
    head count. q, k, v, out, grad_out bf16 as [B, H, S, D] views of [B, S, H, D]. The H100 ran cuDNN's backward
    there (it prefers cuDNN on sm90), holding 512 B more than the rule."""
    batch, heads, seq, dim = q_shape
    view = meta(batch, seq, heads, dim, dtype=torch.bfloat16).transpose(1, 2)
    kv = meta(batch, seq, kv_heads, dim, dtype=torch.bfloat16).transpose(1, 2)
    scalar = meta((), dtype=torch.int64)
    args = (view, view, kv, kv, view, meta(batch, heads, seq), None, None, seq, seq, 0.1, True, scalar, scalar)
    rule = cuda_op_scratch_bytes(aten._scaled_dot_product_flash_attention_backward.default, args, {})
    expanded = 0 if kv_heads == heads else 2 * batch * seq * heads * dim * 2
    assert rule == batch * heads * seq * 4 + batch * seq * heads * dim * 4 + expanded
    assert 0 <= gpu - rule <= 512
    contiguous = meta(*q_shape, dtype=torch.bfloat16)  # a grad_out laid out [B, H, S, D] is copied first
    copied = cuda_op_scratch_bytes(aten._scaled_dot_product_flash_attention_backward.default,
                                   (contiguous, *args[1:]), {})
    assert copied == rule + contiguous.numel() * 2


def test_flash_attention_backward_rounds_the_sequence_to_128_and_the_head_dim_to_32():
    """mha_bwd (flash_api.cpp): seqlen_q_rounded = round_multiple(100, 128) = 128, head_size_rounded =
    round_multiple(72, 32) = 96: softmax_d 2 x 4 x 128 x 4 B = 4,096 B, dq_accum 2 x 128 x 4 x 96 x 4 B = 393,216 B."""
    view = meta(2, 100, 4, 72, dtype=torch.bfloat16).transpose(1, 2)
    scalar = meta((), dtype=torch.int64)
    args = (view, view, view, view, view, meta(2, 4, 100), None, None, 100, 100, 0.0, False, scalar, scalar)
    assert cuda_op_scratch_bytes(aten._scaled_dot_product_flash_attention_backward.default, args, {}) == 4_096 + 393_216


class Attention(nn.Module):
    """Eager attention over 256 tokens, 8 heads (the zoo's llama-gqa attention without the rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 3 * 64)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 256, 3, 8, 8).permute(2, 0, 3, 1, 4)
        return ((q @ k.transpose(-1, -2)).softmax(-1) @ v).mean()


def test_a_cuda_softmax_backward_adds_its_product_to_the_estimate(monkeypatch):
    """The attention probabilities' backward is this step's peak op: the product ([2, 8, 256, 256] fp32,
    4 MiB) raises the H100 estimate by its size; a CPU target does not move."""
    import memplan.estimator.tracker as tracker

    x = torch.randn(2, 256, 64)
    with_product = estimate(Attention, x, loss=lambda m, b: m(b), optimizer="sgd", device="H100-80GB")
    cpu = estimate(Attention, x, loss=lambda m, b: m(b), optimizer="sgd", device="cpu")
    monkeypatch.setattr(tracker, "cuda_op_scratch", lambda func, args, kwargs, gpu, deterministic=False: ())
    without = estimate(Attention, x, loss=lambda m, b: m(b), optimizer="sgd", device="H100-80GB")
    assert with_product.peak_allocated - without.peak_allocated == 2 * 8 * 256 * 256 * 4
    assert estimate(Attention, x, loss=lambda m, b: m(b), optimizer="sgd", device="cpu").peak_allocated == cpu.peak_allocated


def stack():
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(10)])  # 20 parameters


def mean_out(model, batch):
    return model(batch).mean()


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_a_cuda_estimate_keeps_adams_step_counters_off_the_device(optimizer):
    """Two moments per parameter and no step counter on the GPU (torch keeps it on the CPU unless capturable):
    the state is 2 x the parameters' bytes, block-rounded; on a CPU target the counters are in it (+4 bytes each)."""
    x = torch.randn(32, 64)
    params = [p for p in stack().parameters()]
    moments = sum(2 * (-(-p.numel() * 4 // 512) * 512) for p in params)
    cuda = estimate(stack, x, loss=mean_out, optimizer=optimizer, device="H100-80GB")
    assert cuda.optimizer_state == moments
    cpu = estimate(stack, x, loss=mean_out, optimizer=optimizer, device="cpu")
    assert cpu.optimizer_state == sum(2 * p.numel() * 4 + 4 for p in params)


def test_a_fused_adam_keeps_its_counters_on_the_device():
    """fused=True (as capturable=True) creates the counter on the parameter's device: one block each."""
    x = torch.randn(32, 64)
    fused = estimate(stack, x, loss=mean_out, device="H100-80GB",
                     optimizer=lambda params: torch.optim.Adam(params, fused=True))
    default = estimate(stack, x, loss=mean_out, device="H100-80GB", optimizer="adam")
    assert fused.optimizer_state - default.optimizer_state == 20 * 512


@pytest.mark.parametrize(("make", "keys"), [
    (lambda ps: torch.optim.AdamW(ps), {"step"}),
    (lambda ps: torch.optim.Adagrad(ps), {"step"}),
    (lambda ps: torch.optim.RMSprop(ps), {"step"}),
    (lambda ps: torch.optim.Adamax(ps), {"step"}),
    (lambda ps: torch.optim.RAdam(ps), {"step"}),
    (lambda ps: torch.optim.Adadelta(ps), {"step"}),
    (lambda ps: torch.optim.Rprop(ps), {"step"}),
    (lambda ps: torch.optim.NAdam(ps), {"step", "mu_product"}),
    (lambda ps: torch.optim.Adafactor(ps), {"step"}),
    (lambda ps: torch.optim.ASGD(ps), set()),  # step, eta and mu on the device
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), set()),
])
def test_host_state_is_the_counters_each_optimizer_creates_without_a_device(make, keys):
    params = [nn.Parameter(torch.ones(4, 4)), nn.Parameter(torch.ones(4))]
    optimizer = make(params)
    for p in params:
        p.grad = torch.full_like(p, 0.1)
    optimizer.step()
    expected = [id(optimizer.state[p][k]) for p in params for k in sorted(keys)]
    assert sorted(id(t) for t in host_state_tensors(optimizer)) == sorted(expected)
    optimizer.param_groups[0]["capturable"] = True  # Adagrad and Adafactor have no capturable: theirs stay
    still = {torch.optim.Adagrad, torch.optim.Adafactor}
    assert bool(host_state_tensors(optimizer)) == (type(optimizer) in still)


def test_embedding_and_its_backward_copy_non_contiguous_indices_and_gradients():
    """lstm-b32 / gru-b32: [32, 64] int64 token ids transposed from [64, 32] and the LSTM's [32, 64, 128]
    fp32 gradient transposed alike; the H100 held 16,384 B in the embedding, 1,064,960 in its backward."""
    ids = meta(64, 32, dtype=torch.int64).t()
    grad = meta(64, 32, 128).transpose(0, 1)
    assert cuda_op_scratch_bytes(aten.embedding.default, (meta(5000, 128), ids), {}) == 16_384
    assert cuda_op_scratch_bytes(aten.embedding.default, (meta(5000, 128), ids.contiguous()), {}) == 0
    backward = (grad, ids, 5000, -1, False)  # the copies, in Embedding.cu's order (cuda/embedding_scratch.py)
    assert cuda_op_scratch(aten.embedding_dense_backward.default, backward, {}) == ((16_384, 1_048_576),)
    assert cuda_op_scratch_bytes(aten.embedding_dense_backward.default, backward, {}) == 1_064_960


@pytest.mark.parametrize(("shape", "dtype", "measured"), [
    ((2, 256), torch.bool, 4_096),  # llama-gqa-b2: an attention mask's positions
    ((8, 128), torch.bool, 8_192),  # gpt2-b8-bf16mixed
    ((4,), torch.int32, 1_024),  # mixtral-moe-b4: tokens per expert, one run through cub's scan
    ((4, 256), torch.float32, 0),  # no cast, no single run
])
def test_cumsum_sums_a_bool_or_int_input_in_an_int64_copy(shape, dtype, measured):
    x = meta(*shape, dtype=dtype)
    assert cuda_op_scratch_bytes(aten.cumsum.default, (x, -1), {}) == measured


def test_bce_with_logits_holds_its_log_sigmoid_beside_the_elementwise_loss():
    """Loss.cpp's composite: log_sigmoid(input), with pos_weight a weight the target's size, then (1 - target) as
    the loss until the reduction; reduction 0 returns that loss (the op's output, not scratch)."""
    bce = aten.binary_cross_entropy_with_logits.default
    logits, pos_weight = meta(512, 4096), meta(4096)
    n = 512 * 4096 * 4
    assert cuda_op_scratch(bce, (logits, logits), {}) == ((n,), (n, n))
    assert cuda_op_scratch(bce, (logits, logits, None, pos_weight), {}) == ((n,), (n, 4096 * 4, n), (n, n))
    assert cuda_op_scratch(bce, (logits, logits), {"reduction": 0}) == ((n,),)


def test_pooling_backwards_copy_an_nchw_gradient_into_a_channels_last_input_s_layout():
    # DilatedMaxPool2d.cu / AveragePool2d.cu: gradOutput_.contiguous(input's suggested format), a kernel's contiguous
    # copy as softmax's (kernels/scratch.py); from source, not yet read on a GPU (the CPU kernels do the same, measured
    # by the probe: tests/estimator/test_channels_last_pooling.py)
    x = meta(4, 64, 32, 32).contiguous(memory_format=torch.channels_last)
    _, indices = aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    nchw, channels_last = meta(4, 64, 16, 16), meta(4, 64, 16, 16).contiguous(memory_format=torch.channels_last)
    pool = ([2, 2], [2, 2], [0, 0])
    max_back = lambda g, inp: sum(cuda_contiguous_copies(  # noqa: E731
        aten.max_pool2d_with_indices_backward.default, (g, inp, *pool, [1, 1], False, indices)))
    avg_back = lambda g, inp: sum(cuda_contiguous_copies(  # noqa: E731
        aten.avg_pool2d_backward.default, (g, inp, *pool, False, True, None)))
    assert max_back(nchw, x) == avg_back(nchw, x) == 4 * 64 * 16 * 16 * 4  # the gradient, copied
    assert max_back(channels_last, x) == avg_back(channels_last, x) == 0  # already in the input's layout
    assert avg_back(nchw, meta(4, 64, 32, 32)) == 0  # an NCHW model copies nothing
