"""What a GPU's memory readings fell back on when a source failed mid-run (NVML lost, CUDA's figures or
torch's counters failing too), by code: memplan.hardware.readings records them, MemoryPlanner gathers
them from every rank into the end-of-fit summary and its run log, `memplan report` shows them. No
torch here: the report reads it.
"""
from __future__ import annotations

FALLBACKS = {
    "nvml": "NVML gave no memory reading, so the device's figures came from CUDA's mem_get_info and this "
            "process's own share was not available",
    "cuda": "NVML and CUDA's mem_get_info both failed, so the device's figures were missing",
    "stats": "torch.cuda.memory_stats failed, so torch's counters were missing",
}
"""What a GPU's readings fell back on when a source failed mid-run, by code (the warning says it once
when it happens; the end-of-fit summary says it again)."""


def fallback_mask(codes: tuple[str, ...]) -> int:
    """`codes` as bits (for the end-of-fit gather of every rank's figures)."""
    return sum(1 << i for i, code in enumerate(FALLBACKS) if code in codes)


def fallback_lines(masks: list[int]) -> list[str]:
    """The end-of-fit summary's lines for the ranks whose readings fell back: 'ranks 0, 1: NVML gave ...'."""
    lines = []
    for i, (code, text) in enumerate(FALLBACKS.items()):
        ranks = [rank for rank, mask in enumerate(masks) if mask >> i & 1]
        if ranks:
            lines.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text} during this fit")
    return lines
