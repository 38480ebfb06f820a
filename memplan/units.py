"""Byte units. memplan keeps every figure in bytes (int) and formats only when printing."""
from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_SUFFIXES = {
    "b": 1, "": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def format_bytes(num_bytes: int | float) -> str:
    """Human-readable binary units: 1536 -> '1.50 KiB'. Display only; never parse this back."""
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= size:
            return f"{sign}{value / size:.2f} {unit}"
    return f"{sign}{int(value)} B"


def parse_bytes(text: str | int, *, field: str = "size") -> int:
    """'24GiB' -> 25769803776; '80GB' -> 80e9. Decimal and binary units are both accepted, never mixed up."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{field} must be a non-negative number of bytes; got {text}")
        return text
    match = _SIZE_RE.match(str(text))
    if not match or match.group(2).lower() not in _SUFFIXES:
        raise ValueError(
            f"{field} must be a size such as '24GiB', '80GB' or '1048576'; got {text!r}"
        )
    return int(float(match.group(1)) * _SUFFIXES[match.group(2).lower()])
