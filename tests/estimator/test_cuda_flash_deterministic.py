"""Flash attention's backward under deterministic algorithms (memplan.estimator.cuda.op_scratch): mha_bwd's dQ
accumulator gets one copy per split, nsplits = ceil(SMs / (B x H)) (flash_api.cpp). Read on an H200 as the rule
gives it (benchmarks/results/gpu_rules.md, tests/benchmarks/test_gpu_rules.py)."""
from __future__ import annotations

import pytest
import torch
from op_reading import op_transients
from torch import nn

from memplan.estimator.api import estimate
from memplan.estimator.cuda.op_scratch import CudaGpu, cuda_op_scratch_bytes
from memplan.hardware.catalog import streaming_multiprocessors

aten = torch.ops.aten
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_backward.default


def backward_args(batch, heads, seq, dim):
    """q, k, v, out, grad_out bf16 as [B, H, S, D] views of [B, S, H, D], as SDPA's flash path hands them over."""
    view = torch.empty(batch, seq, heads, dim, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    scalar = torch.empty((), dtype=torch.int64, device="meta")
    lse = torch.empty(batch, heads, seq, device="meta")
    return (view, view, view, view, view, lse, None, None, seq, seq, 0.0, True, scalar, scalar)


def rule_bytes(batch, heads, seq, dim, splits):
    """softmax_d [B, H, S128] fp32 and dq_accum [splits, B, S128, H, D32] fp32, each block-rounded."""
    rows, head = -(-seq // 128) * 128, -(-dim // 32) * 32
    return sum(-(-n // 512) * 512 for n in (batch * heads * rows * 4, splits * batch * rows * heads * head * 4))


@pytest.mark.parametrize(("shape", "sm_count"), [
    ((1, 8, 1024, 64), 132),  # an H100: 17 splits
    ((2, 12, 512, 72), 108),  # an A100: 5 splits, head dim rounded to 96
    ((4, 32, 256, 128), 132),  # 128 heads x batch cover the 132 SMs but for 4: 2 splits
    ((16, 16, 256, 64), 108),  # B x H = 256 >= SMs: one split, as without determinism
])
def test_deterministic_flash_backward_holds_one_dq_accumulator_per_split(shape, sm_count):
    gpu = CudaGpu(compute_capability=(9, 0) if sm_count == 132 else (8, 0), sm_count=sm_count)
    batch, heads = shape[:2]
    splits = -(-sm_count // (batch * heads))
    assert cuda_op_scratch_bytes(FLASH_BACKWARD, backward_args(*shape), {}, gpu, deterministic=True) == \
        rule_bytes(*shape, splits)


def test_flash_backward_splits_only_under_deterministic_algorithms_without_warn_only(process_flags):
    """attention_backward.cu passes deterministic=true only when deterministic algorithms are on and not warn_only;
    the rule reads the setting it is given, never this process's flags."""
    shape, gpu = (1, 8, 1024, 64), CudaGpu(compute_capability=(9, 0), sm_count=132)
    for flags in ((False, False), (True, False), (True, True)):
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        for given, splits in ((False, 1), ("warn", 1), (True, 17)):
            assert cuda_op_scratch_bytes(FLASH_BACKWARD, backward_args(*shape), {}, gpu, deterministic=given) == \
                rule_bytes(*shape, splits)


class Attention(nn.Module):
    """Causal self-attention over [B, S, H x D] with SDPA (flash on an sm80+ target for bf16)."""

    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(heads * dim, 3 * heads * dim, dtype=torch.bfloat16)

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float().mean()


@pytest.mark.parametrize("device", ["H100-80GB", "A100-80GB"])
def test_a_traced_deterministic_flash_backward_holds_the_split_accumulators_while_it_runs(monkeypatch, device):
    """B = 1, H = 8, S = 1024, D = 64 in bf16: inside the backward the trace holds the copy of grad_out, softmax_d
    and ceil(SMs / 8) dQ accumulators, where it held one without determinism (estimate(deterministic=...))."""
    seen = op_transients(monkeypatch, FLASH_BACKWARD)
    x = torch.randn(1, 1024, 8 * 64, dtype=torch.bfloat16)
    held = {}
    for mode in (False, True):
        estimate(lambda: Attention(8, 64), x, loss=lambda m, b: m(b), optimizer="sgd", device=device,
                 precision="bf16-true", deterministic=mode)
        held[mode], seen[:] = set(seen), []
    splits = -(-streaming_multiprocessors(device, (9, 0) if device.startswith("H100") else (8, 0)) // 8)
    copy = 1 * 1024 * 8 * 64 * 2  # grad_out reaches the op laid out [B, H, S, D]: mha_bwd copies it to [B, S, H, D]
    assert held[True] == {copy + rule_bytes(1, 8, 1024, 64, splits)}
    assert copy + rule_bytes(1, 8, 1024, 64, 1) in held[False]
