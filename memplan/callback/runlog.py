"""The per-rank run log's schema: what MemoryPlanner writes (memplan.callback.rank_log) and `memplan report`
and `memplan watch` read (memplan.commands.run_logs, log_reader, log_scan); and the reference parser of a
log file's bytes.

`<log_dir>/rank<R>.jsonl` holds one JSON object a line. Every record has

    event  one of EVENTS          step  the optimizer step (trainer.global_step)
    rank   the global rank        run   the run id, the same on every rank of one fit
    time   seconds since the epoch

and the event's own fields (byte counts are ints named `*_bytes`). Lines of several fits may share a
file (a resume into the same log_dir); the run id tells them apart. A line is written with one
`write(2)` on a file opened O_APPEND, so a reader never sees two records in one line; a write that
fails half-way is taken back where it can be (memplan.callback.rank_log). A reader skips, and counts,
the lines that are not records of this schema (`parse_lines`).

This module imports neither torch nor Lightning nor the writer: `memplan report` reads logs without them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

LOG_GLOB = "rank*.jsonl"
"""The files of one log folder."""
EVENTS = ("apply", "loader", "sample", "change", "oom_retry", "fatal", "summary", "end")
"""apply: the layout a fit starts with (`ranks`: how many ranks write; `layout.world_size`: how many of them are
data-parallel, train different samples: fewer under a ModelParallelStrategy whose data-parallel mesh is smaller than
the world; logs before `ranks` have the two equal); loader: the
loader's real batch size; sample: a reading; change: a shared layout change; oom_retry: an OOM retried;
fatal: an OOM that ended the run; summary: the rank's figures at the end of fit; end: the log closed
(`status` "finished" or the error that ended the fit, `signal` the name of the signal that ended it or null,
`dropped_lines`; logs written before `signal` lack the key)."""
DICT_FIELDS = ("layout", "plan", "before", "after")
"""Fields that hold objects (a layout or plan as a dict)."""


def default_log_dir(trainer_log_dir: str | os.PathLike | None, search_path: list[str]) -> Path:
    """Where MemoryPlanner logs without `log_dir=`: `<trainer.log_dir>/memplan`, or `<trainer.log_dir>/memplan_logs`
    where trainer.log_dir is a folder Python imports from (`search_path`, sys.path: '' the working directory). With
    `logger=False` trainer.log_dir is the working directory, the script's own folder; a `memplan/` folder there is
    imported as an empty namespace package in place of memplan on the next run ("module 'memplan' has no attribute
    'MemoryPlanner'")."""
    parent = Path(trainer_log_dir or ".")
    try:
        here = parent.resolve()
        imported = here in {Path(entry or ".").resolve() for entry in search_path}
    except (OSError, RuntimeError):
        imported = False
    return parent / ("memplan_logs" if imported else "memplan")


def log_path(directory: str | os.PathLike, rank: int) -> Path:
    """Rank `rank`'s log in `directory`: rank0.jsonl, rank12.jsonl (never rank01.jsonl)."""
    return Path(directory) / f"rank{rank}.jsonl"


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
