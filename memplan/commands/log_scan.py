"""Log lines into what the reader folds: any line the slow way (json.loads, then the checks a record
must pass), and `sample` lines on a fast path: checked and taken apart by one regular expression per
chunk, with no JSON object built for them, and their figures folded as columns (SampleShape.fold).

A rank log is almost all `sample` records, each written by the same code with the same keys in the
same order (memplan.callback.rank_log.RankLog.write). The first one parsed the slow way gives the
shape: a pattern of that exact line, key by key, that admits only what json.loads would read to the
same values and what the slow way's checks (`problem`) would accept (byte figures within +-1 PiB,
a step up to 10^12, a time from 1970 to 5138 written with a decimal point, no nested value, no
escape in a string, bounded lengths). A line that does not match is read the slow way, so the fast
path changes no result; it only skips building ~20-key dicts for a million lines, and decodes none
of them until shown. The figures a batch of lines adds (the highest peak, the least headroom, ...)
are taken from all its captured numbers at once: one numpy parse of their text, exact (every
captured number is an integer under 10^15, a null stands in as -2^62, and the earliest time is parsed
by Python from its own text).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from memplan.callback.runlog import DICT_FIELDS

MAX_STEP = 10**12
"""A step above this is not a step a run reached: the line is skipped as impossible."""
MAX_LOGGED_BYTES = 1 << 50
"""A byte figure beyond +-1 PiB is not a reading: the line is skipped as impossible."""
FIGURES = ("step", "time", "process_bytes", "reserved_bytes", "peak_bytes", "headroom_bytes", "device_total_bytes")
"""The values a shape's pattern captures (the time as two groups: its whole seconds and its decimals):
all a batch of samples adds to RankHistory."""
COLUMNS = ("step", "seconds", "decimals", "process_bytes", "reserved_bytes", "peak_bytes", "headroom_bytes",
           "device_total_bytes")
"""A shape's captured groups, in SampleShape.order's order (after the line itself, before another line)."""
MAX_KEYS = 64
"""A record with more keys is read the slow way (a shape's lines stay far below MAX_LINE_BYTES)."""

_INT = rb"-?(?:0|[1-9]\d{0,99})"  # (json.loads refuses ints past 4300 digits: bounded well below)
_NUMBER = rb"-?(?:0|[1-9]\d{0,99})(?:\.\d{1,100})?(?:[eE][-+]?\d{1,3})?"
_STRING = rb'"[ !#-\[\]-~]{0,4096}"'  # printable ASCII, no quote, no backslash: the text json.loads gives
_SCALAR = rb"(?:" + _NUMBER + rb"|" + _STRING + rb"|true|false|null)"
_BYTES = rb"(?:null|0|[1-9]\d{0,14})"  # < 10^15 < 1 PiB (MAX_LOGGED_BYTES)
_SIGNED_BYTES = rb"(?:null|-?(?:0|[1-9]\d{0,14}))"  # headroom may be negative
_STEP = rb"(?:0|[1-9]\d{0,11})"  # < 10^12 (MAX_STEP)
_TIME = rb"((?:0|[1-9]\d{0,10}))\.(\d{1,9})"  # 0 <= time < 10^11, as json.dumps writes a float: two groups
_KEY = re.compile(r"[ !#-\[\]-~]{1,200}")


@dataclass(frozen=True, kw_only=True)
class SampleFigures:
    """What consecutive `sample` lines of one shape add to a rank's history: the same as each record
    folded in turn (RankHistory.add)."""

    last_step: int
    """The highest step among them."""
    started: float
    """The earliest time among them."""
    peak_bytes: int | None
    """The highest process peak (run_history.sample_peak_bytes) among them."""
    min_headroom_bytes: int | None
    """The least headroom among them."""
    device_total_bytes: int | None
    """The largest device total among them."""


@dataclass(frozen=True)
class SampleShape:
    """One layout of `sample` lines: its keys in order, its run id, and the pattern of a chunk's lines:
    one match a line, whose groups are the line itself and its figures for a line of this shape, or
    all empty but the last, the line itself, for any other line."""

    signature: tuple[Any, ...]
    run: str
    pattern: re.Pattern[bytes]
    order: tuple[int, ...]
    """Where each of COLUMNS is among a match's groups."""

    def fold(self, groups: list[tuple[bytes, ...]]) -> SampleFigures:
        """The figures of lines of this shape (checked by its pattern), from their matches' `groups`
        (zip(*matches): one tuple per group, the lines themselves first), folded."""
        text = b" ".join(map(b" ".join, groups[1:1 + len(COLUMNS)]))  # JSON integers (the decimals as digits)
        if b"n" in text:  # a null byte figure (CPU runs have no device figures): as an integer no figure is
            text = text.replace(NULL, _NULL_TEXT)
        values = _integers(text, len(COLUMNS), len(groups[0]))
        if values is not None:
            return self._fold_array(values, groups)
        return self._fold_columns(groups)

    def _fold_array(self, values, groups: list[tuple[bytes, ...]]) -> SampleFigures:
        import numpy as np

        step, seconds, _, process, reserved, peak, headroom, total = (values[i - 1] for i in self.order)
        whole, decimals = groups[self.order[1]], groups[self.order[2]]
        first = np.flatnonzero(seconds == seconds.min()).tolist()  # the earliest second's lines, read exactly
        started = min(float(whole[i] + b"." + decimals[i]) for i in first)
        # run_history.peak_of, a line at a time: with a null figure, the peak or the process figure (null if
        # that is); else process + max(0, peak - reserved), which is max(process, process + peak - reserved).
        # (Each figure is under 2^50 and a null -2^62: no sum here leaves int64.)
        no_reserved, no_peak = reserved == _NULL_VALUE, peak == _NULL_VALUE
        known = ~no_reserved & ~no_peak & (process != _NULL_VALUE)
        peaks = np.where(no_reserved, np.where(no_peak, process, peak),
                         np.where(known, np.maximum(process, process + (peak - reserved)), process))
        return SampleFigures(last_step=int(step.max()), started=started, peak_bytes=_highest(peaks),
                             min_headroom_bytes=_lowest(headroom), device_total_bytes=_highest(total))

    def _fold_columns(self, groups: list[tuple[bytes, ...]]) -> SampleFigures:
        """As _fold_array, one value at a time (without numpy)."""
        from memplan.commands.run_history import peak_of

        step, seconds, decimals, process, reserved, peak, headroom, total = (groups[i] for i in self.order)
        started = min(map(float, map(b".".join, zip(seconds, decimals))))
        highest = max((p for p in map(peak_of, *(map(_integer, c) for c in (process, reserved, peak)))
                       if p is not None), default=None)
        lowest = min((int(v) for v in headroom if v != NULL), default=None)
        largest = max((int(v) for v in set(total) if v != NULL), default=None)
        return SampleFigures(last_step=max(map(int, step)), started=started, peak_bytes=highest,
                             min_headroom_bytes=lowest, device_total_bytes=largest)


NULL = b"null"
_NULL_VALUE = -(1 << 62)
"""A null byte figure in SampleShape.fold's array: below any figure a line of a shape can hold (+-2^50)."""
_NULL_TEXT = str(_NULL_VALUE).encode()


def _highest(column) -> int | None:
    """The largest of a column of SampleShape.fold's array, nulls left out (None if all are)."""
    known = column[column != _NULL_VALUE]
    return int(known.max()) if known.size else None


def _lowest(column) -> int | None:
    known = column[column != _NULL_VALUE]
    return int(known.min()) if known.size else None


def _integer(text: bytes) -> int | None:
    return None if text == NULL else int(text)


def _integers(text: bytes, rows: int, columns: int):
    """The integers of `text` (space-separated, each within +-2^62) as a rows x columns int64 array,
    exact, or None without numpy (or where they do not make rows x columns)."""
    try:
        import numpy as np
    except ImportError:  # (a dependency of matplotlib's: only a broken install lands here)
        return None
    try:
        values = np.fromstring(text, dtype=np.int64, sep=" ")
    except ValueError:  # (never: the pattern admits only integers)
        return None
    return values.reshape(rows, columns) if values.size == rows * columns else None


_SHAPES: dict[tuple[Any, ...], SampleShape | None] = {}


def sample_shape(record: dict[str, Any]) -> SampleShape | None:
    """The shape of `record`'s line (a `sample` record that passed the slow path's checks), or None
    where its lines cannot take the fast path (a nested value, no time, a key with odd characters)."""
    keys = tuple(record)
    run = record.get("run")
    types = tuple(type(v).__name__ for v in record.values())
    signature = (keys, types, run)
    if signature in _SHAPES:
        return _SHAPES[signature]
    if len(_SHAPES) > 256:
        _SHAPES.clear()
    _SHAPES[signature] = shape = _build(record, signature)
    return shape


def _build(record: dict[str, Any], signature: tuple[Any, ...]) -> SampleShape | None:
    run = record.get("run")
    if record.get("event") != "sample" or type(run) is not str or type(record.get("time")) is not float \
            or len(record) > MAX_KEYS:
        return None
    if not all(f in record for f in FIGURES[2:]):
        return None
    parts = []
    for key, value in record.items():
        if not _KEY.fullmatch(key):
            return None
        name = json.dumps(key).encode() + b": "
        if key == "event":
            parts.append(name + b'"sample"')
        elif key == "run":
            if not re.fullmatch(_STRING, json.dumps(run).encode()):
                return None
            parts.append(name + re.escape(json.dumps(run).encode()))
        elif key in FIGURES:
            kind = {"step": _STEP, "headroom_bytes": _SIGNED_BYTES}.get(key, _BYTES)
            parts.append(name + (_TIME if key == "time" else b"(" + kind + b")"))
        elif key[-6:] == "_bytes":
            parts.append(name + (_SIGNED_BYTES if key[-14:] == "headroom_bytes" else _BYTES))
        elif key in DICT_FIELDS:
            parts.append(name + b"null")  # (an object there is not a sample of this shape)
        elif isinstance(value, (dict, list)):
            return None
        else:  # this line's own value first (most repeat line after line: a fifth less matching), then any
            parts.append(name + b"(?:" + re.escape(json.dumps(value).encode()) + b"|" + _typed(value)[3:])
    line = rb"\{" + rb", ".join(parts) + rb"\}"
    groups = ["line", *(c for k in record if k in FIGURES for c in (("seconds", "decimals") if k == "time" else (k,)))]
    order = tuple(groups.index(c) for c in COLUMNS)  # (findall gives the groups in the line's order)
    return SampleShape(signature, run, re.compile(rb"^(" + line + rb")$|^(.*)$", re.M), order)


def _typed(value: Any) -> bytes:
    """A value like the shape's first one (null allowed too), any scalar where it was null: a
    non-capturing group, `(?:...)`."""
    if type(value) is bool:
        return rb"(?:true|false|null)"
    if type(value) is int:
        return rb"(?:" + _INT + rb"|null)"
    if type(value) is float:
        return rb"(?:" + _NUMBER + rb"|null)"
    if type(value) is str:
        return rb"(?:" + _STRING + rb"|null)"
    return _SCALAR


# --- the slow way: any line ------------------------------------------------------------------------
BAD = object()
"""parse_many's mark for a line to parse alone."""


def parse_many(lines: list[bytes]) -> list[Any]:
    """Each line's JSON value, parsed in one call where every line is one object (the common case:
    about half the cost of a call per line); BAD marks the lines to parse one by one."""
    if all(line[:1] == b"{" and line.rstrip()[-1:] == b"}" for line in lines):
        try:
            values = json.loads(b"[" + b",".join(lines) + b"]")
        except (ValueError, RecursionError):
            values = None
        if values is not None and len(values) == len(lines) and all(type(v) is dict for v in values):
            return values
    return [BAD] * len(lines)


def parse_one(line: bytes) -> Any:
    """A line's JSON value, or why it is not one (a str)."""
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8"
    except (ValueError, RecursionError):  # json.JSONDecodeError, and numbers Python cannot hold
        return "not JSON"


_NAMED: dict[tuple[str, ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}


def problem(record: Any) -> str | None:
    """Why a parsed line is not a record memplan can show, or None: runlog.record_problem's schema
    checks (the same reasons, in one pass, for speed on long logs), then values no run can log: a
    10^30-byte peak, negative bytes, a step of 10^20, a time before 1970 or after 5138."""
    if type(record) is not dict:
        return "not a JSON object"
    step = record.get("step")
    if type(step) is not int or step < 0:
        return "no integer step"
    if type(record.get("event")) is not str:
        return "no event"
    when = record.get("time")
    if when is not None and type(when) is not float and type(when) is not int:
        return "time is not a number"
    keys = tuple(record)
    named = _NAMED.get(keys)
    if named is None:  # the byte and object fields of records with these keys (one event's records share them)
        if len(_NAMED) > 4096:
            _NAMED.clear()
        named = _NAMED[keys] = (tuple(k for k in keys if k[-6:] == "_bytes"), tuple(k for k in keys if k in DICT_FIELDS))
    byte_fields, dict_fields = named
    for name in byte_fields:
        value = record[name]
        if value is not None:
            if type(value) is not int:
                return f"{name} is not a byte count"
            if not (-MAX_LOGGED_BYTES if name[-14:] == "headroom_bytes" else 0) <= value <= MAX_LOGGED_BYTES:
                return f"impossible {name}"
    for name in dict_fields:
        if record[name] is not None and type(record[name]) is not dict:
            return "a layout or plan field is not an object"
    if step > MAX_STEP:
        return "impossible step"
    if when is not None and not 0 <= when < 1e11:
        return "impossible time"
    return None
