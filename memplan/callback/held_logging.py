"""`self.log` calls held while a chunk runs, and made once the batch's last chunk has succeeded: a chunk that
fails, or is not the batch's last, must not log (with sync_dist=True a log is a collective).

A class, not a @contextmanager generator: it runs for every chunk of every step, where a generator's set-up
costs a few microseconds each."""
from __future__ import annotations

from typing import Any


class HeldLogging:
    """Hold the module's `self.log` calls (and `log_dict`'s, which go through it) instead of making
    them: a chunk that fails, or is not the batch's last, must not log (with sync_dist=True a log is a
    collective, and a rank that logged twice in a batch would wait forever for the others)."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.calls: list[tuple[tuple, dict]] = []

    def __enter__(self) -> list[tuple[tuple, dict]]:
        calls = self.calls
        self._module.__dict__["log"] = lambda *args, **kwargs: calls.append((args, kwargs))
        return calls

    def __exit__(self, *exc: Any) -> None:
        self._module.__dict__.pop("log", None)


def replay_logged(module: Any, calls: list[tuple[tuple, dict]]) -> None:
    """Make the held `self.log` calls (through the class's `log`, a user's override included)."""
    for args, kwargs in calls:
        module.log(*args, **kwargs)
