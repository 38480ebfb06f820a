"""The caching allocator's settings: PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF parsed as
c10/core/AllocatorConfig.cpp does (torch 2.13), with the constants of AllocatorConfig.h and
CUDACachingAllocator.cpp the allocator model (memplan.estimator.allocator) replays."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from memplan.units import MiB

# Constants of c10/core/AllocatorConfig.h (torch 2.13) and CUDACachingAllocator.cpp.
MIN_BLOCK_SIZE = 512  # kMinBlockSize: every size is rounded to at least 512 bytes
SMALL_SIZE = 1 * MiB  # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small-pool segment, and small expandable page
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: requests below it get a large_segment_size block
ROUND_LARGE = 2 * MiB  # kRoundLarge: larger requests get a segment rounded up to 2 MiB
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: default large_segment_size / max_non_split_rounding
SIZE_MAX = (1 << 64) - 1  # std::numeric_limits<size_t>::max(): "no max_split_size"
_IGNORED_KEYS = frozenset({  # accepted by torch 2.13, no effect on device-memory figures
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb", "pinned_max_round_threshold", "pinned_max_cached_size",
    "graph_capture_record_stream_reuse", "per_process_memory_fraction", "pinned_free_catch_all",
    "throw_on_cudamalloc_oom"})


def config_error(key: str, msg: str) -> ValueError:
    """The error for a bad PYTORCH_ALLOC_CONF key, naming the variable and the key."""
    return ValueError(f"PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF key '{key}': {msg}")


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """The caching-allocator settings of PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF."""

    expandable_segments: bool = False
    """`expandable_segments:True`: one growing segment per pool instead of one per cudaMalloc."""
    max_split_size_bytes: int | None = None
    """`max_split_size_mb`: blocks this large are never split; None means unlimited."""
    max_non_split_rounding_bytes: int = LARGE_BUFFER
    """`max_non_split_rounding_mb`: how much larger than a >= max_split request a reused block may be."""
    large_segment_size_bytes: int = LARGE_BUFFER
    """`large_segment_size_mb`: segment for 1-10 MiB requests, and the large expandable page."""
    roundup_power2_divisions: tuple[int, ...] = (0,) * 16
    """Divisions per power-of-two interval [1 MiB * 2**i, 2 MiB * 2**i) (i=0 also covers < 1 MiB)."""
    garbage_collection_threshold: float = 0.0
    """Accepted and ignored: it only acts under set_per_process_memory_fraction on a full device."""
    backend: Literal["native", "cudaMallocAsync"] = "native"
    """`backend:`; only the native caching allocator is modelled."""

    def __post_init__(self) -> None:
        mss = self.max_split_size_bytes
        if mss is not None and (not isinstance(mss, int) or mss < LARGE_BUFFER):
            raise config_error("max_split_size_mb", f"must be >= 20 (MiB), or unset; got {mss} bytes")
        if self.max_non_split_rounding_bytes < LARGE_BUFFER:
            raise config_error("max_non_split_rounding_mb", "must be >= 20 (MiB)")
        if self.large_segment_size_bytes <= MIN_LARGE_ALLOC:
            raise config_error("large_segment_size_mb", "must be > 10 (MiB)")
        divs = self.roundup_power2_divisions
        if len(divs) != 16 or any(d < 0 or d & (d - 1) for d in divs):
            raise config_error("roundup_power2_divisions", f"need 16 powers of two or 0; got {divs}")
        if self.garbage_collection_threshold and not 0.0 < self.garbage_collection_threshold < 1.0:
            raise config_error("garbage_collection_threshold", "set it in (0.0, 1.0)")
        if self.backend not in ("native", "cudaMallocAsync"):
            raise config_error("backend", f"options are native and cudaMallocAsync; got {self.backend!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> AllocatorConfig:
        """Read PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF; only the first one set is parsed,
        as AcceleratorAllocatorConfig::instance() does (c10/core/AllocatorConfig.cpp)."""
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
            if name in env:
                return cls.parse(env[name])
        return cls()

    @classmethod
    def parse(cls, text: str) -> AllocatorConfig:
        """Parse 'key:value,key:[k:v,...]' like ConfigTokenizer + AcceleratorAllocatorConfig::parseArgs."""
        toks, buf = [], ""
        for ch in text:
            if ch in ",:[]":
                toks += [buf, ch] if buf else [ch]
                buf = ""
            elif not ch.isspace():
                buf += ch
        toks += [buf] if buf else []
        out: dict = {}
        i = 0
        while i < len(toks):
            key = toks[i]
            if key in ",:[]" or i + 2 >= len(toks) or toks[i + 1] != ":":
                raise config_error(key, "expected 'key:value'")
            if toks[i + 2] == "[":
                if "]" not in toks[i + 3:]:
                    raise config_error(key, "list value is missing its closing ']'")
                end = toks.index("]", i + 3)
                value: str | list[str] = toks[i + 3:end]
                i = end + 1
            else:
                value, i = toks[i + 2], i + 3
            out.update(_parse_key(key, value))
            if i < len(toks):
                if toks[i] != ",":
                    raise config_error(key, f"expected ',' after the value; got {toks[i]!r}")
                i += 1
        return cls(**out)

    def divisions(self, size: int) -> int:
        """AcceleratorAllocatorConfig::roundup_power2_divisions(size)."""
        log_size = size.bit_length() - 1
        return self.roundup_power2_divisions[min(max(log_size - 20, 0), 15)]


def _int(key: str, value, *, low: int, strict: bool = False) -> int:
    if not isinstance(value, str) or not value.isdigit():
        raise config_error(key, f"expected a whole number; got {value!r}")
    n = int(value)
    if n < low or (strict and n == low):
        raise config_error(key, f"must be {'>' if strict else '>='} {low}; got {n}")
    return n


def _parse_key(key: str, value) -> dict:
    if key == "max_split_size_mb":  # parseMaxSplitSize: val >= kLargeBuffer / kMB
        return {"max_split_size_bytes": _int(key, value, low=20) * MiB}
    if key == "max_non_split_rounding_mb":
        return {"max_non_split_rounding_bytes": _int(key, value, low=20) * MiB}
    if key == "large_segment_size_mb":  # parseLargeSegmentSize: val > kMinLargeAlloc / kMB
        return {"large_segment_size_bytes": _int(key, value, low=10, strict=True) * MiB}
    if key == "expandable_segments":  # ConfigTokenizer::toBool accepts exactly True / False
        if value not in ("True", "False"):
            raise config_error(key, f"expected True or False (capitalised); got {value!r}")
        return {"expandable_segments": value == "True"}
    if key == "garbage_collection_threshold":
        try:
            t = float(value)
        except (TypeError, ValueError):
            raise config_error(key, f"expected a number in (0.0, 1.0); got {value!r}") from None
        return {"garbage_collection_threshold": t}
    if key == "roundup_power2_divisions":
        return {"roundup_power2_divisions": _parse_divisions(key, value)}
    if key == "backend":
        return {"backend": value}
    if key in _IGNORED_KEYS:
        return {}
    raise config_error(key, "unrecognized key (torch raises too); check the spelling in PYTORCH_ALLOC_CONF")


def _parse_divisions(key: str, value) -> tuple[int, ...]:
    """parseRoundUpPower2Divisions: 'N' for every interval, or '[64:8,256:4,>:1]' by interval."""
    def pow2(v: str, *, zero_ok: bool) -> int:
        n = _int(key, v, low=0)
        if (n == 0 and not zero_ok) or n & (n - 1):
            raise config_error(key, f"divisions and interval starts must be powers of 2; got {n}")
        return n

    if isinstance(value, str):
        return (pow2(value, zero_ok=False),) * 16
    divs, last, first = [0] * 16, 0, True
    entries = [e for e in value if e != ","]
    if len(entries) % 3 or any(entries[j + 1] != ":" for j in range(0, len(entries), 3)):
        raise config_error(key, f"expected [start_mb:divisions, ..., >:divisions]; got {value}")
    for start, _, val in zip(*[iter(entries)] * 3):
        n = pow2(val, zero_ok=True)
        if start == ">":
            divs[last + 1:] = [n] * (15 - last)
            continue
        index = min(pow2(start, zero_ok=False).bit_length() - 1, 15)
        if first:
            divs[:index], first = [n] * index, False
        divs[index], last = n, index
    return tuple(divs)
