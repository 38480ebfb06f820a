"""Find and load one run of MemoryPlanner's per-rank logs for `memplan report` and `memplan watch`.

A log folder (memplan/ under a Lightning version folder) holds rank<R>.jsonl; a parent of several
(lightning_logs/) holds one folder per version. One folder may hold several runs (fits that shared a
log_dir): each record names its run, and one run is shown (the newest unless asked), the others listed.
Nothing here raises on what a log holds: bad lines are skipped and counted, unreadable files named.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memplan.callback.runlog import LOG_GLOB, parse_lines

NO_RUN_ID = "(no run id)"
"""The run of records written before run ids were logged."""


class NoRankLogs(ValueError):
    """No MemoryPlanner rank logs where the user pointed (or not the version / run asked for)."""


@dataclass(kw_only=True)
class RankHistory:
    """One rank's records of one run, split by event."""

    rank: int
    """Global rank."""
    path: Path
    """Its rank<R>.jsonl."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """`sample` events: readings in bytes and how the rank ran at that step."""
    changes: list[dict[str, Any]] = field(default_factory=list)
    """`change` events: shared micro-batch / checkpointing decisions with cause and reason."""
    oom_retries: list[dict[str, Any]] = field(default_factory=list)
    """`oom_retry` events."""
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

    @property
    def device_total_bytes(self) -> int | None:
        totals = [s["device_total_bytes"] for s in self.samples if s.get("device_total_bytes")]
        return max(totals) if totals else None

    @property
    def budget_bytes(self) -> int | None:
        """The plan's per-device budget (free memory less the planning margin), where a plan was applied."""
        budgets = [a["plan"]["device_budget_bytes"] for a in self.applies
                   if a.get("plan") and isinstance(a["plan"].get("device_budget_bytes"), int)]
        return budgets[-1] if budgets else None

    @property
    def peak_process_bytes(self) -> int | None:
        """The process's peak over the run (as MemoryReading.process_peak_bytes, then the summary's)."""
        values = [v for s in self.samples if (v := sample_peak_bytes(s)) is not None]
        values += [e["peak_process_bytes"] for e in self.summaries if e.get("peak_process_bytes") is not None]
        return max(values) if values else None

    @property
    def min_headroom_bytes(self) -> int | None:
        values = [s["headroom_bytes"] for s in self.samples if s.get("headroom_bytes") is not None]
        values += [e["min_headroom_bytes"] for e in self.summaries if e.get("min_headroom_bytes") is not None]
        return min(values) if values else None

    @property
    def ended(self) -> str | None:
        """How the rank's fit ended ("finished", "failed: ..."), or None while it runs."""
        if self.ends:
            return str(self.ends[-1].get("status", "ended"))
        if self.fatals:
            return "failed: out of memory"
        return "finished" if self.summaries else None


def sample_peak_bytes(sample: dict[str, Any]) -> int | None:
    """A sample's process peak, as memplan.hardware.readings.MemoryReading.process_peak_bytes: on a GPU
    NVML's figure plus what torch held above now at the interval's peak; on CPU the peak RSS."""
    process, reserved, peak = sample.get("process_bytes"), sample.get("reserved_bytes"), sample.get("peak_bytes")
    if reserved is None:
        return peak if peak is not None else process
    if process is None or peak is None:
        return process
    return process + max(0, peak - reserved)


_KINDS = {"sample": "samples", "change": "changes", "oom_retry": "oom_retries", "fatal": "fatals",
          "apply": "applies", "summary": "summaries", "end": "ends"}


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

    @property
    def missing_ranks(self) -> list[int]:
        present = {h.rank for h in self.histories}
        expected = range(self.world_size) if self.world_size else range(max(present, default=-1) + 1)
        return [r for r in expected if r not in present]

    @property
    def ended(self) -> str | None:
        """How the run ended: a rank's failure, "finished" once every rank finished; None while it runs."""
        states = [h.ended for h in self.histories]
        failed = [f"rank {h.rank} {s}" for h, s in zip(self.histories, states) if s not in (None, "finished")]
        if failed:
            return failed[0]
        return "finished" if states and None not in states and not self.missing_ranks else None


def log_folders(directory: str | Path) -> list[Path]:
    """Folders at or below `directory` that hold rank<R>.jsonl, oldest first (version number, else
    the time of their newest log). Raises NoRankLogs when there are none."""
    root = Path(directory)
    if not root.is_dir():
        raise NoRankLogs(f"{root} is not a directory" if root.exists() else f"{root} does not exist")
    folders = {p.parent for p in root.rglob(LOG_GLOB) if _rank_of(p) is not None}
    if not folders:
        raise NoRankLogs(f"no MemoryPlanner rank logs ({LOG_GLOB}) in {root} or below it; point at the run's "
                         "log directory (the one holding memplan/)")
    return sorted(folders, key=lambda d: (_version_of(d, root) is None, _version_of(d, root) or 0, _newest(d)))


def load_run(directory: str | Path, *, version: int | None = None, run: str | None = None) -> RunLogs:
    """One run's logs: in the folder of `version` (lightning_logs/version_N) or the newest folder,
    the run whose id starts with `run`, or the newest run there."""
    root = Path(directory)
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
    records, skipped, unreadable = _read_folder(folder)
    runs = _runs(records)
    if not runs:
        raise NoRankLogs(f"no readable MemoryPlanner record in {folder}"
                         + (f" ({_describe_skipped(skipped)})" if skipped else ""))
    if run is not None:
        matching = [r for r in runs if r.run.startswith(run)]
        if len(matching) != 1:
            raise NoRankLogs(f"--run {run}: {'no run' if not matching else 'several runs'} in {folder} start with "
                             f"that; runs there: {', '.join(r.run for r in runs)}")
        shown = matching[0]
    else:
        shown = runs[0]
    histories = _histories(records, shown.run)
    sizes = [a["layout"].get("world_size") for h in histories for a in h.applies if isinstance(a.get("layout"), dict)]
    sizes = [s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s > 0]
    return RunLogs(folder=folder, versions=versions, run=shown, other_runs=[r for r in runs if r is not shown],
                   histories=histories, world_size=max(sizes) if sizes else None, skipped=skipped,
                   unreadable=unreadable)


def _read_folder(folder: Path) -> tuple[dict[int, tuple[Path, list[dict]]], dict, dict]:
    records, skipped, unreadable = {}, {}, {}
    for path in folder.glob(LOG_GLOB):
        rank = _rank_of(path)
        if rank is None:
            continue
        try:
            data = path.read_bytes()
        except OSError as err:  # gone since the glob, or not readable
            unreadable[path.name] = err.strerror or str(err)
            continue
        lines, bad = parse_lines(data)
        records[rank] = (path, lines)
        if bad:
            skipped[path.name] = bad
    return records, skipped, unreadable


def _runs(records: dict[int, tuple[Path, list[dict]]]) -> list[RunInfo]:
    """Every run in the folder, newest first."""
    found: dict[str, dict[str, Any]] = {}
    for rank, (_, lines) in records.items():
        for record in lines:
            run = record.get("run") if isinstance(record.get("run"), str) else NO_RUN_ID
            info = found.setdefault(run, {"started": float("inf"), "last_step": 0, "ranks": set()})
            if isinstance(record.get("time"), (int, float)):
                info["started"] = min(info["started"], record["time"])
            info["last_step"] = max(info["last_step"], record["step"])
            info["ranks"].add(rank)
    runs = [RunInfo(run=run, started=0.0 if i["started"] == float("inf") else float(i["started"]),
                    last_step=i["last_step"], ranks=tuple(sorted(i["ranks"]))) for run, i in found.items()]
    return sorted(runs, key=lambda r: (r.started, r.run), reverse=True)


def _histories(records: dict[int, tuple[Path, list[dict]]], run: str) -> list[RankHistory]:
    histories = []
    for rank in sorted(records):
        path, lines = records[rank]
        mine = [r for r in lines if (r.get("run") if isinstance(r.get("run"), str) else NO_RUN_ID) == run]
        if not mine:
            continue
        history = RankHistory(rank=rank, path=path, last=mine[-1])
        for record in mine:
            kind = _KINDS.get(record["event"])
            if kind is not None:
                getattr(history, kind).append(record)
        histories.append(history)
    return histories


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


_RANK = re.compile(r"^rank(\d+)\.jsonl$")
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
