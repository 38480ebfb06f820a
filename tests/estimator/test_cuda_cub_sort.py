"""cub's radix-sort storage (memplan.estimator.cuda.cub_sort) from NVIDIA/cccl's dispatch and tuning source, and a
CUDA-target trace holding a long sort's buffers while the sort runs. From the source: no GPU reading covers a sort
over more than one tile."""
from __future__ import annotations

import pytest
import torch
from op_reading import op_transients
from torch import nn

from memplan.estimator.api import estimate
from memplan.estimator.cuda.cub_sort import radix_sort_temp_bytes, segmented_radix_sort_temp_bytes
from memplan.hardware.catalog import streaming_multiprocessors

aten = torch.ops.aten
H100 = {"compute_capability": (9, 0), "sm_count": 132}
A100 = {"compute_capability": (8, 0), "sm_count": 108}


def aliased(*sizes: int) -> int:
    """AliasTemporaries (util_temporary_storage.cuh): each buffer rounded up to 256 bytes, plus 255."""
    return sum(-(-n // 256) * 256 for n in sizes) + 255


def test_a_sort_of_one_tile_asks_for_one_byte():
    """SingleTilePolicy <256 threads, 19 items> scaled to the int64 index (RegBoundScaling: 19 x 4 / 8 = 9 items):
    up to 2,304 pairs run in one block (index_put's 2,048 held one 512-byte block on the H100)."""
    for gpu in (H100, A100):
        assert radix_sort_temp_bytes(2_304, 8, 8, **gpu) == 1
        assert radix_sort_temp_bytes(2_305, 8, 8, **gpu) > 2_305 * 16  # the extra keys and values, and more


@pytest.mark.parametrize(("gpu", "tile"), [
    (H100, 384 * 14),  # Policy900, 4-byte keys with 8-byte values: 384 threads x 29 items, scaled to 14
    (A100, 384 * 8),  # Policy800 with 64-bit offsets: 384 x 17, scaled to 8
])
def test_onesweep_holds_the_extra_keys_and_values_bins_lookback_and_counters(gpu, tile):
    """float32 keys, int64 values, 2**20 items: 4 passes of 8 bits, one portion (under 2**28 items)."""
    n, passes = 1 << 20, 4
    bins = passes * 256 * 8  # per pass, 256 digits of unsigned long long
    lookback = -(-n // tile) * 256 * 4  # per tile, 256 int32
    expected = aliased(bins, lookback, n * 4, n * 8, passes * 4)
    assert radix_sort_temp_bytes(n, 4, 8, **gpu) == expected


def test_onesweep_of_one_pass_has_no_extra_buffers():
    """SortStable's second sort: int64 keys only over 3 segment bits, one pass, so cub sorts straight into keys_out;
    Policy900's keys-only 8-byte tile is 384 x 30 items, scaled to 15."""
    n = 80_000
    assert radix_sort_temp_bytes(n, 8, 0, bits=3, **H100) == aliased(256 * 8, -(-n // (384 * 15)) * 1024, 0, 0, 4)


def test_small_keys_before_sm90_take_the_passes_with_a_spine():
    """bf16 keys on sm80: no onesweep (keys under 4 bytes); the spine is (grid x 128 digits + the scan tile)
    offsets, the grid counted as 1 block per SM x CUB_SUBSCRIPTION_FACTOR 5; the scan tile is 512 x 11 items."""
    n = 100_000
    spine = (108 * 5 * 128 + 512 * 11) * 8
    assert radix_sort_temp_bytes(n, 2, 8, **A100) == aliased(spine, n * 2, n * 8)
    tile = 512 * 11  # sm90_small_key_tuning<2, 8, 8>: 512 threads x 23 items, scaled to 11
    expected = aliased(2 * 256 * 8, -(-n // tile) * 1024, n * 2, n * 8, 2 * 4)
    assert radix_sort_temp_bytes(n, 2, 8, **H100) == expected


def test_segmented_sort_holds_the_extra_keys_and_values():
    assert segmented_radix_sort_temp_bytes(256 * 5000, 2, 8) == aliased(256 * 5000 * 2, 256 * 5000 * 8)


class Sorter(nn.Module):
    """Sorts its scaled input along the last dim."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return (x * self.scale).sort(dim=-1).values.mean()


def blocks(*sizes: int) -> int:
    return sum(-(-n // 512) * 512 for n in sizes)


@pytest.mark.parametrize(("device", "cc"), [("H100-80GB", (9, 0)), ("A100-80GB", (8, 0))])
def test_a_traced_long_sort_holds_its_index_buffers_and_cubs_storage_while_it_runs(monkeypatch, device, cc):
    """One row of 100,000 floats on a CUDA target: the reverse indices and cub's storage for the target's tiles
    are held inside the sort, on top of its outputs, and freed when it returns."""
    n = 100_000
    seen = op_transients(monkeypatch, aten.sort.default)
    estimate(lambda: Sorter(n), torch.randn(1, n), loss=lambda m, b: m(b), optimizer="sgd", device=device)
    gpu = {"compute_capability": cc, "sm_count": streaming_multiprocessors(device, cc)}
    assert seen and set(seen) == {blocks(n * 8, radix_sort_temp_bytes(n, 4, 8, **gpu))}
    assert seen[0] > n * 4 + n * 8  # more than the sort's own outputs: the extra keys and values
