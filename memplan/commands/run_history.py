"""One rank's records of one run, folded as they are read (memplan.commands.log_reader feeds it):
figures over every sample, a thinned set of samples for the plot, and the other events.

Records arrive either parsed (a dict) or, from the reader's fast path, as raw lines with the few
figures the fold needs already folded over them (`add_samples`). Raw lines are decoded only when shown:
the plot's samples and the latest records, a few thousand lines of a million.
"""
from __future__ import annotations

import json
import math
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memplan.commands.log_scan import SampleFigures

PLOT_POINTS = 1024
"""Samples kept per rank for the plot (1024 to 2048): every k-th, k doubling as the run grows. The PNG
is ~1200 pixels wide, so more would not show (the figures in the summary are taken from every sample)."""
EVENTS_KEPT = 256
"""Records of one kind (changes, OOM retries, ...) kept per rank; past it they are counted, and the
latest replaces the last one kept."""

Record = dict[str, Any]


def sample_peak_bytes(sample: Record) -> int | None:
    """A sample's process peak, as memplan.hardware.readings.MemoryReading.process_peak_bytes: on a GPU
    NVML's figure plus what torch held above now at the interval's peak; on CPU the peak RSS."""
    process, reserved, peak = sample.get("process_bytes"), sample.get("reserved_bytes"), sample.get("peak_bytes")
    return peak_of(process, reserved, peak)


def peak_of(process: int | None, reserved: int | None, peak: int | None) -> int | None:
    """sample_peak_bytes from the three figures."""
    if reserved is None:
        return peak if peak is not None else process
    if process is None or peak is None:
        return process
    return process + max(0, peak - reserved)


def _kept(records: list[Record], record: Record) -> None:
    if len(records) < EVENTS_KEPT:
        records.append(record)
    else:
        records[-1] = record


@dataclass(kw_only=True)
class RankHistory:
    """One rank's records of one run, folded as they are read: figures over every sample, the plot's
    thinned samples, and the other events (up to EVENTS_KEPT of each kind, the latest always last)."""

    rank: int
    """Global rank."""
    path: Path
    """Its rank<R>.jsonl."""
    sample_count: int = 0
    """`sample` events read."""
    sample_stride: int = 1
    changes: list[Record] = field(default_factory=list)
    """`change` events: shared micro-batch / checkpointing decisions with cause and reason."""
    oom_retries: list[Record] = field(default_factory=list)
    """`oom_retry` events."""
    oom_retry_count: int = 0
    fatals: list[Record] = field(default_factory=list)
    """`fatal` events."""
    applies: list[Record] = field(default_factory=list)
    """`apply` events (layout and plan)."""
    summaries: list[Record] = field(default_factory=list)
    """`summary` events at the end of fit."""
    ends: list[Record] = field(default_factory=list)
    """`end` events: the log closed, with how the fit ended."""
    device_total_bytes: int | None = None
    """The largest device total a sample reported."""
    _samples: list[bytes | Record] = field(default_factory=list)
    _last: bytes | Record | None = None
    _last_sample: bytes | Record | None = None
    _peak: int | None = None
    _low: int | None = None
    _latest_extra: bool = False

    @property
    def samples(self) -> list[Record]:
        """`sample` events for the plot: every `sample_stride`-th, and the latest last."""
        kept = self._samples
        raw = [i for i, value in enumerate(kept) if type(value) is bytes]
        if raw:  # in one call, which shares the key strings among the records (a third of their memory)
            for i, record in zip(raw, json.loads(b"[" + b",".join([kept[i] for i in raw]) + b"]")):
                kept[i] = record
        return kept  # type: ignore[return-value]

    @property
    def last(self) -> Record | None:
        """The rank's latest record of the run."""
        if type(self._last) is bytes:
            same = self._last is self._last_sample
            self._last = json.loads(self._last)
            if same:
                self._last_sample = self._last
        return self._last  # type: ignore[return-value]

    @property
    def last_sample(self) -> Record | None:
        """The rank's latest `sample`."""
        if type(self._last_sample) is bytes:
            same = self._last is self._last_sample
            self._last_sample = json.loads(self._last_sample)
            if same:
                self._last = self._last_sample
        return self._last_sample  # type: ignore[return-value]

    def decode(self) -> None:
        """Decode the raw lines kept (the plot's samples, the latest records) now."""
        self.samples, self.last, self.last_sample  # noqa: B018

    def add(self, record: Record) -> None:
        """Fold one parsed record of this rank's run in."""
        self._last = record
        event = record["event"]
        if event == "sample":
            self._add_sample(record)
        elif event == "change":
            _kept(self.changes, record)
        elif event == "oom_retry":
            self.oom_retry_count += 1
            _kept(self.oom_retries, record)
        elif event == "fatal":
            _kept(self.fatals, record)
        elif event == "apply":
            _kept(self.applies, record)
        elif event == "summary":
            _kept(self.summaries, record)
            self._fold(record.get("peak_process_bytes"), record.get("min_headroom_bytes"))
        elif event == "end":
            _kept(self.ends, record)

    def _add_sample(self, record: Record) -> None:
        self.sample_count += 1
        self._last_sample = record
        total = record.get("device_total_bytes")
        if total and (self.device_total_bytes is None or total > self.device_total_bytes):
            self.device_total_bytes = total
        self._fold(sample_peak_bytes(record), record.get("headroom_bytes"))
        if self._latest_extra:  # the stand-in for the latest sample gives way
            self._samples.pop()
        self._latest_extra = (self.sample_count - 1) % self.sample_stride != 0
        self._samples.append(record)
        if not self._latest_extra and len(self._samples) >= 2 * PLOT_POINTS:
            latest = self._samples[-1]
            self._samples = self._samples[::2]  # every (2 x stride)-th sample; the latest stays, as a stand-in
            self.sample_stride *= 2
            if self._samples[-1] is not latest:
                self._samples.append(latest)
                self._latest_extra = True

    def add_samples(self, figures: SampleFigures, lines: Sequence[bytes]) -> None:
        """Fold in consecutive `sample` records the reader's fast path checked: `lines` (raw, kept
        undecoded) and their `figures` (log_scan.SampleShape.fold). The same result as add() of each
        record in turn."""
        if not lines:
            return
        self._fold(figures.peak_bytes, figures.min_headroom_bytes)
        largest = figures.device_total_bytes
        if largest and (self.device_total_bytes is None or largest > self.device_total_bytes):
            self.device_total_bytes = largest
        self._thin_in(lines)
        self._last = self._last_sample = lines[-1]

    def _thin_in(self, lines: Sequence[bytes]) -> None:
        """Keep every sample_stride-th of `lines` (numbered on from sample_count), thinning as add()
        does, with the latest last."""
        start, n = self.sample_count, len(lines)
        if self._latest_extra:
            self._samples.pop()
            self._latest_extra = False
        stride = self.sample_stride
        j = (-start) % stride  # the first line whose number is a multiple of the stride
        tail_is_latest = False
        while j < n:
            self._samples.append(lines[j])
            tail_is_latest = j == n - 1
            if len(self._samples) >= 2 * PLOT_POINTS:
                self._samples = self._samples[::2]  # (the last, at an odd place, goes)
                stride *= 2
                tail_is_latest = False
            number = start + j
            j = (number // stride + 1) * stride - start  # the next multiple of the stride
        self.sample_stride = stride
        self.sample_count = start + n
        if not tail_is_latest:
            self._samples.append(lines[-1])  # the latest, as a stand-in
            self._latest_extra = True

    def _fold(self, peak: int | None, low: int | None) -> None:
        if peak is not None and (self._peak is None or peak > self._peak):
            self._peak = peak
        if low is not None and (self._low is None or low < self._low):
            self._low = low

    @property
    def budget_bytes(self) -> int | None:
        """The plan's per-device budget (free memory less the planning margin), where a plan was applied."""
        budgets = [a["plan"]["device_budget_bytes"] for a in self.applies
                   if a.get("plan") and isinstance(a["plan"].get("device_budget_bytes"), int)]
        return budgets[-1] if budgets else None

    @property
    def peak_process_bytes(self) -> int | None:
        """The process's peak over the run (as MemoryReading.process_peak_bytes, then the summary's)."""
        return self._peak

    @property
    def min_headroom_bytes(self) -> int | None:
        return self._low

    @property
    def ended(self) -> str | None:
        """How the rank's fit ended ("finished", "failed: ..."), or None while it runs."""
        if self.ends:
            return str(self.ends[-1].get("status", "ended"))
        if self.fatals:
            return "failed: out of memory"
        return "finished" if self.summaries else None

    @property
    def ended_by_signal(self) -> str | None:
        """The name of the signal that ended the rank's fit ('SIGTERM'), from its `end` record; None: none."""
        if not self.ends:
            return None
        end = self.ends[-1]
        if "signal" not in end:  # a log written before the field
            return signal_of_old_status(str(end.get("status", "")))
        return end["signal"] if isinstance(end["signal"], str) and end["signal"] else None

    @property
    def ended_at(self) -> float:
        """When the rank's log closed (its `end` record's time); +inf while it runs or when unknown."""
        when = self.ends[-1].get("time") if self.ends else self.fatals[-1].get("time") if self.fatals else None
        return float(when) if isinstance(when, (int, float)) else math.inf


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """One run found in a log folder."""

    run: str
    """Its id (NO_RUN_ID for logs written before run ids)."""
    started: float
    """Time of its first record (seconds since the epoch)."""
    last_step: int
    """The highest step any rank logged."""
    ranks: tuple[int, ...]
    """Ranks with records of it."""


def signal_of_old_status(status: str) -> str | None:
    """Compat, for logs written before the `end` record had its `signal` field: the signal read back out of the
    status text the callback wrote then ('failed: RankTerminated: 143': 128 + 15, 'SIGTERM'), or None."""
    match = re.search(r"RankTerminated: (\d+)\b", status)
    if match is None or not 128 < int(match.group(1)) < 128 + 65:
        return None
    try:
        return signal.Signals(int(match.group(1)) - 128).name
    except ValueError:
        return None
