"""`memplan watch`: each rank's latest memory reading from a run's MemoryPlanner logs, refreshed in place on a
terminal (like gpustat -i), one plain line per reading into a pipe or a file.
"""
from __future__ import annotations

import argparse
import sys

from memplan.commands import args as arg

NO_RUN = "(no run id)"
"""memplan.commands.run_logs.NO_RUN_ID, without importing it at startup."""
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.01, 3600.0
"""`watch --interval` range in seconds."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("watch", help="each rank's latest memory reading, refreshed (like gpustat -i)")
    p.add_argument("log_dir", help="the run's log directory (lightning_logs/, a version_N folder, or its memplan/ "
                   "folder); waits for logs to appear")
    p.add_argument("--interval", type=arg.seconds("--interval", MIN_INTERVAL_S, MAX_INTERVAL_S), default=2.0,
                   help=f"seconds between refreshes, {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g} (default 2)")
    p.add_argument("--once", action="store_true", help="print the table once and exit")
    arg.add_run_choice(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memplan.commands.run_logs import NoRankLogs, RunWatcher

    watcher = RunWatcher(args.log_dir, version=args.version, run=args.run_id)
    waiting = not (args.once or args.version is not None or args.run_id is not None)
    if not args.once and not sys.stdout.isatty():
        return _watch_plain(args, watcher, waiting)
    import time

    from memplan.commands.output import console as output_console
    from rich.live import Live
    from rich.markup import escape

    from memplan.commands.report import watch_view

    def view():
        try:
            return watch_view(watcher.logs())
        except NoRankLogs as err:  # not yet: a run started with the watch has not written its logs
            if not waiting:
                raise
            return f"waiting for MemoryPlanner logs ({escape(str(err))}); Ctrl-C to stop"

    try:
        first = view()
    except NoRankLogs as err:
        return arg.usage_error(str(err))
    if args.once:
        output_console().print(first)
        return arg.EXIT_OK
    try:
        with _sigterm_ends_watch(), Live(first, refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                try:
                    live.update(view())
                except NoRankLogs as err:  # a --version / --run that went away: say so, keep watching
                    live.update(f"memplan: {escape(str(err))}")
    except KeyboardInterrupt:
        return arg.EXIT_OK


def _watch_plain(args: argparse.Namespace, watcher, waiting: bool) -> int:
    """`watch` into a pipe or a file: one plain line per reading (at first, each rank's latest), flushed
    as it comes; ends with the run ('run ended: ...'), on Ctrl-C or on SIGTERM."""
    import time

    from memplan.commands.report import plain_line
    from memplan.commands.run_logs import NoRankLogs

    new: list[tuple[int, dict]] = []
    first, said_waiting = True, False

    def collect(rank: int, record: dict) -> None:
        if record.get("event") == "sample":
            new.append((rank, record))

    try:
        with _sigterm_ends_watch():
            while True:
                try:
                    logs = watcher.logs(on_record=None if first else collect)
                except NoRankLogs as err:
                    if not waiting:
                        return arg.usage_error(str(err))
                    if not said_waiting:
                        print(f"memplan watch: waiting for MemoryPlanner logs ({err})", flush=True)
                        said_waiting = True
                    time.sleep(args.interval)
                    continue
                if first:
                    new = [(h.rank, h.last_sample) for h in logs.histories if h.last_sample is not None]
                    first = False
                shown = {h.rank for h in logs.histories}
                for rank, record in new:
                    run = record.get("run") if isinstance(record.get("run"), str) else NO_RUN
                    if rank in shown and run == logs.run.run:
                        print(plain_line(rank, record), flush=True)
                new.clear()
                if logs.ended:
                    print(f"memplan watch: run {logs.run.run} ended: {logs.ended}", flush=True)
                    return arg.EXIT_OK
                time.sleep(args.interval)
    except KeyboardInterrupt:
        return arg.EXIT_OK
    except BrokenPipeError:  # `memplan watch DIR | head`: the reader left
        sys.stderr.close()
        return arg.EXIT_OK


def _sigterm_ends_watch():
    """Within it, SIGTERM ends `watch` as Ctrl-C does (exit 0, the terminal restored)."""
    import contextlib
    import signal

    @contextlib.contextmanager
    def handler():
        def stop(signum, frame):
            raise KeyboardInterrupt

        try:
            previous = signal.signal(signal.SIGTERM, stop)
        except ValueError:  # not the main thread: leave signals alone
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    return handler()
