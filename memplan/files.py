"""Reading a user's file safely: regular files only, and never more than a stated size.

`/dev/zero` given as a config would be read until memory runs out, and a FIFO would block the command
for ever; both are refused by name before a byte is read. A file larger than its kind ever is (a
config, a plan file) is refused with its size, so no command reads without bound.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from memplan.units import format_bytes

CONFIG_MAX_BYTES = 16 << 20
"""A config YAML at most (16 MiB: a LightningCLI config is a few KiB)."""
PLAN_MAX_BYTES = 16 << 20
"""A plan file at most (16 MiB: one is a few KiB)."""


class NotAFile(OSError):
    """The path names something other than a regular file (a FIFO, a device, a socket, a folder)."""


class FileTooLarge(OSError):
    """The file is larger than its kind ever is."""


def kind_of(mode: int) -> str:
    """'a FIFO', 'a character device' ... for a stat mode."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike, *, name: str) -> int:
    """A read-only descriptor on `path`, which must be a regular file. Opened without blocking (a FIFO
    with no writer would block the open itself), then checked with fstat: no race with a swap between
    a check and the open. Raises FileNotFoundError / PermissionError as open does, NotAFile naming
    `name` (the flag or argument) and what the path is."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotAFile(f"{name} {path} is {kind_of(mode)}, not a regular file; pass a file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path: str | os.PathLike, *, limit_bytes: int, name: str) -> bytes:
    """The whole of a regular file of at most `limit_bytes`; NotAFile / FileTooLarge (OSErrors) name
    `name` and the path, and say what to pass instead. A file that grows while read is cut at the limit
    and refused the same way."""
    fd = open_regular(path, name=name)
    with os.fdopen(fd, "rb") as file:
        data = file.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise FileTooLarge(f"{name} {path} is larger than {format_bytes(limit_bytes)}, far more than such a "
                           "file holds; pass the right file")
    return data


def is_regular_file(path: Path) -> bool:
    """Whether `path` is a regular file now (following links); False for what cannot be stat'ed."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False
