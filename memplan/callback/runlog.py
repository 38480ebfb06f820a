"""The per-rank run log: its schema, the writer MemoryPlanner uses and the line parser `memplan report`
and `memplan watch` use; the readings sent to the Trainer's loggers; the end-of-fit summary line.

`<log_dir>/rank<R>.jsonl` holds one JSON object a line. Every record has

    event  one of EVENTS          step  the optimizer step (trainer.global_step)
    rank   the global rank        run   the run id, the same on every rank of one fit
    time   seconds since the epoch

and the event's own fields (byte counts are ints named `*_bytes`). Lines of several fits may share a
file (a resume into the same log_dir); the run id tells them apart. A line is written with one
`write(2)` on a file opened O_APPEND, so a reader never sees two records in one line; a write that
fails half-way is taken back, and a failed write is counted, never raised: logging does not end a run.

This module itself imports neither torch nor Lightning: `memplan report` reads logs without them.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memplan.units import GiB, format_bytes

if TYPE_CHECKING:
    from memplan.callback.adjust import RankStatus

LOG_GLOB = "rank*.jsonl"
"""The files of one log folder."""
EVENTS = ("apply", "loader", "sample", "change", "oom_retry", "fatal", "summary", "end")
"""apply: the layout a fit starts with (its `layout.world_size` says how many ranks write); loader: the
loader's real batch size; sample: a reading; change: a shared layout change; oom_retry: an OOM retried;
fatal: an OOM that ended the run; summary: the rank's figures at the end of fit; end: the log closed
(`status` "finished" or the error that ended the fit, `dropped_lines`)."""
DICT_FIELDS = ("layout", "plan", "before", "after")
"""Fields that hold objects (a layout or plan as a dict)."""


def log_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.jsonl"


def new_run_id() -> str:
    """A run id that sorts by start time: '20261124-052200-3fa9c1' (UTC)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


# --- writer ------------------------------------------------------------------------------------

class RankLog:
    """`<directory>/rank<R>.jsonl`, appended, one whole line per record.

    Opening raises OSError (a folder that cannot be made or written): the caller turns it into the
    error that names its argument. After that nothing raises: a write that fails (a full disk, a
    vanished mount) warns once, and the lines lost are counted in `dropped`.
    """

    def __init__(self, directory: str | os.PathLike, rank: int, run_id: str) -> None:
        self.path = log_path(directory, rank)
        self.rank = rank
        self.run_id = run_id
        self.written = 0
        """Lines written."""
        self.dropped = 0
        """Lines that could not be written."""
        self._warned = False
        self._cut = False  # a failed write left part of a line that could not be taken back
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, event: str, step: int, **fields: Any) -> dict[str, Any]:
        """Append one record; returns it (also when it could not be written)."""
        record = {"event": event, "step": step, "rank": self.rank, "run": self.run_id,
                  "time": round(time.time(), 3), **fields}
        line = (json.dumps(record, default=str) + "\n").encode("utf-8")
        if self._fd is None:
            self.dropped += 1
            return record
        try:
            append_line(self._fd, b"\n" + line if self._cut else line)
        except PartialLine as err:
            self._cut = self._cut or err.left_behind
            self._drop(err)
        except OSError as err:
            self._drop(err)
        else:
            self._cut = False
            self.written += 1
        return record

    def _drop(self, err: OSError) -> None:
        self.dropped += 1
        if not self._warned:
            self._warned = True
            warnings.warn(f"MemoryPlanner: rank {self.rank} cannot write its log {self.path} ({err.strerror or err}); "
                          "training goes on, and the lines not written are counted and reported at the end of fit",
                          stacklevel=3)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:  # nothing is buffered: nothing is lost
                pass


def append_line(fd: int, data: bytes, write: Callable[[int, bytes], int] = os.write) -> None:
    """One write(2) of a whole line on an O_APPEND file. A short write (the disk filled mid-line) is
    taken back (truncated) and raised as PartialLine."""
    written = write(fd, data)
    if written == len(data):
        return
    try:
        os.ftruncate(fd, os.fstat(fd).st_size - written)
    except OSError:
        raise PartialLine(written, len(data), left_behind=True) from None
    raise PartialLine(written, len(data), left_behind=False)


class PartialLine(OSError):
    """A line written in part: ENOSPC, with whether the part could not be taken back (`left_behind`)."""

    def __init__(self, written: int, wanted: int, *, left_behind: bool) -> None:
        super().__init__(errno.ENOSPC, f"No space left on device: wrote {written} of {wanted} bytes of a line"
                                       f"{'' if left_behind else ' (taken back)'}")
        self.left_behind = left_behind


# --- reader ------------------------------------------------------------------------------------

def record_problem(record: Any) -> str | None:
    """Why a parsed line is not a record of this schema, or None when it is."""
    if not isinstance(record, dict):
        return "not a JSON object"
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return "no integer step"
    if not isinstance(record.get("event"), str):
        return "no event"
    when = record.get("time")
    if when is not None and (not isinstance(when, (int, float)) or isinstance(when, bool)):
        return "time is not a number"
    for name, value in record.items():
        if name.endswith("_bytes") and value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return f"{name} is not a byte count"
    if any(record.get(name) is not None and not isinstance(record[name], dict) for name in DICT_FIELDS):
        return "a layout or plan field is not an object"
    return None


def parse_lines(data: bytes) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The records of a log file's bytes, and the lines skipped, counted by reason. The text after
    the last newline is a line still being written (or cut by a crash): skipped as "unfinished"."""
    lines = data.split(b"\n")
    tail = lines.pop()
    records: list[dict[str, Any]] = []
    skipped: dict[str, int] = {}
    for raw in lines:
        if not raw.strip():
            continue
        problem = None
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            problem = "not UTF-8"
        except ValueError:  # json.JSONDecodeError, and numbers Python cannot hold
            problem = "not JSON"
        else:
            problem = record_problem(record)
        if problem is None:
            records.append(record)
        else:
            skipped[problem] = skipped.get(problem, 0) + 1
    if tail.strip():
        skipped["unfinished last line"] = skipped.get("unfinished last line", 0) + 1
    return records, skipped


# --- the Trainer's loggers -----------------------------------------------------------------------

METRIC_FIELDS = ("process", "device_used", "peak", "headroom")
"""Per-rank readings sent to the Trainer's loggers, as memplan/rank<R>/<name>_gib."""


def logger_metrics(statuses: Sequence[RankStatus], layout: Any, predicted_peak_bytes: int | None,
                   on_gpu: bool = True) -> dict[str, float]:
    """Every rank's readings for the Trainer's loggers, sizes in GiB with the unit in the key:
    memplan/rank<R>/process_gib (this process on its device), device_used_gib, peak_gib (the process's
    peak in the interval), headroom_gib; and the plan's per-device prediction at its micro-batch. On a
    GPU that is memplan/predicted_peak_gib, comparable with peak_gib. On CPU the readings are the
    process's resident memory (Python, libraries, allocator caches: hundreds of MiB before any tensor)
    while the prediction counts the step's tensors, so it is logged as
    memplan/predicted_tensor_peak_gib, a name nobody reads against the process's figures."""
    metrics: dict[str, float] = {
        "memplan/micro_batch_size": float(layout.micro_batch_size),
        "memplan/micro_batches_per_step": float(layout.micro_batches_per_step),
        "memplan/gradient_checkpointing": float(layout.gradient_checkpointing),
    }
    if predicted_peak_bytes is not None:
        key = "memplan/predicted_peak_gib" if on_gpu else "memplan/predicted_tensor_peak_gib"
        metrics[key] = predicted_peak_bytes / GiB
    for status in statuses:
        reading = status.reading
        values = (reading.process_bytes, reading.device_used_bytes, reading.process_peak_bytes, reading.headroom_bytes)
        for name, value in zip(METRIC_FIELDS, values):
            if value is not None:
                metrics[f"memplan/rank{status.rank}/{name}_gib"] = value / GiB
        metrics[f"memplan/rank{status.rank}/oom_retries"] = float(status.oom_retries)
    return metrics


class LoggerRows:
    """memplan's metrics inside the row Lightning writes for the same step, one row per step.

    Lightning writes a step's row with one `log_metrics(metrics, step)` call per logger, after the
    batch-end hooks. `add` keeps memplan's metrics for that step; each logger's `log_metrics`, wrapped
    by `install` (an attribute on the logger object, removed by `remove`), adds them to the first call
    for that step. This costs a dict merge, where `LightningModule.log` costs ~100 us a metric. A
    logger whose attribute cannot be set gets memplan's metrics in a call of their own.
    """

    def __init__(self) -> None:
        self._pending: tuple[int, dict[str, float], set[int]] | None = None
        self._wrapped: list[tuple[Any, Any]] = []

    def install(self, loggers: Sequence[Any]) -> None:
        for logger in loggers:
            own = vars(logger).get("log_metrics") if hasattr(logger, "__dict__") else None
            original = logger.log_metrics

            def log_metrics(metrics: dict[str, float], step: int | None = None, *, _logger=logger,
                            _original=original) -> Any:
                return _original(self._with_pending(_logger, metrics, step), step)

            try:
                logger.log_metrics = log_metrics
            except AttributeError:  # __slots__ or a read-only attribute: add() calls it directly
                continue
            self._wrapped.append((logger, own))

    def add(self, metrics: dict[str, float], step: int, loggers: Sequence[Any]) -> None:
        """memplan's metrics for the row Lightning writes at `step` (its step index)."""
        self._pending = (step, metrics, set())
        wrapped = {id(logger) for logger, _ in self._wrapped}
        for logger in loggers:
            if id(logger) not in wrapped:
                logger.log_metrics(metrics, step=step)

    def _with_pending(self, logger: Any, metrics: dict[str, float], step: int | None) -> dict[str, float]:
        pending = self._pending
        if pending is None or pending[0] != step or id(logger) in pending[2]:
            return metrics
        pending[2].add(id(logger))
        return {**metrics, **pending[1]}

    def remove(self) -> None:
        for logger, own in self._wrapped:
            if own is None:
                del logger.log_metrics
            else:
                logger.log_metrics = own
        self._wrapped, self._pending = [], None


# --- summary -----------------------------------------------------------------------------------

def summary_line(rank: int, peak_process_bytes: int | None, min_headroom_bytes: int | None,
                 micro_batch_size: int, micro_batches_per_step: int, checkpointing: bool, oom_retries: int,
                 dropped_lines: int = 0) -> str:
    """One rank's end-of-fit summary, for people."""
    peak = "n/a" if peak_process_bytes is None else format_bytes(peak_process_bytes)
    headroom = "n/a" if min_headroom_bytes is None else format_bytes(min_headroom_bytes)
    dropped = f", {dropped_lines} log line(s) not written" if dropped_lines else ""
    return (f"rank {rank}: peak {peak} in this process, least headroom {headroom}, micro-batch "
            f"{micro_batch_size} x {micro_batches_per_step} per step{', checkpointing' if checkpointing else ''}, "
            f"{oom_retries} OOM retr{'y' if oom_retries == 1 else 'ies'}{dropped}")
