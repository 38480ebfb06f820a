"""Turn a stream of (malloc nbytes / free) events into what the allocator would report.

`CachingAllocatorModel` replays PyTorch's CUDA caching allocator as written in pytorch/pytorch
c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator: malloc, round_size, get_pool,
get_allocation_size, get_free_block, should_split, alloc_found_block, free_block,
try_merge_blocks; for expandable segments find_expandable_block, map_block and
try_allocate_expandable_block), with settings parsed as c10/core/AllocatorConfig.cpp does.
Its `allocated_bytes` / `reserved_bytes` and peaks are what `torch.cuda.memory_allocated`,
`memory_reserved`, `max_memory_allocated` and `max_memory_reserved` return.

Left out on purpose:
- Streams. The tracer sees one stream; no block waits on CUDA events (record_stream).
- Running out of memory. The device is infinite: cudaMalloc never fails, so cached blocks are
  never released to retry (release_available_cached_blocks / release_cached_blocks),
  expandable pages are never unmapped, and garbage_collection_threshold (active only with
  set_per_process_memory_fraction) never runs. Reserved memory only grows: on a device that
  fits, an upper bound of what the real allocator reserves.
- Addresses. Real cudaMalloc addresses are unknown; new segments get increasing addresses,
  which only decides ties between free blocks of equal size.
- CUDA-graph private pools, MemPools, settings changed mid-run (_set_allocator_settings), and
  backend:cudaMallocAsync (rejected with an error).
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import Protocol

from memplan.estimator.allocator_config import (
    MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, ROUND_LARGE, SIZE_MAX, SMALL_BUFFER, SMALL_SIZE, AllocatorConfig, config_error,
)

_UNBOUNDED = 1 << 62  # virtual size of an expandable segment on the infinite device
ZERO_HANDLE = 0
"""Handle for a 0-byte request: no block, frees as a no-op (allocate() skips malloc for 0)."""


def round_size(nbytes: int, config: AllocatorConfig) -> int:
    """DeviceCachingAllocator::round_size (+ roundup_power2_next_division)."""
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    div = config.divisions(nbytes)
    if div > 1 and nbytes > MIN_BLOCK_SIZE * div:
        if nbytes & (nbytes - 1) == 0:
            return nbytes
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor >> (div.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = nbytes & ~(step - 1)
        return nbytes if low == nbytes else low + step
    return -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


class AllocatorModel(Protocol):
    """What the tracer calls; both models below implement it."""

    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int

    def malloc(self, nbytes: int) -> int: ...
    def free(self, handle: int) -> None: ...
    def block_bytes(self, handle: int) -> int: ...
    def reset_peaks(self) -> None: ...


class _ModelBase:
    """Stats kept like increase_stat / decrease_stat / reset_peak_stat, and handle bookkeeping."""

    allocated_bytes = property(lambda self: self._stats[0], doc="torch.cuda.memory_allocated()")
    reserved_bytes = property(lambda self: self._stats[1], doc="torch.cuda.memory_reserved()")
    peak_allocated_bytes = property(lambda self: self._stats[2], doc="torch.cuda.max_memory_allocated()")
    peak_reserved_bytes = property(lambda self: self._stats[3], doc="torch.cuda.max_memory_reserved()")

    def __init__(self) -> None:
        self._stats = [0, 0, 0, 0]  # allocated, reserved, peak allocated, peak reserved
        self._live: dict[int, object] = {}
        self._next_handle = ZERO_HANDLE + 1

    def _add_allocated(self, n: int) -> None:
        st = self._stats
        st[0] += n
        st[2] = max(st[2], st[0])

    def _add_reserved(self, n: int) -> None:
        st = self._stats
        st[1] += n
        st[3] = max(st[3], st[1])

    def reset_peaks(self) -> None:
        """Like torch.cuda.reset_peak_memory_stats(): each peak restarts at its current value."""
        self._stats[2:] = self._stats[:2]

    def _register(self, item: object) -> int:
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self._live[handle] = item
        return handle

    def _get(self, handle: int, *, pop: bool = False):
        if handle not in self._live:
            raise ValueError(f"handle {handle!r} is not a live allocation: free each handle that "
                             "malloc returned exactly once")
        return self._live.pop(handle) if pop else self._live[handle]

    @staticmethod
    def _check(nbytes: int) -> None:
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"malloc nbytes must be a non-negative int; got {nbytes!r}")


class ExactAllocatorModel(_ModelBase):
    """CPU target: bytes as requested, nothing cached, reserved == allocated."""

    def malloc(self, nbytes: int) -> int:
        self._check(nbytes)
        if nbytes == 0:  # alloc_cpu(0) returns nullptr: no allocation
            return ZERO_HANDLE
        self._add_allocated(nbytes)
        self._add_reserved(nbytes)
        return self._register(nbytes)

    def free(self, handle: int) -> None:
        if handle != ZERO_HANDLE:
            nbytes = self._get(handle, pop=True)
            self._add_allocated(-nbytes)
            self._add_reserved(-nbytes)

    def block_bytes(self, handle: int) -> int:
        """Bytes counted as allocated for this handle (0 for a 0-byte request)."""
        if handle == ZERO_HANDLE:
            return 0
        return self._get(handle)


class _Block:
    """A Block of CUDACachingAllocator.cpp: a slice of one segment, linked to its neighbours."""

    __slots__ = ("ptr", "size", "small", "allocated", "mapped", "prev", "next")

    def __init__(self, ptr: int, size: int, small: bool, mapped: bool = True) -> None:
        self.ptr, self.size, self.small, self.mapped, self.allocated = ptr, size, small, mapped, False
        self.prev: _Block | None = None
        self.next: _Block | None = None


@dataclass(eq=False)
class _Pool:
    """A BlockPool: free blocks ordered as BlockComparatorSize orders them (size, then address)."""

    small: bool
    free: list = field(default_factory=list)  # sorted (size, ptr, block)
    tail: _Block | None = None  # unmapped rest of the pool's expandable segment

    def insert(self, b: _Block) -> None:
        insort(self.free, (b.size, b.ptr, b))

    def remove(self, b: _Block) -> None:
        del self.free[bisect_left(self.free, (b.size, b.ptr))]


class CachingAllocatorModel(_ModelBase):
    """PyTorch's CUDA caching allocator (native backend) on one stream of an infinite device.

    With `expandable_segments`, each pool owns one segment that grows at its end by whole pages,
    2 MiB for the small pool and `large_segment_size` (20 MiB) for the large pool, as
    find_expandable_block / map_block do; pages are never unmapped (nothing runs out here).
    """

    def __init__(self, config: AllocatorConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config if config is not None else AllocatorConfig()
        if cfg.backend != "native":
            raise config_error("backend", "memplan models the native caching allocator only; remove "
                        "'backend:cudaMallocAsync' from PYTORCH_ALLOC_CONF to plan with it")
        self._pools = {True: _Pool(True), False: _Pool(False)}
        self._max_split = cfg.max_split_size_bytes or SIZE_MAX
        self._next_ptr = 1 << 32

    def malloc(self, nbytes: int) -> int:
        """DeviceCachingAllocator::malloc; returns an opaque handle."""
        self._check(nbytes)
        if nbytes == 0:  # NativeCachingAllocator::allocate calls malloc only if size != 0
            return ZERO_HANDLE
        size = round_size(nbytes, self.config)
        pool = self._pools[size <= SMALL_SIZE]  # get_pool
        block = self._get_free_block(pool, size)
        if block is None:  # alloc_block
            block = self._expand(pool, size) if self.config.expandable_segments else self._segment(pool, size)
        if self._should_split(block, size):
            block = self._split(pool, block, size)
        block.allocated = True
        self._add_allocated(block.size)  # alloc_found_block counts block->size, not the request
        return self._register(block)

    def free(self, handle: int) -> None:
        """DeviceCachingAllocator::free -> free_block: merge with free neighbours, keep cached."""
        if handle == ZERO_HANDLE:
            return
        block: _Block = self._get(handle, pop=True)
        self._add_allocated(-block.size)
        block.allocated = False
        pool = self._pools[block.small]
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.insert(block)

    def block_bytes(self, handle: int) -> int:
        """Bytes counted as allocated for this handle: its block, rounding and unsplit rest included."""
        if handle == ZERO_HANDLE:
            return 0
        return self._get(handle).size

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """get_free_block: best fit = lower_bound on (size, address), then the max_split rules."""
        free = pool.free
        i = bisect_left(free, (size,))
        if i == len(free):
            return None
        if self.config.expandable_segments:
            # A block next to unmapped space counts as the size it could grow to; step to the
            # next block while that one is smaller in this sense (the loop in get_free_block).
            while i + 1 < len(free) and _grow_size(free[i + 1][2]) < _grow_size(free[i][2]):
                i += 1
        block = free[i][2]
        if size < self._max_split and block.size >= self._max_split:
            return None  # do not return an oversized block for a smaller request
        if size >= self._max_split and block.size >= size + self.config.max_non_split_rounding_bytes:
            return None  # an oversized block may be reused only within max_non_split_rounding
        del free[i]
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK_SIZE
        return size < self._max_split and remaining > SMALL_SIZE

    def _split(self, pool: _Pool, rest: _Block, size: int) -> _Block:
        """alloc_found_block with split_remainder: the front `size` bytes become the new block."""
        block = _Block(rest.ptr, size, rest.small)
        block.prev, block.next = rest.prev, rest
        if rest.prev is not None:
            rest.prev.next = block
        rest.prev = block
        rest.ptr += size
        rest.size -= size
        pool.insert(rest)
        return block

    def _merge(self, pool: _Pool, dst: _Block, src: _Block | None) -> None:
        """try_merge_blocks: absorb a free neighbour with the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        pool.remove(src)
        if dst.prev is src:  # [src dst]
            dst.ptr, dst.prev = src.ptr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _segment(self, pool: _Pool, size: int) -> _Block:
        """alloc_block: cudaMalloc a new segment of get_allocation_size(size)."""
        if pool.small:
            alloc = SMALL_BUFFER
        elif size < MIN_LARGE_ALLOC:
            alloc = self.config.large_segment_size_bytes
        else:
            alloc = -(-size // ROUND_LARGE) * ROUND_LARGE
        block = _Block(self._next_ptr, alloc, pool.small)
        self._next_ptr += alloc
        self._add_reserved(alloc)
        return block

    def _expand(self, pool: _Pool, size: int) -> _Block:
        """try_allocate_expandable_block: grow the pool's segment at its lowest free address."""
        if pool.tail is None:  # find_expandable_block creates the segment on first use
            pool.tail = _Block(self._next_ptr, _UNBOUNDED, pool.small, mapped=False)
            self._next_ptr += _UNBOUNDED
        tail = pool.tail
        candidate = tail.prev if tail.prev is not None and not tail.prev.allocated else tail
        if not candidate.mapped:
            candidate = self._map(pool, candidate, size)
        while candidate.size < size:
            candidate = self._map(pool, candidate.next, size - candidate.size)
        pool.remove(candidate)
        return candidate

    def _map(self, pool: _Pool, to_map: _Block, size: int) -> _Block:
        """map_block: map whole pages at the start of the unmapped tail, merge with a free prev."""
        page = SMALL_BUFFER if pool.small else self.config.large_segment_size_bytes
        mapped = -(-size // page) * page
        rest = _Block(to_map.ptr + mapped, to_map.size - mapped, pool.small, mapped=False)
        rest.prev, to_map.next = to_map, rest
        pool.tail = rest
        to_map.size, to_map.mapped = mapped, True
        self._merge(pool, to_map, to_map.prev)
        pool.insert(to_map)
        self._add_reserved(mapped)
        return to_map


def _grow_size(b: _Block) -> int:
    """expandable_size in get_free_block: size plus the unmapped space right after the block."""
    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
