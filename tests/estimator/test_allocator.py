"""CachingAllocatorModel against the rules of c10/cuda/CUDACachingAllocator.cpp.

Every expected figure is worked out by hand from the C++ (round_size, get_allocation_size,
get_free_block, should_split, free_block / try_merge_blocks, map_block), written next to it.
The allocator settings (PYTORCH_ALLOC_CONF) are tests/estimator/test_allocator_config.py's.
"""
import random

import pytest

from memplan.estimator.allocator import (
    AllocatorConfig,
    CachingAllocatorModel,
    ExactAllocatorModel,
    round_size,
)
from memplan.units import KiB, MiB


def caching(**config) -> CachingAllocatorModel:
    return CachingAllocatorModel(AllocatorConfig(**config))


# -- rounding and pools -------------------------------------------------------------------------
def test_one_byte_takes_512_bytes_of_a_fresh_2mib_small_segment():
    a = caching()
    h = a.malloc(1)  # round_size: < 512 -> 512; small pool; get_allocation_size -> kSmallBuffer
    assert a.block_bytes(h) == 512
    assert (a.allocated_bytes, a.reserved_bytes) == (512, 2 * MiB)


def test_two_600kib_requests_share_one_small_segment():
    a = caching()
    a.malloc(600 * KiB)  # 2 MiB segment, remainder 1448 KiB >= 512 B -> split
    a.malloc(600 * KiB)  # best fit: the 1448 KiB remainder
    assert a.allocated_bytes == 1200 * KiB
    assert a.reserved_bytes == 2 * MiB


def test_requests_are_rounded_up_to_512_bytes():
    a = caching()
    h = a.malloc(1000)  # ceil(1000 / 512) * 512
    assert a.block_bytes(h) == 1024
    assert a.allocated_bytes == 1024


def test_3mib_takes_a_20mib_segment_whose_rest_serves_a_5mib_request():
    a = caching()
    a.malloc(3 * MiB)  # 1 MiB < size < 10 MiB -> kLargeBuffer (20 MiB); rest 17 MiB > 1 MiB: split
    assert (a.allocated_bytes, a.reserved_bytes) == (3 * MiB, 20 * MiB)
    a.malloc(5 * MiB)  # lower_bound finds the 17 MiB free block: no new cudaMalloc
    assert (a.allocated_bytes, a.reserved_bytes) == (8 * MiB, 20 * MiB)


def test_12mib_reserves_exactly_12mib():
    a = caching()
    a.malloc(12 * MiB)  # >= kMinLargeAlloc: rounded up to a multiple of 2 MiB
    assert (a.allocated_bytes, a.reserved_bytes) == (12 * MiB, 12 * MiB)


def test_just_over_12mib_reserves_14mib_and_splits_off_the_rest():
    a = caching()
    h = a.malloc(12 * MiB + 1)  # round_size -> 12 MiB + 512; segment 14 MiB; rest 2 MiB - 512 > 1 MiB
    assert a.block_bytes(h) == 12 * MiB + 512
    assert a.reserved_bytes == 14 * MiB


def test_exactly_1mib_is_small_pool_and_just_over_is_large():
    a = caching()
    a.malloc(1 * MiB)  # kSmallSize is the largest small request: 2 MiB segment
    assert a.reserved_bytes == 2 * MiB
    a.malloc(1 * MiB + 1)  # large pool: a 20 MiB segment of its own
    assert a.reserved_bytes == 22 * MiB


# -- splitting --------------------------------------------------------------------------------
def test_unsplit_remainder_counts_as_allocated():
    a = caching()
    a.malloc(3 * MiB)  # leaves a 17 MiB free block
    h = a.malloc(16 * MiB + 512 * KiB)  # reuses it; rest 0.5 MiB is not > 1 MiB: no split
    assert a.block_bytes(h) == 17 * MiB
    assert a.allocated_bytes == 20 * MiB
    assert a.reserved_bytes == 20 * MiB


def test_large_pool_splits_only_when_more_than_1mib_remains():
    a = caching()
    h = a.malloc(19 * MiB)  # 20 MiB segment (2 MiB rounding), rest exactly 1 MiB: not split
    assert a.block_bytes(h) == 20 * MiB
    b = caching()
    h = b.malloc(18 * MiB + 512 * KiB)  # rest 1.5 MiB > 1 MiB: split
    assert b.block_bytes(h) == 18 * MiB + 512 * KiB


def test_small_pool_splits_down_to_512_byte_remainders():
    a = caching()
    a.malloc(2 * MiB - 512)  # > kSmallSize: large pool, 20 MiB segment
    assert a.reserved_bytes == 20 * MiB
    s = caching()
    s.malloc(1 * MiB)
    h = s.malloc(1 * MiB - 512)  # 1 MiB free remains; rest 512 B >= kMinBlockSize: split
    assert s.block_bytes(h) == 1 * MiB - 512
    assert s.allocated_bytes == 2 * MiB - 512


# -- best fit and coalescing ------------------------------------------------------------------
def test_best_fit_picks_the_smallest_free_block_that_fits():
    a = caching()
    h12, h14 = a.malloc(12 * MiB), a.malloc(14 * MiB)
    a.free(h14)
    a.free(h12)
    h = a.malloc(11 * MiB)  # the 12 MiB block (rest 1 MiB: unsplit), not the 14 MiB one
    assert a.block_bytes(h) == 12 * MiB
    assert a.reserved_bytes == 26 * MiB


def test_free_coalesces_neighbours_so_a_larger_request_reuses_the_segment():
    a = caching()
    h3, h5 = a.malloc(3 * MiB), a.malloc(5 * MiB)  # [3][5][12 free] in one 20 MiB segment
    a.free(h5)  # merges with the 12 MiB tail -> 17 MiB
    a.free(h3)  # merges with it -> the whole 20 MiB
    h = a.malloc(18 * MiB)  # fits only in the merged block
    assert a.reserved_bytes == 20 * MiB
    assert a.block_bytes(h) == 18 * MiB  # rest 2 MiB > 1 MiB: split
    assert a.allocated_bytes == 18 * MiB


def test_a_free_block_between_live_ones_does_not_merge():
    a = caching()
    h3, _h5, h7 = a.malloc(3 * MiB), a.malloc(5 * MiB), a.malloc(7 * MiB)  # [3][5][7][5 free]
    a.free(h3)
    a.free(h7)  # merges with the 5 MiB tail -> 12 MiB; the 3 MiB block stays apart
    a.malloc(13 * MiB)  # no free block of 13 MiB: new 14 MiB segment
    assert a.reserved_bytes == 34 * MiB
    a.malloc(12 * MiB)  # the merged 12 MiB block fits exactly
    assert a.reserved_bytes == 34 * MiB


# -- max_split_size_mb -------------------------------------------------------------------------
def test_max_split_keeps_oversize_blocks_from_smaller_requests():
    a = caching(max_split_size_bytes=32 * MiB)
    a.free(a.malloc(40 * MiB))  # 40 MiB segment, >= max_split: never split
    a.malloc(24 * MiB)  # < max_split and the only free block is >= max_split: new segment
    assert a.reserved_bytes == 64 * MiB
    plain = caching()
    plain.free(plain.malloc(40 * MiB))
    plain.malloc(24 * MiB)  # without the limit the 40 MiB block is split and reused
    assert plain.reserved_bytes == 40 * MiB


def test_max_split_reuses_oversize_blocks_whole_within_the_rounding_limit():
    a = caching(max_split_size_bytes=32 * MiB)
    a.free(a.malloc(40 * MiB))
    h = a.malloc(36 * MiB)  # >= max_split; 40 < 36 + 20 (max_non_split_rounding): reuse unsplit
    assert a.block_bytes(h) == 40 * MiB
    assert a.reserved_bytes == 40 * MiB
    b = caching(max_split_size_bytes=32 * MiB)
    b.free(b.malloc(60 * MiB))
    b.malloc(36 * MiB)  # 60 >= 36 + 20: too wasteful, new 36 MiB segment
    assert b.reserved_bytes == 96 * MiB


def test_max_split_does_not_split_a_request_at_or_above_the_limit():
    a = caching(max_split_size_bytes=32 * MiB)
    h = a.malloc(33 * MiB - 512 * KiB)  # segment 34 MiB; should_split needs size < max_split
    assert a.block_bytes(h) == 34 * MiB


# -- roundup_power2_divisions ------------------------------------------------------------------
def test_roundup_power2_divisions_rounds_to_the_next_division():
    n = 1 * MiB + 100 * KiB
    assert round_size(n, AllocatorConfig()) == n  # already a multiple of 512
    four = AllocatorConfig(roundup_power2_divisions=(4,) * 16)  # 1 MiB..2 MiB in 256 KiB steps
    assert round_size(n, four) == 1 * MiB + 256 * KiB
    assert round_size(2 * MiB, four) == 2 * MiB  # powers of two stay
    assert round_size(2000, four) == 2048  # not > 512 * 4: plain 512 rounding


def test_roundup_power2_divisions_list_form_by_interval():
    cfg = AllocatorConfig.parse("roundup_power2_divisions:[256:8,>:2]")
    assert cfg.divisions(1 * MiB + 1) == 8  # intervals below 256 MiB take the first value
    assert cfg.divisions(300 * MiB) == 8  # 256..512 MiB
    assert cfg.divisions(600 * MiB) == 2  # '>' covers the rest
    assert round_size(600 * MiB, cfg) == 768 * MiB  # 512 MiB + one 256 MiB division
    a = CachingAllocatorModel(cfg)
    assert a.block_bytes(a.malloc(600 * MiB)) == 768 * MiB


# -- expandable segments -----------------------------------------------------------------------
def test_expandable_maps_20mib_pages_in_the_large_pool_and_2mib_in_the_small():
    a = caching(expandable_segments=True)
    a.malloc(1)
    assert a.reserved_bytes == 2 * MiB
    a.malloc(12 * MiB)  # one 20 MiB page, not a 12 MiB segment
    assert a.reserved_bytes == 22 * MiB
    a.malloc(25 * MiB)  # grows from the free 8 MiB at the end: maps 20 MiB more, 28 >= 25
    assert a.reserved_bytes == 42 * MiB
    assert a.allocated_bytes == 512 + 37 * MiB


def test_expandable_frees_merge_into_one_block_that_serves_a_bigger_request():
    e = caching(expandable_segments=True)
    hs = [e.malloc(12 * MiB) for _ in range(3)]  # 20 MiB page, then +20 MiB: 40 MiB mapped
    assert e.reserved_bytes == 40 * MiB
    for h in hs:
        e.free(h)
    e.malloc(30 * MiB)  # the whole 40 MiB is one free block now
    assert e.reserved_bytes == 40 * MiB
    plain = caching()
    hs = [plain.malloc(12 * MiB) for _ in range(3)]
    for h in hs:
        plain.free(h)
    plain.malloc(30 * MiB)  # three separate 12 MiB segments cannot merge: new segment
    assert plain.reserved_bytes == 66 * MiB


def test_expandable_best_fit_spares_the_block_that_can_grow():
    a = caching(expandable_segments=True)
    h12 = a.malloc(12 * MiB)  # [12][8 free]
    a.malloc(8 * MiB)  # [12][8]: takes the 8 MiB exactly
    a.malloc(16 * MiB)  # maps 20 MiB more: [12][8][16][4 free, then unmapped]
    a.free(h12)  # free: 12 MiB (fixed), 4 MiB (can grow into the unmapped space)
    a.malloc(3 * MiB)  # get_free_block steps from the growable 4 MiB block to the 12 MiB one
    assert a.reserved_bytes == 40 * MiB
    a.malloc(10 * MiB)  # left: 9 MiB and the growable 4 MiB -> grow: map 20 MiB more
    assert a.reserved_bytes == 60 * MiB


def test_expandable_splits_large_blocks_down_to_512_bytes():
    a = caching(expandable_segments=True)
    h = a.malloc(19 * MiB + 512 * KiB)  # should_split: expandable -> remaining >= 512
    assert a.block_bytes(h) == 19 * MiB + 512 * KiB
    assert a.reserved_bytes == 20 * MiB


# -- streams ---------------------------------------------------------------------------------
# get_free_block: `pool.blocks.lower_bound(&p.search_key)`, then `(*it)->stream != p.stream()` -> no
# cached block; BlockComparatorSize orders by stream first. find_expandable_block walks
# `pool->unmapped` from Block(device, stream, 0) while `(*it)->stream == stream`.
@pytest.mark.parametrize("expandable", [False, True])
def test_a_block_freed_on_one_stream_is_not_reused_by_another(expandable):
    a = caching(expandable_segments=expandable)
    a.free(a.malloc(40 * MiB, stream=1))  # 40 MiB cached for stream 1
    assert a.reserved_bytes == 40 * MiB
    h = a.malloc(40 * MiB)  # the default stream: a segment (pages) of its own
    assert a.reserved_bytes == 80 * MiB
    assert a.block_bytes(h) == 40 * MiB  # allocated is the same block size either way
    a.free(h)
    a.malloc(40 * MiB, stream=1)  # stream 1 gets its cached block back
    a.malloc(40 * MiB)  # and so does the default stream
    assert a.reserved_bytes == 80 * MiB
    assert a.reserved_by_stream == {1: 40 * MiB, 0: 40 * MiB}


def test_small_blocks_are_kept_per_stream_too():
    a = caching()
    a.free(a.malloc(1000, stream=2))
    a.malloc(1000)  # the stream-2 small segment is not searched: another 2 MiB
    assert a.reserved_bytes == 4 * MiB
    a.malloc(1000, stream=2)  # reuses its own
    assert a.reserved_bytes == 4 * MiB


def test_freed_blocks_do_not_merge_across_streams():
    a = caching(expandable_segments=True)
    a.free(a.malloc(20 * MiB, stream=1))
    a.free(a.malloc(20 * MiB))
    a.malloc(40 * MiB)  # neither free 20 MiB page is contiguous with the other stream's: map 20 more
    assert a.reserved_bytes == 60 * MiB
    assert a.reserved_by_stream == {1: 20 * MiB, 0: 40 * MiB}


# -- peaks, handles, zero bytes ----------------------------------------------------------------
def test_peaks_and_reset_peaks():
    a = caching()
    h3, h5 = a.malloc(3 * MiB), a.malloc(5 * MiB)
    a.free(h3)
    a.free(h5)
    assert (a.allocated_bytes, a.peak_allocated_bytes) == (0, 8 * MiB)
    assert (a.reserved_bytes, a.peak_reserved_bytes) == (20 * MiB, 20 * MiB)
    a.reset_peaks()
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (0, 20 * MiB)
    a.malloc(2 * MiB)
    assert a.peak_allocated_bytes == 2 * MiB


@pytest.mark.parametrize("model", [CachingAllocatorModel, ExactAllocatorModel])
def test_zero_byte_request_allocates_nothing_and_frees_as_a_no_op(model):
    a = model()
    h = a.malloc(0)
    assert a.block_bytes(h) == 0
    a.free(h)
    a.free(h)
    assert (a.allocated_bytes, a.reserved_bytes, a.peak_reserved_bytes) == (0, 0, 0)


@pytest.mark.parametrize("model", [CachingAllocatorModel, ExactAllocatorModel])
def test_bad_handles_and_sizes_raise(model):
    a = model()
    h = a.malloc(10)
    a.free(h)
    with pytest.raises(ValueError, match="not a live allocation"):
        a.free(h)
    with pytest.raises(ValueError, match="not a live allocation"):
        a.block_bytes(12345)
    with pytest.raises(ValueError, match="non-negative int"):
        a.malloc(-1)


def test_exact_model_counts_bytes_as_requested():
    a = ExactAllocatorModel()
    h1, h2 = a.malloc(1), a.malloc(3 * MiB + 7)
    assert a.block_bytes(h1) == 1
    assert a.allocated_bytes == a.reserved_bytes == 3 * MiB + 8
    a.free(h2)
    assert a.allocated_bytes == a.reserved_bytes == 1
    assert a.peak_allocated_bytes == a.peak_reserved_bytes == 3 * MiB + 8


@pytest.mark.parametrize("expandable", [False, True])
def test_long_random_trace_keeps_the_books_balanced(expandable):
    rng = random.Random(0)
    a = caching(expandable_segments=expandable)
    live: list[int] = []
    for _ in range(20_000):
        if live and rng.random() < 0.48:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            big = rng.random() < 0.4
            live.append(a.malloc(rng.randint(1 * MiB, 64 * MiB) if big else rng.randint(0, 1 * MiB)))
        assert a.allocated_bytes <= a.reserved_bytes
    assert a.allocated_bytes == sum(a.block_bytes(h) for h in live)
    reserved = a.reserved_bytes
    for h in live:
        a.free(h)
    assert a.allocated_bytes == 0 and a.reserved_bytes == reserved  # nothing is given back
    # Once everything is free, every large segment is one block again: reusable whole.
    biggest = max(size for size, _, _ in a._pools[0, False].free)  # the default stream's large pool
    assert a.block_bytes(a.malloc(biggest)) == biggest
    assert a.reserved_bytes == reserved
