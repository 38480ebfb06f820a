"""Read a folder of MemoryPlanner rank logs incrementally, folding every record into per-run, per-rank
histories (memplan.commands.run_history) as it goes.

The logs are streamed, never held: each file is read in chunks from where the last read stopped, so
memory stays bounded however long the run, and `memplan watch` reads only what was appended since
its last refresh. `sample` lines, almost all of a log, take a fast path (memplan.commands.log_scan):
checked and taken apart by one regular expression per chunk, their figures folded as columns,
decoded only when shown. A large folder's first read is spread over worker processes, one rank log
each at a time. Nothing here
raises on what a log holds: bad lines (not JSON, impossible values, longer than MAX_LINE_BYTES) are
skipped and counted by reason; files that are not regular files (a FIFO) or not named as MemoryPlanner
names them (rank01.jsonl) are named, not read.
"""
from __future__ import annotations

import gc
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memplan.callback.runlog import LOG_GLOB
from memplan.commands.log_scan import BAD, SampleShape, parse_many, parse_one, problem, sample_shape
from memplan.commands.run_history import RankHistory, RunInfo
from memplan.files import NotAFile, open_regular
from memplan.units import format_bytes

NO_RUN_ID = "(no run id)"
"""The run of records written before run ids were logged."""
MAX_LINE_BYTES = 1 << 20
"""A log line longer than this is skipped unread (a record is well under 4 KiB)."""
CHUNK_BYTES = 4 << 20
"""Bytes read from a log file at a time."""
PARALLEL_MIN_BYTES = 64 << 20
"""A folder's first read is spread over processes from this many bytes of logs."""
FAST_PATH = True
"""Whether `sample` lines of a known shape take the fast path (tests compare both ways)."""
MAX_NEW_SHAPES = 4
"""New shapes taken up in one chunk; past it the chunk's other lines are read the slow way."""


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
    shape: SampleShape | None = None  # of its latest `sample` line read the slow way (the fast path's)


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

    def update(self, on_record: Callable[[int, dict[str, Any]], None] | None = None, *,
               meanwhile: Callable[[], None] | None = None) -> None:
        """Read what was appended to each rank log since the last update; `on_record(rank, record)` sees
        each new record. `meanwhile` is called once here, while worker processes read, where they do."""
        self.unreadable = {}
        paths = sorted(self.folder.glob(LOG_GLOB))
        if not self.files and on_record is None and self._read_in_parallel(paths, meanwhile):
            return
        self._update(paths, on_record)

    def _update(self, paths: list[Path], on_record) -> None:
        with _collector_paused():
            self._update_paths(paths, on_record)

    def _update_paths(self, paths: list[Path], on_record) -> None:
        for path in paths:
            name = path.name
            rank = rank_of(path)
            if rank is None:
                loose = loose_rank(name)
                if loose is not None:
                    self.ignored[name] = f"not a name MemoryPlanner writes (rank {loose}'s log is rank{loose}.jsonl)"
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

    def _read_in_parallel(self, paths: list[Path], meanwhile: Callable[[], None] | None = None) -> bool:
        """The first read of a large folder, one process per rank log (up to the CPUs): each folds its
        file, the folded histories (small) come back. False where it does not pay or cannot run."""
        ranked = [p for p in paths if rank_of(p) is not None]
        try:
            size = sum(p.stat().st_size for p in ranked)
        except OSError:
            return False
        affinity = getattr(os, "sched_getaffinity", None)  # the CPUs this process may use (taskset, cpusets)
        workers = min(len(ranked), len(affinity(0)) if affinity is not None else os.cpu_count() or 1)
        if workers < 2 or size < PARALLEL_MIN_BYTES:
            return False
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        try:  # the fast path's fold parses with numpy: imported once here, not in each worker
            import numpy  # noqa: F401
        except ImportError:
            pass

        try:
            context = multiprocessing.get_context("fork")
        except ValueError:  # no fork here (Windows): one process reads them all
            return False
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            results = pool.map(_read_one, [self.folder] * len(paths), [[p] for p in paths])  # (workers forked now)
            if meanwhile is not None:
                meanwhile()
            parts = list(results)
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
            start = 0  # its lines are data[start:cut]
            if cut < 0:
                state.tail = b"" if state.overlong else data  # the middle of an over-long line: dropped
            else:
                state.tail = data[cut + 1:]
                if state.overlong:  # the rest of an over-long line, up to its newline
                    start = data.index(b"\n") + 1
                    state.overlong = False
            if len(state.tail) > MAX_LINE_BYTES:
                state.tail = b""
                state.overlong = True
                self._skip(state.path.name, f"line longer than {format_bytes(MAX_LINE_BYTES)}")
            if start > cut:  # no whole line
                continue
            if on_record is None and FAST_PATH:
                self._lines_fast(state, data, start, cut)
            else:
                self._lines(state, data[start:cut].split(b"\n"), on_record)

    def _lines_fast(self, state: _FileState, body: bytes, start: int, end: int) -> None:
        """The lines of body[start:end] folded in as _lines would: the lines of the file's sample shape
        in batches (log_scan), the others one by one the slow way; a sample read the slow way with
        another shape (a new run, another set of keys) becomes the shape for the rest. Each line comes
        whole from its match (the shape's pattern has one a line), so the chunk is split apart only
        where a shape is to be learned."""
        learned = 0
        lines: list[bytes] | None = None  # body[start:end].split(b"\n"), once needed
        while True:
            shape = state.shape
            if shape is None:  # the slow way up to the first sample line, which gives the shape
                if lines is None:
                    lines = body[start:end].split(b"\n")
                first = next((i for i, line in enumerate(lines) if b'"sample"' in line), None)
                if first is None or learned >= MAX_NEW_SHAPES:
                    self._lines(state, lines, None)
                    return
                learned += 1
                self._lines(state, lines[:first + 1], None, learn=True)
                lines = lines[first + 1:]
                if not lines:
                    return
                body = b"\n".join(lines)
                start, end = 0, len(body)
                continue
            rows = shape.pattern.findall(body, start, end)  # one match a line (the shape's or any other)
            groups = list(zip(*rows))  # (one tuple per group: the lines of the shape first, b"" for others)
            whole = b"" not in groups[0]  # every line of the shape: the common case
            found = groups[0] if whole else [row[0] or row[-1] for row in rows]
            if sum(map(len, found)) + len(found) - 1 != end - start:  # (never: the matches are the lines)
                self._lines(state, body[start:end].split(b"\n"), None)
                return
            if whole:
                self._add_fast(state, shape, groups)
                return
            lines = found
            others = [i for i, line in enumerate(groups[0]) if not line]
            done, k = 0, 0
            while k < len(others):
                first = last = others[k]
                while k + 1 < len(others) and others[k + 1] == last + 1:
                    k += 1
                    last = others[k]
                k += 1
                if first > done:
                    self._add_fast(state, shape, list(zip(*rows[done:first])))
                done = last + 1
                self._lines(state, lines[first:done], None, learn=learned < MAX_NEW_SHAPES)
                if state.shape is not shape:  # a new shape: the rest is matched with it
                    learned += 1
                    lines = lines[done:]
                    if not lines:
                        return
                    body = b"\n".join(lines)
                    start, end = 0, len(body)
                    break
            else:
                if done < len(rows):
                    self._add_fast(state, shape, list(zip(*rows[done:])))
                return

    def _add_fast(self, state: _FileState, shape: SampleShape, groups: list[tuple[bytes, ...]]) -> None:
        """Consecutive sample lines of `shape` (checked by its pattern, so each is a valid record) folded
        in, from their matches' groups (zip(*matches): the lines themselves first)."""
        figures = shape.fold(groups)
        info = self.runs.get(shape.run)
        if info is None:
            info = self.runs[shape.run] = _RunState()
        if figures.started < info.started:
            info.started = figures.started
        if figures.last_step > info.last_step:
            info.last_step = figures.last_step
        history = info.ranks.get(state.rank)
        if history is None:
            history = info.ranks[state.rank] = RankHistory(rank=state.rank, path=state.path)
        history.add_samples(figures, groups[0])

    def _lines(self, state: _FileState, lines: list[bytes], on_record, *, learn: bool = False) -> None:
        """`lines` parsed, checked and folded in, one by one; with `learn`, a sample's shape is kept
        for the fast path."""
        lines = [line for line in lines if line.strip()]
        if not lines:
            return
        if max(map(len, lines)) > MAX_LINE_BYTES:
            name = state.path.name
            for _ in range(sum(len(line) > MAX_LINE_BYTES for line in lines)):
                self._skip(name, f"line longer than {format_bytes(MAX_LINE_BYTES)}")
            lines = [line for line in lines if len(line) <= MAX_LINE_BYTES]
        records = parse_many(lines)
        name = state.path.name
        latest = None
        for i, record in enumerate(records):
            if record is BAD:
                record = parse_one(lines[i])
                if isinstance(record, str):
                    self._skip(name, record)
                    continue
            why = problem(record)
            if why is not None:
                self._skip(name, why)
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
            if learn and record["event"] == "sample":
                latest = record
        if learn and latest is not None:  # the latest sample's shape (one pattern built, however many runs)
            shape = sample_shape(latest)
            if shape is not None:
                state.shape = shape

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


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector paused: a read makes tens of thousands of short-lived tuples a chunk and
    no reference cycle, and the collector's passes over them cost a twentieth of the read."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _read_one(folder: Path, paths: list[Path]) -> FolderReader:
    """One process's share of a parallel first read: `paths` folded as FolderReader.update would."""
    reader = FolderReader(folder)
    with _collector_paused():
        reader._update(paths, None)
        for state in reader.runs.values():
            for history in state.ranks.values():
                history.decode()  # here, in parallel, rather than where they are shown
    return reader


_RANK = re.compile(r"^rank(0|[1-9]\d{0,8})\.jsonl$")
"""The names MemoryPlanner writes (runlog.log_path): rank0.jsonl, rank12.jsonl; never rank01.jsonl."""
_RANK_LOOSE = re.compile(r"^rank(\d{1,9})\.jsonl$")


def rank_of(path: Path) -> int | None:
    match = _RANK.match(path.name)
    return int(match.group(1)) if match else None


def loose_rank(name: str) -> int | None:
    """The rank a name like MemoryPlanner's names (rank01.jsonl: 1), or None."""
    match = _RANK_LOOSE.match(name)
    return int(match.group(1)) if match else None

