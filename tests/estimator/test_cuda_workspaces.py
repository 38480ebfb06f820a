"""cuBLAS / cuBLASLt workspaces taken at each thread's first call, and cuDNN's share of the context, as
measured on an H200 (torch 2.11.0+cu130, benchmarks/results/gpu_campaign_raw/part1.json)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator.api import estimate
from memplan.estimator.cuda.overheads import cuda_overheads
from memplan.units import MiB

H100 = "H100-80GB"
BATCH = (torch.randn(16, 64), torch.randint(0, 8, (16,)))


def ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def total(model, batch):
    return model(batch[0]).sum()


def mlp(bias: bool = True) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64, bias=bias), nn.ReLU(), nn.Linear(64, 8, bias=bias))


class Blocks(nn.Module):
    """Two repeated blocks (checkpointable) and a head, all Linear with biases."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def convnet(head: bool) -> nn.Module:
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers, *([nn.Linear(8, 8)] if head else []))


IMAGES = (torch.randn(4, 3, 16, 16), torch.randint(0, 8, (4,)))


def test_a_biased_linear_takes_a_cublaslt_workspace_beside_the_cublas_ones(monkeypatch):
    """addmm with a 1-D bias runs cuBLASLt (its own 1 MiB workspace in torch 2.11, none when
    TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 shares cuBLAS's); without a bias it is a plain mm."""
    plain = estimate(lambda: mlp(bias=False), BATCH, loss=ce, device=H100)
    biased = estimate(lambda: mlp(bias=True), BATCH, loss=ce, device=H100)
    assert plain.workspaces == 2 * 32 * MiB  # one cuBLAS workspace per thread: forward and autograd's
    assert biased.workspaces - plain.workspaces == 1 * MiB  # the forward thread's cuBLASLt workspace
    assert biased.peak_allocated - plain.peak_allocated >= 1 * MiB
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    unified = estimate(lambda: mlp(bias=True), BATCH, loss=ce, device=H100)
    assert unified.workspaces == plain.workspaces


def test_a_recomputed_forward_takes_the_autograd_threads_cublaslt_workspace_too():
    """Checkpointing reruns the biased Linears in the backward, on the autograd engine's thread."""
    kept = estimate(Blocks, BATCH, loss=ce, device=H100)
    recomputed = estimate(Blocks, BATCH, loss=ce, checkpointing=True, device=H100)
    assert recomputed.checkpointing
    assert kept.workspaces == 2 * 32 * MiB + 1 * MiB
    assert recomputed.workspaces == 2 * 32 * MiB + 2 * MiB


def test_workspaces_are_taken_only_by_threads_that_run_cublas():
    """A convolution runs cuDNN, not cuBLAS: a conv-only step takes no cuBLAS workspace; a Linear head
    takes one in the forward, one in the backward and the cuBLASLt one."""
    conv_only = estimate(lambda: convnet(head=False), IMAGES, loss=total, device=H100)
    with_head = estimate(lambda: convnet(head=True), IMAGES, loss=ce, device=H100)
    assert conv_only.workspaces == 0
    assert with_head.workspaces == 2 * 32 * MiB + 1 * MiB


def test_a_step_that_runs_cudnn_adds_its_handle_to_the_hopper_context():
    """Measured on the H200: NVML less reserved was 740-742 MiB for steps without cuDNN, 758 MiB with it."""
    linear = estimate(lambda: mlp(), BATCH, loss=ce, device=H100)
    conv = estimate(lambda: convnet(head=True), IMAGES, loss=ce, device=H100)
    assert 740 * MiB <= linear.cuda_context <= 742 * MiB
    assert 758 * MiB <= conv.cuda_context <= 760 * MiB
    assert conv.device_total == conv.peak_reserved + conv.cuda_context


class Attention(nn.Module):
    """One self-attention through SDPA: flash in 16 bits, memory-efficient in fp32 (as the emulated GPU picks)."""

    def __init__(self, masked: bool = False) -> None:
        super().__init__()
        self.qkv, self.masked = nn.Linear(64, 3 * 64), masked

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 16, 3, 4, 16).permute(2, 0, 3, 1, 4)
        mask = torch.zeros(16, 16, device=x.device, dtype=q.dtype) if self.masked else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.masked)


def test_a_step_that_runs_16_bit_fused_attention_loads_its_kernels_into_the_hopper_context():
    """Measured on the H200 (benchmarks/gpu_context_ops.py): +16 MiB at a 16-bit flash SDPA, +18 MiB at a 16-bit
    memory-efficient one, 2 MiB (within the base) in fp32; every 16-bit transformer step of the zoo read 758 MiB,
    a 16-bit ViT (cuDNN too) as much as a CNN."""
    tokens = torch.randn(2, 16, 64)

    def context(precision: str, masked: bool = False) -> int:
        return estimate(lambda: Attention(masked), tokens, loss=lambda m, b: m(b).float().sum(), optimizer="sgd",
                        precision=precision, device="H200").cuda_context

    base = context("32-true")
    assert 740 * MiB <= base <= 742 * MiB
    assert context("bf16-mixed") == context("16-mixed") == context("bf16-true") == base + 16 * MiB  # flash
    assert context("bf16-mixed", masked=True) == base + 16 * MiB  # memory-efficient
    assert estimate(lambda: mlp(), BATCH, loss=ce, precision="bf16-mixed", device="H200").cuda_context == base
    from memplan.estimator.cuda.workspaces import LibraryWorkspaces

    seen = LibraryWorkspaces(0, 0)
    q = torch.empty(2, 4, 16, 16, dtype=torch.bfloat16, device="meta")
    seen.due(torch.ops.aten._scaled_dot_product_efficient_attention.default, (q, q, q, None, True), {},
             backward=False, stream=0)
    seen.due(torch.ops.aten._scaled_dot_product_flash_attention.default, (q.float(), q, q), {}, backward=False,
             stream=0)  # an fp32 query: no 16-bit kernels
    assert seen.attention_16bit == {"efficient"}
    hopper = cuda_overheads((9, 0))
    assert hopper.step_context_bytes(cudnn=False, attention_16bit={"flash", "efficient"}) == base + 16 * MiB
    # a 16-bit ViT (cuDNN for its patch convolution, flash attention) read 758 MiB, as a CNN: cuDNN's 18 MiB only
    assert hopper.step_context_bytes(cudnn=True, attention_16bit={"flash"}) == hopper.step_context_bytes(cudnn=True)


def test_hopper_eager_context_is_at_least_the_measured_bare_one():
    eager = cuda_overheads((9, 0), env={"CUDA_MODULE_LOADING": "EAGER"})
    assert 1_310_720_000 <= eager.context_bytes < 1536 * MiB  # 1250 MiB measured bare, below the old 1.5 GiB guess
    assert cuda_overheads((10, 0), env={"CUDA_MODULE_LOADING": "EAGER"}).context_bytes == 1536 * MiB  # unmeasured


def test_a_true_precision_batch_on_a_gpu_holds_only_the_converted_copy():
    """Lightning converts a '-true' batch before moving it: the loader's float32 batch stays in host memory."""
    x, y = torch.randn(256, 100), torch.randint(0, 8, (256,))
    est = estimate(lambda: nn.Linear(100, 8), (x, y), loss=ce, precision="16-true", device=H100)
    converted = [x.numel() * 2, y.numel() * y.element_size()]  # float16 inputs, labels kept
    assert est.batch == sum(-(-n // 512) * 512 for n in converted)  # CUDA blocks: multiples of 512 B
    assert not any("loader's float32 batch" in note for note in est.notes)
