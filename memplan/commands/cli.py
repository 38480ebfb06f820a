"""The memplan command line: registers each subcommand and maps errors to exit codes; main() returns the code.

Each subcommand is a module of its own (memplan.commands.<verb>) with `add_parser(subparsers)` and
`run(args)`. Every flag is checked while parsing (memplan.commands.args), before anything is loaded or
traced; a bad input is one line naming it, exit code 2, and `--debug` shows the traceback. Nothing here
imports torch at import time: `memplan --help` and `memplan --version` stay fast.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from memplan.commands import args as arg
from memplan.commands import devices, estimate, report, suggest, validate, watch

EXIT_OK, EXIT_ERROR, EXIT_USAGE = arg.EXIT_OK, arg.EXIT_ERROR, arg.EXIT_USAGE
EXIT_INTERRUPTED = 130
"""Ctrl-C, as a shell reports a process ended by SIGINT."""
COMMANDS = (estimate, suggest, devices, report, watch, validate)
"""The subcommands, in the order `memplan --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    from memplan import __version__

    parser = arg.Parser(prog="memplan", description="Memory planning for PyTorch Lightning training.")
    parser.add_argument("--version", action="version", version=f"memplan {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    for command in sub.choices.values():  # `memplan suggest ... --debug` as well as `memplan --debug suggest ...`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an error")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, --version, or a flag refused while parsing (already printed)
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    try:
        return args.run(args)
    except (ValueError, FileExistsError) as err:  # ConfigError, UsageError, EstimateError, OutputExists: named inputs
        if args.debug:
            raise
        return arg.usage_error(str(err))
    except OSError as err:  # a file memplan reads or writes
        if args.debug:
            raise
        print(f"memplan: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("memplan: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
