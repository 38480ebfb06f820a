"""The command line's input checks: argparse types that refuse a bad value by its flag, while parsing.

Each factory takes the flag as the user types it and returns an argparse `type=` callable, so a bad
value ends the command before anything is loaded or traced:

    memplan suggest: error: argument --gpu-memory: 24 what? Give a unit, e.g. 24GiB (or 24GB; B for bytes); got '24'

Nothing here imports torch: `memplan --help` and every refusal stay fast.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `prog: error: argument --flag: what is wrong; got 'x'` and the
    pointer to --help, instead of the whole usage block."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        print(f"(see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _int(text: str, what: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number ({what}); got {text!r}") from None


def positive_int(flag: str, what: str) -> Callable[[str], int]:
    """A whole number >= 1, e.g. --global-batch-size."""
    def parse(text: str) -> int:
        value = _int(text, what)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be a positive whole number ({what}); got {text!r}")
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


def gpu_name(flag: str) -> Callable[[str], Any]:
    """A GPU model from memplan's catalog ('H100-80GB', 'a100_80g'), as a GpuModel."""
    def parse(text: str) -> Any:
        from memplan.hardware.catalog import lookup_gpu

        try:
            return lookup_gpu(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).replace("--gpu ", "", 1)) from None
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
