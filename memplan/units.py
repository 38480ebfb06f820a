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
_SIGNED_SIZE_RE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


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


def parse_size(text: str) -> int:
    """A positive memory size written with its unit, as bytes: '24GiB', '80 GB', '512MiB', '1048576B'.

    A bare number is refused (is '24' GiB, GB or bytes?); so are 0, negative and non-finite sizes.
    The ValueError says what is wrong and gives an example, without naming the input: the caller does.
    """
    match = _SIGNED_SIZE_RE.match(str(text))
    if match and not match.group(2):
        number = match.group(1)
        return _refuse(f"{number} what? Give a unit, e.g. {number}GiB (or {number}GB; B for bytes); got {text!r}")
    if not match or match.group(2).lower() not in _SUFFIXES:
        return _refuse(f"must be a size with a unit, e.g. 24GiB, 80GB or 512MiB (units: B, KiB, MiB, GiB, TiB, "
                       f"KB, MB, GB, TB); got {text!r}")
    value = int(float(match.group(1)) * _SUFFIXES[match.group(2).lower()])
    if value <= 0:
        return _refuse(f"must be a positive size, e.g. 24GiB; got {text!r}")
    return value


def _refuse(message: str) -> int:
    raise ValueError(message)
