"""CUDA reductions' global staging buffer (memplan.estimator.cuda.reduce), against an H100's op-by-op readings."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.api import estimate
from memplan.estimator.cuda.reduce import ReduceDevice, reduce_staging_bytes
from memplan.units import MiB

aten = torch.ops.aten
H100 = ReduceDevice.for_gpu("H100-80GB", (9, 0))

# (shape, dtype, dims) -> bytes the op held above its inputs and output on an H100 80GB HBM3, torch 2.11.0+cu130:
# max_memory_allocated during the op less its before/after, in benchmarks/results/gpu_campaign_raw_h100/ops/
# (bert-b16-ckpt, gpt2-b8-bf16mixed, mixer-b16-bf16mixed, llama-gqa-b4-bf16mixed, lstm-b32): the staging
# buffer plus a 512-byte block of semaphores. Every one is a bias gradient's or a broadcast's column sum.
MEASURED = [
    ((2048, 1024), torch.float32, [0], 16_777_728),
    ((2048, 256), torch.float32, [0], 4_194_816),
    ((1024, 1024), torch.bfloat16, [0], 8_389_120),
    ((1024, 768), torch.bfloat16, [0], 6_291_968),
    ((1024, 256), torch.bfloat16, [0], 2_097_664),
    ((4096, 64), torch.bfloat16, [0], 524_800),
    ((16, 256, 128), torch.bfloat16, [0, 1], 4_194_816),
    ((4, 256, 256), torch.float32, [0, 1], 2_097_664),
    ((32, 64, 5000), torch.float32, [0, 1], 81_920_512),
]


def _blocks(sizes: tuple[int, ...]) -> int:
    return sum(-(-n // 512) * 512 for n in sizes)


@pytest.mark.parametrize("shape, dtype, dims, measured", MEASURED)
def test_staging_matches_the_h100(shape, dtype, dims, measured):
    x = torch.empty(shape, dtype=dtype, device="meta")
    assert _blocks(reduce_staging_bytes(aten.sum.dim_IntList, (x, dims), H100)) == measured


@pytest.mark.parametrize("shape, dims", [((2048, 1024), [1]), ((8, 128, 256), [-1]), ((64,), [0])])
def test_reductions_within_one_block_take_no_staging(shape, dims):
    """Rows reduced along the contiguous dimension, or few inputs per output: one block per output, no buffer."""
    x = torch.empty(shape, device="meta")
    assert reduce_staging_bytes(aten.sum.dim_IntList, (x, dims), H100) == ()
    assert reduce_staging_bytes(aten.mean.dim, (x, dims), H100) == ()


def test_mean_stages_like_sum_and_other_ops_or_no_gpu_take_none():
    x = torch.empty(2048, 1024, device="meta")
    assert reduce_staging_bytes(aten.mean.dim, (x, [0]), H100) == reduce_staging_bytes(aten.sum.dim_IntList, (x, [0]), H100)
    assert reduce_staging_bytes(aten.amax.default, (x, [0]), H100) == ()
    assert reduce_staging_bytes(aten.sum.dim_IntList, (x, [0]), None) == ()


def test_fewer_multiprocessors_split_many_outputs_less():
    """target_grid_size = SMs x blocks per SM bounds the split when the grid is large: a T4 (40 SMs, 1024 threads
    each) splits (2048, 5000)'s columns over 8 blocks where an H100 splits them over 32."""
    x = torch.empty(2048, 5000, device="meta")
    h100 = reduce_staging_bytes(aten.sum.dim_IntList, (x, [0]), H100)[0]
    t4 = reduce_staging_bytes(aten.sum.dim_IntList, (x, [0]), ReduceDevice.for_gpu("T4", (7, 5)))[0]
    assert (h100, t4) == (4 * 5000 * 32 * 128, 4 * 5000 * 8 * 128)


def _absolute(model, batch):
    return model(batch).abs().sum()


def _peak(bias: bool, device: str) -> int:
    return estimate(lambda: nn.Linear(16, 4096, bias=bias), torch.randn(2048, 16), loss=_absolute,
                    optimizer="sgd", precision="bf16-true", device=device).peak_allocated


def test_an_h100_estimate_holds_a_bias_gradients_staging_and_a_cpu_estimate_does_not():
    """Linear(16, 4096) in bf16 on 2048 rows: its bias gradient is `grad.sum(0)` of the (2048, 4096) output's
    gradient, which on an H100 stages fp32 partial sums, 4 B x 4096 outputs x 32 blocks x 128 lanes = 64 MiB, while
    it runs beside that 16 MiB gradient; on CPU a bias adds its 8 KiB (and its gradient)."""
    assert _peak(True, "H100") - _peak(False, "H100") >= 32 * MiB
    assert _peak(True, "cpu") - _peak(False, "cpu") < 1 * MiB
