"""The per-rank run log: `<log_dir>/rank<R>.jsonl` written by MemoryPlanner and read by `memplan
report` / `memplan watch`; the readings sent to the Trainer's loggers; the end-of-fit summary line."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memplan.units import format_bytes

if TYPE_CHECKING:
    from memplan.callback.adjust import RankStatus

METRIC_FIELDS = ("process_bytes", "device_used_bytes", "peak_bytes", "headroom_bytes")
"""The readings sent to the Trainer's loggers, per rank."""


def log_metrics(loggers: Sequence[Any], statuses: Sequence[RankStatus], layout: Any, step: int) -> None:
    """Every rank's readings to the Trainer's loggers as memplan/rank<R>/<field>. Lightning's loggers
    write from rank 0 only; after the gather rank 0 holds every rank's readings."""
    metrics: dict[str, float] = {
        "memplan/micro_batch_size": float(layout.micro_batch_size),
        "memplan/micro_batches_per_step": float(layout.micro_batches_per_step),
        "memplan/gradient_checkpointing": float(layout.gradient_checkpointing),
    }
    for status in statuses:
        for name in METRIC_FIELDS:
            value = getattr(status.reading, name)
            if value is not None:
                metrics[f"memplan/rank{status.rank}/{name}"] = float(value)
        metrics[f"memplan/rank{status.rank}/oom_retries"] = float(status.oom_retries)
    for logger in loggers:
        logger.log_metrics(metrics, step=step)


class RankLog:
    """`<dir>/rank<R>.jsonl`: one JSON object a line, flushed as written, appended across resumes."""

    def __init__(self, directory: str | os.PathLike, rank: int) -> None:
        self.path = Path(directory) / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._file = self.path.open("a", encoding="utf-8", buffering=1)  # line-buffered: flushed per line

    def write(self, event: str, step: int, **fields_: Any) -> dict[str, Any]:
        record = {"event": event, "step": step, "rank": self.rank, "time": round(time.time(), 3), **fields_}
        self._file.write(json.dumps(record) + "\n")
        return record

    def close(self) -> None:
        self._file.close()


def summary_line(rank: int, peak_process_bytes: int | None, min_headroom_bytes: int | None,
                 micro_batch_size: int, micro_batches_per_step: int, checkpointing: bool, oom_retries: int) -> str:
    """One rank's end-of-fit summary, for people."""
    peak = "n/a" if peak_process_bytes is None else format_bytes(peak_process_bytes)
    headroom = "n/a" if min_headroom_bytes is None else format_bytes(min_headroom_bytes)
    return (f"rank {rank}: peak {peak} in this process, least headroom {headroom}, micro-batch "
            f"{micro_batch_size} x {micro_batches_per_step} per step{', checkpointing' if checkpointing else ''}, "
            f"{oom_retries} OOM retr{'y' if oom_retries == 1 else 'ies'}")
