"""The one error type for a bad config: the key at fault and the fix, in words."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A config memplan cannot use. The message names the YAML key and the fix; `exit_code` is what the
    command line returns for it (2: a usage error, as argparse's)."""

    exit_code: int = 2

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        """The dotted YAML key at fault, e.g. 'model.init_args.hidden' ('' for the file itself)."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or ''."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
