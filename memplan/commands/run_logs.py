"""Find and read one run of MemoryPlanner's per-rank logs for `memplan report` and `memplan watch`.

A log folder (memplan/ under a Lightning version folder) holds rank<R>.jsonl; a parent of several
(lightning_logs/) holds one folder per version. One folder may hold several runs (fits that shared a
log_dir): each record names its run, and one run is shown (the newest unless asked), the others listed.

The logs are streamed, never held: a FolderReader reads each file in chunks from where it stopped
and folds every record into per-rank figures (peaks, counts, the latest reading) and a thinned set of
plot points, so memory stays bounded however long the run, and `watch` reads only what was appended
since its last refresh. Nothing here raises on what a log holds: bad lines (not JSON, impossible
values, longer than MAX_LINE_BYTES) are skipped and counted by reason; files that are not regular
files (a FIFO) or not named as MemoryPlanner names them (rank01.jsonl) are named, not read.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memplan.callback.runlog import DICT_FIELDS, LOG_GLOB
from memplan.files import NotAFile, open_regular
from memplan.units import format_bytes

NO_RUN_ID = "(no run id)"
"""The run of records written before run ids were logged."""
MAX_LINE_BYTES = 1 << 20
"""A log line longer than this is skipped unread (a record is well under 4 KiB)."""
CHUNK_BYTES = 4 << 20
"""Bytes read from a log file at a time."""
PLOT_POINTS = 2048
"""Samples kept per rank for the plot: every k-th, k doubling as the run grows (the figures in the
summary are taken from every sample)."""
EVENTS_KEPT = 256
"""Records of one kind (changes, OOM retries, ...) kept per rank; past it they are counted, and the
latest replaces the last one kept."""
MAX_STEP = 10**12
"""A step above this is not a step a run reached: the line is skipped as impossible."""
MAX_LOGGED_BYTES = 1 << 50
"""A byte figure beyond +-1 PiB is not a reading: the line is skipped as impossible."""
OTHER_RUNS_SHOWN = 5
"""Other runs of a folder named by id; the rest are counted."""


class NoRankLogs(ValueError):
    """No MemoryPlanner rank logs where the user pointed (or not the version / run asked for)."""


def sample_peak_bytes(sample: dict[str, Any]) -> int | None:
    """A sample's process peak, as memplan.hardware.readings.MemoryReading.process_peak_bytes: on a GPU
    NVML's figure plus what torch held above now at the interval's peak; on CPU the peak RSS."""
    process, reserved, peak = sample.get("process_bytes"), sample.get("reserved_bytes"), sample.get("peak_bytes")
    if reserved is None:
        return peak if peak is not None else process
    if process is None or peak is None:
        return process
    return process + max(0, peak - reserved)


def _kept(records: list[dict[str, Any]], record: dict[str, Any]) -> None:
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
    samples: list[dict[str, Any]] = field(default_factory=list)
    """`sample` events for the plot: every `sample_stride`-th, and the latest last."""
    sample_count: int = 0
    """`sample` events read."""
    sample_stride: int = 1
    changes: list[dict[str, Any]] = field(default_factory=list)
    """`change` events: shared micro-batch / checkpointing decisions with cause and reason."""
    oom_retries: list[dict[str, Any]] = field(default_factory=list)
    """`oom_retry` events."""
    oom_retry_count: int = 0
    fatals: list[dict[str, Any]] = field(default_factory=list)
    """`fatal` events."""
    applies: list[dict[str, Any]] = field(default_factory=list)
    """`apply` events (layout and plan)."""
    summaries: list[dict[str, Any]] = field(default_factory=list)
    """`summary` events at the end of fit."""
    ends: list[dict[str, Any]] = field(default_factory=list)
    """`end` events: the log closed, with how the fit ended."""
    last: dict[str, Any] | None = None
    """The rank's latest record of the run."""
    last_sample: dict[str, Any] | None = None
    """The rank's latest `sample`."""
    device_total_bytes: int | None = None
    """The largest device total a sample reported."""
    _peak: int | None = None
    _low: int | None = None
    _latest_extra: bool = False

    def add(self, record: dict[str, Any]) -> None:
        """Fold one record of this rank's run in."""
        self.last = record
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

    def _add_sample(self, record: dict[str, Any]) -> None:
        self.sample_count += 1
        self.last_sample = record
        total = record.get("device_total_bytes")
        if total and (self.device_total_bytes is None or total > self.device_total_bytes):
            self.device_total_bytes = total
        self._fold(sample_peak_bytes(record), record.get("headroom_bytes"))
        if self._latest_extra:  # the stand-in for the latest sample gives way
            self.samples.pop()
        self._latest_extra = (self.sample_count - 1) % self.sample_stride != 0
        self.samples.append(record)
        if not self._latest_extra and len(self.samples) >= 2 * PLOT_POINTS:
            latest = self.samples[-1]
            self.samples = self.samples[::2]  # every (2 x stride)-th sample; the latest stays, as a stand-in
            self.sample_stride *= 2
            if self.samples[-1] is not latest:
                self.samples.append(latest)
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


@dataclass(kw_only=True)
class _RunState:
    started: float = math.inf
    last_step: int = 0
    ranks: dict[int, RankHistory] = field(default_factory=dict)

    def info(self, run: str) -> RunInfo:
        return RunInfo(run=run, started=0.0 if self.started == math.inf else float(self.started),
                       last_step=self.last_step, ranks=tuple(sorted(self.ranks)))


@dataclass(kw_only=True)
class _FileState:
    path: Path
    rank: int
    identity: tuple[int, int] | None = None
    offset: int = 0
    tail: bytes = b""
    overlong: bool = False  # inside a line longer than MAX_LINE_BYTES: skip to its newline


class FolderReader:
    """Every rank log of one folder, read incrementally: each `update()` reads only the bytes appended
    since the last one (a file replaced or cut shorter is read again from its start, with the folder)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._reset()

    def _reset(self) -> None:
        self.files: dict[str, _FileState] = {}
        self.runs: dict[str, _RunState] = {}
        self.skipped: dict[str, dict[str, int]] = {}
        self.unreadable: dict[str, str] = {}
        self.ignored: dict[str, str] = {}

    def update(self, on_record: Callable[[int, dict[str, Any]], None] | None = None) -> None:
        """Read what was appended to each rank log since the last update; `on_record(rank, record)` sees
        each new record."""
        self.unreadable = {}
        paths = sorted(self.folder.glob(LOG_GLOB))
        if not self.files and on_record is None and self._read_in_parallel(paths):
            return
        self._update(paths, on_record)

    def _update(self, paths: list[Path], on_record) -> None:
        for path in paths:
            name = path.name
            rank = _rank_of(path)
            if rank is None:
                canonical = _RANK_LOOSE.match(name)
                if canonical:
                    self.ignored[name] = (f"not a name MemoryPlanner writes (rank {int(canonical.group(1))}'s log is "
                                          f"rank{int(canonical.group(1))}.jsonl)")
                continue
            state = self.files.get(name) or _FileState(path=path, rank=rank)
            try:
                fd = open_regular(path, name=name)
            except NotAFile:
                self.unreadable[name] = "not a regular file (a FIFO or a device): skipped"
                continue
            except OSError as err:  # gone since the glob, or not readable
                self.unreadable[name] = err.strerror or str(err)
                continue
            try:
                stat = os.fstat(fd)
                identity = (stat.st_dev, stat.st_ino)
                if state.identity is not None and (identity != state.identity or stat.st_size < state.offset):
                    os.close(fd)
                    fd = -1
                    self._reset()  # replaced or cut shorter: its records already folded in are wrong now
                    return self.update(on_record)
                state.identity = identity
                self.files[name] = state
                self._read(fd, state, stat.st_size, on_record)
            finally:
                if fd >= 0:
                    os.close(fd)

    def _read_in_parallel(self, paths: list[Path]) -> bool:
        """The first read of a large folder, one process per rank log (up to the CPUs): each folds its
        file, the folded histories (small) come back. False where it does not pay or cannot run."""
        ranked = [p for p in paths if _rank_of(p) is not None]
        try:
            size = sum(p.stat().st_size for p in ranked)
        except OSError:
            return False
        workers = min(len(ranked), os.cpu_count() or 1)
        if workers < 2 or size < PARALLEL_MIN_BYTES:
            return False
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        try:
            context = multiprocessing.get_context("fork")
        except ValueError:  # no fork here (Windows): one process reads them all
            return False
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            parts = list(pool.map(_read_one, [self.folder] * len(paths), [[p] for p in paths]))
        for part in parts:
            for run, state in part.runs.items():
                mine = self.runs.get(run)
                if mine is None:
                    self.runs[run] = state
                    continue
                mine.started = min(mine.started, state.started)
                mine.last_step = max(mine.last_step, state.last_step)
                mine.ranks.update(state.ranks)  # one file per rank: no rank in two parts
            self.files.update(part.files)
            self.skipped.update(part.skipped)
            self.unreadable.update(part.unreadable)
            self.ignored.update(part.ignored)
        return True

    def _read(self, fd: int, state: _FileState, size: int, on_record) -> None:
        while state.offset < size:
            chunk = os.pread(fd, min(CHUNK_BYTES, size - state.offset), state.offset)
            if not chunk:
                break
            state.offset += len(chunk)
            data = state.tail + chunk if state.tail else chunk
            cut = data.rfind(b"\n")
            if cut < 0:
                state.tail = b"" if state.overlong else data  # the middle of an over-long line: dropped
                lines: list[bytes] = []
            else:
                state.tail = data[cut + 1:]
                lines = data[:cut].split(b"\n")
            if state.overlong and lines:  # the rest of an over-long line, up to its newline
                lines.pop(0)
                state.overlong = False
            if len(state.tail) > MAX_LINE_BYTES:
                state.tail = b""
                state.overlong = True
                self._skip(state.path.name, f"line longer than {format_bytes(MAX_LINE_BYTES)}")
            self._lines(state, lines, on_record)

    def _lines(self, state: _FileState, lines: list[bytes], on_record) -> None:
        lines = [line for line in lines if line.strip()]
        if not lines:
            return
        if max(map(len, lines)) > MAX_LINE_BYTES:
            name = state.path.name
            for _ in range(sum(len(line) > MAX_LINE_BYTES for line in lines)):
                self._skip(name, f"line longer than {format_bytes(MAX_LINE_BYTES)}")
            lines = [line for line in lines if len(line) <= MAX_LINE_BYTES]
        records = _parse_many(lines)
        name = state.path.name
        for i, record in enumerate(records):
            if record is _BAD:
                record = _parse_one(lines[i])
                if isinstance(record, str):
                    self._skip(name, record)
                    continue
            problem = _problem(record)
            if problem is not None:
                self._skip(name, problem)
                continue
            run = record.get("run")
            run = run if isinstance(run, str) else NO_RUN_ID
            info = self.runs.get(run)
            if info is None:
                info = self.runs[run] = _RunState()
            when = record.get("time")
            if when is not None and when < info.started:
                info.started = when
            if record["step"] > info.last_step:
                info.last_step = record["step"]
            history = info.ranks.get(state.rank)
            if history is None:
                history = info.ranks[state.rank] = RankHistory(rank=state.rank, path=state.path)
            history.add(record)
            if on_record is not None:
                on_record(state.rank, record)

    def _skip(self, name: str, why: str) -> None:
        bad = self.skipped.setdefault(name, {})
        bad[why] = bad.get(why, 0) + 1

    def unfinished(self) -> dict[str, int]:
        """Files whose last line is still being written (or was cut by a crash)."""
        return {name: 1 for name, state in self.files.items() if state.tail.strip()}

    def run_infos(self) -> list[RunInfo]:
        """Every run in the folder, newest first."""
        runs = [state.info(run) for run, state in self.runs.items()]
        return sorted(runs, key=lambda r: (r.started, r.run), reverse=True)


PARALLEL_MIN_BYTES = 64 << 20
"""A folder's first read is spread over processes from this many bytes of logs."""


def _read_one(folder: Path, paths: list[Path]) -> FolderReader:
    """One process's share of a parallel first read: `paths` folded as FolderReader.update would."""
    reader = FolderReader(folder)
    reader._update(paths, None)
    return reader


_BAD = object()


def _parse_many(lines: list[bytes]) -> list[Any]:
    """Each line's JSON value, parsed in one call where every line is one object (the common case:
    about half the cost of a call per line); _BAD marks the lines to parse one by one."""
    if all(line[:1] == b"{" and line.rstrip()[-1:] == b"}" for line in lines):
        try:
            values = json.loads(b"[" + b",".join(lines) + b"]")
        except (ValueError, RecursionError):
            values = None
        if values is not None and len(values) == len(lines) and all(type(v) is dict for v in values):
            return values
    return [_BAD] * len(lines)


def _parse_one(line: bytes) -> Any:
    """A line's JSON value, or why it is not one (a str)."""
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8"
    except (ValueError, RecursionError):  # json.JSONDecodeError, and numbers Python cannot hold
        return "not JSON"


_NAMED: dict[tuple[str, ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _problem(record: Any) -> str | None:
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


@dataclass(kw_only=True)
class RunLogs:
    """The run shown, and what else the folder held."""

    folder: Path
    """The folder read (holding rank<R>.jsonl)."""
    versions: list[Path]
    """Every log folder below the directory given, oldest first (one when pointed at a log folder)."""
    run: RunInfo
    """The run shown."""
    other_runs: list[RunInfo]
    """The folder's other runs, newest first."""
    histories: list[RankHistory]
    """The run's ranks, in rank order."""
    world_size: int | None
    """Ranks the run started with (its `apply` records), when known."""
    skipped: dict[str, dict[str, int]]
    """Lines skipped per file name, counted by reason."""
    unreadable: dict[str, str]
    """Files that could not be read, with why."""
    ignored: dict[str, str] = field(default_factory=dict)
    """Files beside the logs that look like one but are not read, with why."""

    @property
    def missing_ranks(self) -> list[int]:
        present = {h.rank for h in self.histories}
        expected = range(self.world_size) if self.world_size else range(max(present, default=-1) + 1)
        return [r for r in expected if r not in present]

    @property
    def ended(self) -> str | None:
        """How the run ended: the failure that came first (the rank whose log closed first: the one
        signalled or out of memory, not a peer's secondary error), "finished" once every rank finished;
        None while it runs."""
        failed = [h for h in self.histories if h.ended not in (None, "finished")]
        if failed:
            first = min(failed, key=lambda h: (h.ended_at, h.rank))
            text = f"rank {first.rank} {_with_signal(first.ended)}"
            others = [h.rank for h in failed if h is not first]
            if others:
                text += (f" (first to fail; then rank{'s' if len(others) > 1 else ''} "
                         f"{', '.join(map(str, others[:8]))}{' ...' if len(others) > 8 else ''})")
            return text
        states = [h.ended for h in self.histories]
        return "finished" if states and None not in states and not self.missing_ranks else None


def _with_signal(status: str) -> str:
    """'failed: RankTerminated: 143' with the signal named: '... (SIGTERM)'."""
    import signal

    match = re.search(r"RankTerminated: (\d+)\b", status)
    if match and 128 < int(match.group(1)) < 128 + 65:
        try:
            return f"{status} ({signal.Signals(int(match.group(1)) - 128).name} received)"
        except ValueError:
            return status
    return status


def log_folders(directory: str | Path) -> list[Path]:
    """Folders at or below `directory` that hold rank<R>.jsonl, oldest first (version number, else
    the time of their newest log). Raises NoRankLogs when there are none."""
    root = Path(directory)
    if not root.is_dir():
        raise NoRankLogs(f"{root} is not a directory" if root.exists() else f"{root} does not exist")
    folders = {p.parent for p in root.rglob(LOG_GLOB) if _rank_of(p) is not None or _RANK_LOOSE.match(p.name)}
    if not folders:
        raise NoRankLogs(f"no MemoryPlanner rank logs ({LOG_GLOB}) in {root} or below it; point at the run's "
                         "log directory (the one holding memplan/)")
    return sorted(folders, key=lambda d: (_version_of(d, root) is None, _version_of(d, root) or 0, _newest(d)))


class RunWatcher:
    """One run's logs, kept up to date: `logs()` reads what was appended since its last call (a new
    folder or version starts a new reader). `load_run` is one RunWatcher read once."""

    def __init__(self, directory: str | Path, *, version: int | None = None, run: str | None = None) -> None:
        self.root = Path(directory)
        self.version = version
        self.run = run
        self._reader: FolderReader | None = None

    def logs(self, on_record: Callable[[int, dict[str, Any]], None] | None = None) -> RunLogs:
        root, version = self.root, self.version
        versions = log_folders(root)
        if version is not None:
            chosen = [d for d in versions if _version_of(d, root) == version]
            if not chosen:
                found = sorted({v for d in versions if (v := _version_of(d, root)) is not None})
                raise NoRankLogs(f"--version {version}: no version_{version} with rank logs below {root}; "
                                 f"versions there: {', '.join(map(str, found)) or 'none'}")
            folder = chosen[0]
        else:
            folder = max(versions, key=_newest)
        if self._reader is None or self._reader.folder != folder:
            self._reader = FolderReader(folder)
        reader = self._reader
        reader.update(on_record)
        skipped = _merged(reader.skipped, {n: {"unfinished last line": 1} for n in reader.unfinished()})
        runs = reader.run_infos()
        if not runs:
            why = _describe_skipped(skipped) if skipped else ""
            why = "; ".join(x for x in (why, *(f"{n}: {w}" for n, w in sorted({**reader.unreadable,
                                                                                 **reader.ignored}.items()))) if x)
            raise NoRankLogs(f"no readable MemoryPlanner record in {folder}" + (f" ({why})" if why else ""))
        if self.run is not None:
            matching = [r for r in runs if r.run.startswith(self.run)]
            if len(matching) != 1:
                shown = ", ".join(r.run for r in runs[:OTHER_RUNS_SHOWN])
                more = f" and {len(runs) - OTHER_RUNS_SHOWN} more" if len(runs) > OTHER_RUNS_SHOWN else ""
                raise NoRankLogs(f"--run {self.run}: {'no run' if not matching else 'several runs'} in {folder} start "
                                 f"with that; runs there: {shown}{more}")
            shown_run = matching[0]
        else:
            shown_run = runs[0]
        state = reader.runs[shown_run.run]
        histories = [state.ranks[r] for r in sorted(state.ranks)]
        sizes = [a["layout"].get("world_size") for h in histories for a in h.applies
                 if isinstance(a.get("layout"), dict)]
        sizes = [s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and 0 < s <= 1 << 18]
        return RunLogs(folder=folder, versions=versions, run=shown_run,
                       other_runs=[r for r in runs if r is not shown_run], histories=histories,
                       world_size=max(sizes) if sizes else None, skipped=skipped,
                       unreadable=dict(reader.unreadable), ignored=dict(reader.ignored))


def load_run(directory: str | Path, *, version: int | None = None, run: str | None = None) -> RunLogs:
    """One run's logs: in the folder of `version` (lightning_logs/version_N) or the newest folder,
    the run whose id starts with `run`, or the newest run there."""
    return RunWatcher(directory, version=version, run=run).logs()


def _merged(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    out = {name: dict(bad) for name, bad in a.items()}
    for name, bad in b.items():
        for why, n in bad.items():
            out.setdefault(name, {})[why] = out.get(name, {}).get(why, 0) + n
    return out


def describe_skipped(logs: RunLogs) -> str | None:
    """'skipped 3 bad lines: rank0.jsonl: 2 not UTF-8, 1 no integer step', or None."""
    if not logs.skipped:
        return None
    total = sum(n for bad in logs.skipped.values() for n in bad.values())
    return f"skipped {total} bad line{'s' if total != 1 else ''}: {_describe_skipped(logs.skipped)}"


def _describe_skipped(skipped: dict[str, dict[str, int]]) -> str:
    return "; ".join(f"{name}: " + ", ".join(f"{n} {why}" for why, n in bad.items())
                     for name, bad in sorted(skipped.items()))


def age(record: dict[str, Any] | None, now: float | None = None) -> str:
    """'12 s ago', '3 min ago', '2 h ago'; '-' without a time."""
    if not record or not isinstance(record.get("time"), (int, float)):
        return "-"
    seconds = max(0.0, (time.time() if now is None else now) - record["time"])
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.0f} h ago"


_RANK = re.compile(r"^rank(0|[1-9]\d{0,8})\.jsonl$")
"""The names MemoryPlanner writes (runlog.log_path): rank0.jsonl, rank12.jsonl; never rank01.jsonl."""
_RANK_LOOSE = re.compile(r"^rank(\d{1,9})\.jsonl$")
_VERSION = re.compile(r"^version_(\d+)$")


def _rank_of(path: Path) -> int | None:
    match = _RANK.match(path.name)
    return int(match.group(1)) if match else None


def _version_of(folder: Path, root: Path) -> int | None:
    """N of the deepest version_N folder between `root` and `folder` (the root itself included)."""
    parts = [folder.name, *(p.name for p in folder.parents if p == root or root in p.parents)]
    for name in parts:
        match = _VERSION.match(name)
        if match:
            return int(match.group(1))
    return None


def _newest(folder: Path) -> float:
    times = []
    for path in folder.glob(LOG_GLOB):
        try:
            times.append(path.stat().st_mtime)
        except OSError:
            continue
    return max(times, default=0.0)
