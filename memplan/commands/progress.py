"""One progress line on stderr while a command works (loading, tracing), only where a person watches.

On a terminal each `say` rewrites the line in place and `clear` wipes it, so the result prints on a
clean screen; anywhere else (a pipe, a log, `--json`) it writes nothing.
"""
from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


class Progress:
    """`say(text)` what is happening now; `clear()` when done."""

    def __init__(self, stream: TextIO | None = None, *, enabled: bool | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = _is_terminal(self._stream) if enabled is None else enabled
        self._start = time.monotonic()
        self._shown = False

    @property
    def enabled(self) -> bool:
        return self._enabled

    def say(self, text: str) -> None:
        if not self._enabled:
            return
        line = f"{time.monotonic() - self._start:5.1f}s  {text}"
        width = shutil.get_terminal_size().columns - 1  # one screen line, so \r rewrites all of it
        self._stream.write(f"\r\x1b[2K{line[:width]}")
        self._stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self._enabled and self._shown:
            self._stream.write("\r\x1b[2K")
            self._stream.flush()
            self._shown = False


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
