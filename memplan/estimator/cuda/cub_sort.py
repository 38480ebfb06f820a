"""cub's temporary storage for the radix sorts ATen runs (`temp_storage_bytes` of CUB_WRAPPER's first call, which
aten/src/ATen/cuda/cub.cuh then takes from the caching allocator and frees when the sort returns).

Read from NVIDIA/cccl v3.1.0 (CUDA 13's CCCL; the formulas and tunings below are the same in v2.8.0 and v3.2.0),
not checked on a GPU (the H100 readings hold no sort over more than one tile):

- cub/cub/device/dispatch/dispatch_radix_sort.cuh `DispatchRadixSort::Invoke` (lines 1050-1100): a sort of at
  most one single-tile block's items asks for 1 byte (`InvokeSingleTile`, lines 295-304); a larger one runs
  `InvokeOnesweep` where the policy's ONESWEEP is set, else `InvokePasses`.
- `InvokeOnesweep` (lines 558-593): bins (portions x passes x 256 x sizeof(OffsetT)), a lookback of 256 int32 per
  tile, an extra key and value buffer (num_items each; only with more than one 8-bit pass, since ATen's
  pointer API does not let cub overwrite its input: is_overwrite_okay = false) and one int32 counter per pass.
- `InvokePasses` (lines 822-903): a spine of (max downsweep grid x radix digits + the scan tile) OffsetT and the
  extra key and value buffers. The grid is the downsweep kernel's occupancy x SMs x 5 (CUB_SUBSCRIPTION_FACTOR,
  util_arch.cuh line 111); the occupancy is read at run time: counted here as 1 block per SM, a lower bound.
- `DispatchSegmentedRadixSort::InvokePasses` (lines 1485-1525): the extra key and value buffers only.
- cub/cub/util_temporary_storage.cuh `AliasTemporaries`: each buffer rounded up to 256 bytes, plus 255.
- OffsetT: ATen passes num_items as int64_t, so cub's choose_offset_t gives unsigned long long (8 bytes) and the
  policies' OFFSET_64BIT holds.
- Tile sizes (cub/cub/device/dispatch/tuning/tuning_radix_sort.cuh `policy_hub`): they depend on the GPU
  architecture whose kernels run (sm70 and older: Policy700, sm80 to sm89: Policy800, sm90 and newer: Policy900 /
  Policy1000, which agree for 8-byte values), scaled by `RegBoundScaling` (util_arch.cuh lines 141-149) for the
  larger of key and value (an int64 index here). Onesweep runs for keys of 4 bytes or more before sm90 and for
  every key from sm90; smaller keys before sm90 take `InvokePasses`.
"""
from __future__ import annotations

_ALIGN = 256  # AliasTemporaries' ALIGN_BYTES
_OFFSET = 8  # sizeof(unsigned long long): cub's OffsetT for ATen's int64_t num_items
_INT = 4  # sizeof(int): onesweep's AtomicOffsetT / PortionOffsetT
_DIGITS = 256  # 1 << ONESWEEP_RADIX_BITS
_PORTION_BITS = 28  # PORTION_SIZE = ((1 << 28) - 1) / tile * tile
_SMEM = 48 * 1024  # detail::max_smem_per_block
_SUBSCRIPTION = 5  # CUB_SUBSCRIPTION_FACTOR
_SM90_SMALL_KEYS = {1: (384, 18), 2: (512, 23)}
"""sm90_small_key_tuning<key bytes, 8, 8> (threads, items): the onesweep tile of 1- and 2-byte keys with an
8-byte value on sm90; sm100_small_key_tuning<.., 8, 8> leaves these as sm90's."""


def _scaled(threads: int, items: int, dominant: int) -> int:
    """RegBoundScaling<threads, items, T>: the tile (BLOCK_THREADS x ITEMS_PER_THREAD) for T of `dominant` bytes."""
    items = max(1, items * 4 // max(4, dominant))
    threads = min(threads, -(-(_SMEM // (dominant * items)) // 32) * 32)
    return threads * items


def _onesweep_tile(key: int, value: int, cc: tuple[int, int]) -> int | None:
    """Items per onesweep tile, or None where the policy runs `InvokePasses` (keys under 4 bytes before sm90)."""
    dominant = max(key, value or 1)
    if cc >= (9, 0):  # OnesweepSmallKeyTunedPolicy
        if key < 4:
            return _scaled(*_SM90_SMALL_KEYS[key], dominant) if value == 8 else _scaled(384, 23, dominant)
        if key == 4:
            items = (19 if not value else 17 if value < 8 else 29)  # 20 - OFFSET_64BIT (- 1 for float keys)
            return _scaled(384, items, dominant)
        return _scaled(384, 30 if value < 8 else 24, dominant)
    if key < 4:
        return None
    if cc >= (8, 0):  # Policy800
        return _scaled(384, 17 if key == 4 and value else 21, dominant)
    return _scaled(256, 46 if key == 4 and value == 4 else 23, dominant)  # Policy700


def _aliased(*sizes: int) -> int:
    return sum(-(-n // _ALIGN) * _ALIGN for n in sizes) + _ALIGN - 1


def radix_sort_temp_bytes(n: int, key: int, value: int, *, bits: int | None = None,
                          compute_capability: tuple[int, int], sm_count: int) -> int:
    """`DeviceRadixSort::SortPairs` (value > 0) or `SortKeys` (value 0) of `n` items with keys of `key` bytes and
    values of `value` bytes over `bits` key bits (all by default), through ATen's pointer API: the temporary
    storage cub asks for."""
    if n <= 0:
        return 1
    bits = key * 8 if bits is None else bits
    dominant = max(key, value or 1)
    if n <= _scaled(256, 19, dominant):  # every policy's SingleTilePolicy: 256 threads, 19 items nominal
        return 1
    extra = (n * key, n * value)
    tile = _onesweep_tile(key, value, tuple(compute_capability))
    if tile is not None:
        passes = -(-bits // 8)
        portion = ((1 << _PORTION_BITS) - 1) // tile * tile
        portions = -(-n // portion)
        blocks = -(-min(n, portion) // tile)
        bins, lookback = portions * passes * _DIGITS * _OFFSET, blocks * _DIGITS * _INT
        return _aliased(bins, lookback, *(extra if passes > 1 else (0, 0)), portions * passes * _INT)
    digits = 1 << (7 if key > 1 else 5)  # PRIMARY_RADIX_BITS
    scan_tile = 512 * max(1, min(23 * 4 // _OFFSET, 46))  # AgentScanPolicy<512, 23, OffsetT>, MemBoundScaling
    spine = (sm_count * _SUBSCRIPTION * digits + scan_tile) * _OFFSET  # occupancy counted as 1 block per SM
    return _aliased(spine, *extra)


def segmented_radix_sort_temp_bytes(n: int, key: int, value: int) -> int:
    """`DeviceSegmentedRadixSort::SortPairs` of `n` items in all through ATen's pointer API: the extra key and value
    buffers."""
    return 1 if n <= 0 else _aliased(n * key, n * value)
