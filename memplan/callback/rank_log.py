"""The writer of the per-rank run log (its schema: memplan.callback.runlog): one whole line per record,
appended, and a write that fails counted, never raised: logging does not end a run.

A line is written with one `write(2)` on a file opened O_APPEND, so a reader never sees two records in
one line; a write that fails half-way is taken back (truncated), and a failed write is counted and
warned about once.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import time
import warnings
from collections.abc import Callable
from typing import Any

from memplan.callback.runlog import log_path


def new_run_id() -> str:
    """A run id that sorts by start time: '20261124-052200-3fa9c1' (UTC)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


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
