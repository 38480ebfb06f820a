"""Find and read one run of MemoryPlanner's per-rank logs for `memplan report` and `memplan watch`.

A log folder (memplan/ under a Lightning version folder) holds rank<R>.jsonl; a parent of several
(lightning_logs/) holds one folder per version. One folder may hold several runs (fits that shared a
log_dir): each record names its run, and one run is shown (the newest unless asked), the others listed.
The files are streamed and folded as they are read (memplan.commands.log_reader), never held.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memplan.callback.runlog import LOG_GLOB
from memplan.commands.log_reader import NO_RUN_ID, FolderReader, loose_rank, rank_of
from memplan.commands.run_history import RankHistory, RunInfo

__all__ = ["NO_RUN_ID", "NoRankLogs", "RankHistory", "RunInfo", "RunLogs", "RunWatcher", "age", "describe_skipped",
           "load_run", "log_folders"]

OTHER_RUNS_SHOWN = 5
"""Other runs of a folder named by id; the rest are counted."""


class NoRankLogs(ValueError):
    """No MemoryPlanner rank logs where the user pointed (or not the version / run asked for)."""


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
            signal = first.ended_by_signal
            text = f"rank {first.rank} {first.ended}{f' ({signal} received)' if signal else ''}"
            others = [h.rank for h in failed if h is not first]
            if others:
                text += (f" (first to fail; then rank{'s' if len(others) > 1 else ''} "
                         f"{', '.join(map(str, others[:8]))}{' ...' if len(others) > 8 else ''})")
            return text
        states = [h.ended for h in self.histories]
        return "finished" if states and None not in states and not self.missing_ranks else None


def log_folders(directory: str | Path) -> list[Path]:
    """Folders at or below `directory` that hold rank<R>.jsonl, oldest first (version number, else
    the time of their newest log). Raises NoRankLogs when there are none."""
    root = Path(directory)
    if not root.is_dir():
        raise NoRankLogs(f"{root} is not a directory" if root.exists() else f"{root} does not exist")
    folders = {p.parent for p in root.rglob(LOG_GLOB) if rank_of(p) is not None or loose_rank(p.name) is not None}
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

    def logs(self, on_record: Callable[[int, dict[str, Any]], None] | None = None, *,
             meanwhile: Callable[[], None] | None = None) -> RunLogs:
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
        reader.update(on_record, meanwhile=meanwhile)
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
        sizes = [a.get("ranks", a["layout"].get("world_size")) for h in histories for a in h.applies
                 if isinstance(a.get("layout"), dict)]  # (ranks: every rank; layout.world_size: the data-parallel)
        sizes = [s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and 0 < s <= 1 << 18]
        return RunLogs(folder=folder, versions=versions, run=shown_run,
                       other_runs=[r for r in runs if r is not shown_run], histories=histories,
                       world_size=max(sizes) if sizes else None, skipped=skipped,
                       unreadable=dict(reader.unreadable), ignored=dict(reader.ignored))


def load_run(directory: str | Path, *, version: int | None = None, run: str | None = None,
             meanwhile: Callable[[], None] | None = None) -> RunLogs:
    """One run's logs: in the folder of `version` (lightning_logs/version_N) or the newest folder,
    the run whose id starts with `run`, or the newest run there."""
    return RunWatcher(directory, version=version, run=run).logs(meanwhile=meanwhile)


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


_VERSION = re.compile(r"^version_(\d+)$")


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
