"""The command line's input checks: argparse types that refuse a bad value by its flag, while parsing.

Each factory takes the flag as the user types it and returns an argparse `type=` callable, so a bad
value ends the command before anything is loaded or traced:

    memplan suggest: error: argument --gpu-memory: 24 what? Give a unit, e.g. 24GiB (or 24GB; B for bytes); got '24'

Nothing here imports torch: `memplan --help` and every refusal stay fast.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
MAX_VERSION = 10**9
"""`--version N` at most."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `prog: error: argument --flag: what is wrong; got 'x'` and the
    pointer to --help, instead of the whole usage block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A value that starts with '-' and a digit ('-5GiB', '-3') is a value, refused by the flag's own
        # check, never taken for an unknown option (argparse's "expected one argument").
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        print(f"(see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _shown(text: str) -> str:
    """The value as the user typed it, or its length when too long to echo."""
    return repr(text) if len(text) <= 40 else f"{len(text)} characters starting {text[:12]!r}"


def _int(text: str, what: str) -> int:
    try:
        return int(text, 10)
    except ValueError:  # also past Python's 4300-digit limit
        raise argparse.ArgumentTypeError(f"must be a whole number ({what}); got {_shown(text)}") from None


def positive_int(flag: str, what: str, maximum: int, *, hint: str = "") -> Callable[[str], int]:
    """A whole number from 1 to `maximum`, e.g. --global-batch-size. Above it is refused with the range
    (and `hint`, the fix): no command loops over, or allocates for, an absurd count."""
    def parse(text: str) -> int:
        value = _int(text, what)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be a positive whole number ({what}); got {_shown(text)}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be from 1 to {maximum:,} ({what}){hint}; got {_shown(text)}")
        return value
    parse.__name__ = flag
    return parse


def whole_number(flag: str, what: str, maximum: int) -> Callable[[str], int]:
    """A whole number from 0 to `maximum`, e.g. --version 0."""
    def parse(text: str) -> int:
        value = _int(text, what)
        if not 0 <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be from 0 to {maximum:,} ({what}); got {_shown(text)}")
        return value
    parse.__name__ = flag
    return parse


def fraction(flag: str, what: str) -> Callable[[str], float]:
    """A number in [0, 1), e.g. --margin 0.1."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1) ({what}); got {text!r}") from None
        if not math.isfinite(value) or not 0.0 <= value < 1.0:
            hint = f" (for {value:g} %, write {value / 100:g})" if 1.0 <= value < 100.0 else ""
            raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1) ({what}){hint}; got {text!r}")
        return value
    parse.__name__ = flag
    return parse


def seconds(flag: str, low: float, high: float) -> Callable[[str], float]:
    """A finite number of seconds in [low, high], e.g. --interval 2."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of seconds; got {text!r}") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a number of seconds from {low:g} to {high:g}; got {text!r}")
        return value
    parse.__name__ = flag
    return parse


def size(flag: str) -> Callable[[str], int]:
    """A memory size with its unit ('24GiB', '80GB', '512MiB'), as bytes. A bare number is refused:
    '24' could be GiB, GB or bytes."""
    from memplan.units import parse_size

    def parse(text: str) -> int:
        try:
            return parse_size(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    parse.__name__ = flag
    return parse


def precision(flag: str) -> Callable[[str], str]:
    """A Lightning precision or alias ('16', 'bf16', '16-mixed' ...), as Lightning's canonical string."""
    from memplan.precision import canonical_precision

    def parse(text: str) -> str:
        try:
            return canonical_precision(text, name="")
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).strip()) from None
    parse.__name__ = flag
    return parse


def deterministic(flag: str) -> Callable[[str], bool | str]:
    """Lightning's Trainer(deterministic=...) on the command line: 'true', 'false' or 'warn' (warn-only)."""
    def parse(text: str) -> bool | str:
        value = {"true": True, "false": False, "warn": "warn"}.get(text.strip().lower())
        if value is None:
            raise argparse.ArgumentTypeError("must be true, false or warn (Lightning's Trainer(deterministic=...): "
                                             f"warn is warn-only); got {text!r}")
        return value
    parse.__name__ = flag
    return parse


def gpu_name(flag: str) -> Callable[[str], Any]:
    """A GPU model from memplan's catalog ('H100-80GB', 'a100_80g'), as a GpuModel."""
    def parse(text: str) -> Any:
        from memplan.hardware.catalog import UnknownGpu, lookup_gpu

        try:
            return lookup_gpu(text)
        except UnknownGpu as err:  # (argparse puts the flag's name before it)
            raise argparse.ArgumentTypeError(err.what) from None
    parse.__name__ = flag
    return parse


def choice(flag: str, choices: Callable[[], tuple[str, ...]], what: str) -> Callable[[str], str]:
    """One of `choices()` (looked up only when the flag is given), with a did-you-mean."""
    def parse(text: str) -> str:
        import difflib

        known = choices()
        if text in known:
            return text
        close = difflib.get_close_matches(text, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(known)} ({what}); got {text!r}{hint}")
    parse.__name__ = flag
    return parse


class UsageError(ValueError):
    """A bad combination of inputs found after parsing (before any tracing): exit code 2, one line."""


def usage_error(message: str) -> int:
    """A bad input found after parsing: one line on stderr, exit code 2."""
    print(f"memplan: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def add_run_choice(p: argparse.ArgumentParser) -> None:
    """`--version N` and `--run ID`: which run of a log folder `report` and `watch` read."""
    p.add_argument("--version", type=whole_number("--version", "a version_N folder's N", MAX_VERSION), default=None,
                   metavar="N",
                   help="read lightning_logs/version_N (default: the folder written last)")
    p.add_argument("--run", dest="run_id", default=None, metavar="ID",
                   help="the run whose id starts with ID, where runs shared a log folder (default: the newest)")
