"""The memplan command line. Each subcommand is a small function; main() returns the exit code.

Every flag is checked while parsing (memplan.commands.args), before anything is loaded or traced; a
bad input is one line naming it, exit code 2, and `--debug` shows the traceback. Nothing here imports
torch at import time: `memplan --help` and `memplan --version` stay fast.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from memplan.commands import args as arg
from memplan.plan import MAX_BATCH_SIZE, MAX_GPUS_PER_NODE, MAX_NODES, MAX_WORLD_SIZE

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
NO_RUN = "(no run id)"
"""memplan.commands.run_logs.NO_RUN_ID, without importing it at startup."""
MAX_VALIDATE_STEPS = 1000
"""`validate --steps` at most: it compares an estimate with a few real steps, not a training run."""
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.01, 3600.0
"""`watch --interval` range in seconds."""
MAX_VERSION = 10**9
"""`--version N` at most."""


def _add_estimate(sub) -> None:
    p = sub.add_parser("estimate", help="peak memory of one training step, as a breakdown table")
    p.add_argument("config", nargs="?", help="a LightningCLI config (model: / data: / trainer: / memplan:)")
    p.add_argument("--demo", type=arg.choice("--demo", _demo_names, "a bundled model"),
                   help="a bundled model instead of a config: mlp, cnn, resnet, gpt2-small")
    p.add_argument("--batch-size", type=arg.positive_int("--batch-size", "samples per device", MAX_BATCH_SIZE), required=True,
                   help="micro-batch size per device")
    p.add_argument("--precision", type=arg.precision("--precision"), default=None,
                   help="Lightning precision: 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true or an alias "
                        "(32, 16, bf16) (default: the config's trainer.precision, else 32-true)")
    p.add_argument("--checkpointing", action="store_true", help="checkpoint each repeated block")
    p.add_argument("--optimizer", type=arg.choice("--optimizer", _optimizer_names, "memplan's optimizer names"),
                   default=None, help="sgd, sgd-momentum, adam, adamw, rmsprop, adagrad "
                   "(default: the config's optimizer, else the model's configure_optimizers)")
    p.add_argument("--device", type=_device, default=None,
                   help="'cpu', 'cuda' (this machine's GPU), a GPU model such as A100-80GB, or a GPU's memory "
                        "such as 24GiB (default: this machine's GPU)")
    p.add_argument("--ddp", type=arg.positive_int("--ddp", "world size", MAX_WORLD_SIZE), default=None, metavar="WORLD_SIZE",
                   help="estimate a DDP rank of this world size")
    p.add_argument("--loop", choices=("lightning", "torch"), default="lightning", help="step order: 'lightning' "
                   "(zero_grad after the forward) or 'torch' (forward, backward, step, zero_grad)")
    p.add_argument("--data-dependent", choices=("balanced", "sample", "error"), default="balanced",
                   help="shapes decided by activation values (MoE routing, matching): 'balanced' (even routing), "
                        "'sample' (random values) or 'error' (refuse); shapes decided by the batch are always exact")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON (bytes as ints)")
    p.set_defaults(run=cmd_estimate)


def _demo_names() -> tuple[str, ...]:
    from memplan.demos import DEMOS

    return tuple(DEMOS)


def _optimizer_names() -> tuple[str, ...]:
    from memplan.estimator.inputs import OPTIMIZERS

    return tuple(OPTIMIZERS)


def _device(text: str):
    """--device: 'cpu', 'cuda' (None: this machine's GPU), a catalogued GPU, or a memory size (a custom GPU)."""
    if text.strip().lower() == "cpu":
        return "cpu"
    if text.strip().lower() in ("cuda", "gpu", "local"):
        return None
    from memplan.hardware.catalog import custom_gpu, lookup_gpu
    from memplan.units import parse_size

    try:
        return lookup_gpu(text)
    except ValueError as err:
        if "is ambiguous" in str(err):  # a family name (A100, V100): name the boards, as --gpu does
            raise argparse.ArgumentTypeError(str(err).removeprefix("--gpu ")) from None
    try:
        return custom_gpu(parse_size(text))
    except ValueError:
        from memplan.hardware.catalog import known_gpu_names

        raise argparse.ArgumentTypeError(
            f"must be 'cpu', 'cuda' (this machine's GPU), a GPU memplan knows ({', '.join(known_gpu_names())}) or "
            f"a GPU's memory with its unit, e.g. 24GiB; got {text!r}") from None


def cmd_estimate(args: argparse.Namespace) -> int:
    if (args.config is None) == (args.demo is None):
        return _usage_error("pass a config file or --demo NAME (one of them)")
    options = dict(checkpointing=args.checkpointing, device=args.device,
                   strategy="ddp" if args.ddp else None, world_size=args.ddp or 1, loop=args.loop,
                   data_dependent=args.data_dependent)
    try:
        est = _estimate_config(args, options) if args.config else _estimate_demo(args, options)
    except ValueError as err:  # EstimateError and ConfigError are ValueErrors naming the field
        message = str(err)
        if message.startswith("checkpointing=True found no repeated blocks"):
            message = ("--checkpointing: the model has no repeated blocks (an nn.ModuleList or nn.Sequential of >= 2 "
                       "modules of one class) to checkpoint; drop --checkpointing")
        return _usage_error(message)
    import dataclasses

    est = dataclasses.replace(est, notes=tuple(n.replace("pass device='H100-80GB' (or another) to choose",
                                                         "pass --device H100-80GB (or another GPU) to choose")
                                               for n in est.notes))
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        from memplan.commands.output import console as output_console

        output_console().print(est)
    return EXIT_OK


def _add_devices(sub) -> None:
    p = sub.add_parser("devices", help="the GPUs (NVML) and host memory memplan sees")
    p.add_argument("--json", action="store_true", help="print as JSON (bytes as ints)")
    p.set_defaults(run=cmd_devices)


def cmd_devices(args: argparse.Namespace) -> int:
    from memplan.commands.devices import devices_dict, devices_table
    from memplan.hardware import host_info, visible_gpus

    gpus, host = visible_gpus(), host_info()
    if args.json:
        print(json.dumps(devices_dict(gpus, host), indent=2))
    else:
        from memplan.commands.output import console as output_console

        output_console().print(devices_table(gpus, host))
    return EXIT_OK


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="plot and summarise a run's MemoryPlanner logs (memory per rank, changes, OOMs)")
    p.add_argument("log_dir", help="the run's log directory (lightning_logs/, a version_N folder, or its memplan/ "
                   "folder holding rank<R>.jsonl)")
    p.add_argument("--output", default=None, help="PNG to write (default: LOG_DIR/memplan_report.png, else "
                   "./memplan_report.png when LOG_DIR is read-only)")
    _add_run_choice(p)
    p.set_defaults(run=cmd_report)


def _add_run_choice(p) -> None:
    p.add_argument("--version", type=arg.whole_number("--version", "a version_N folder's N", MAX_VERSION), default=None,
                   metavar="N",
                   help="read lightning_logs/version_N (default: the folder written last)")
    p.add_argument("--run", dest="run_id", default=None, metavar="ID",
                   help="the run whose id starts with ID, where runs shared a log folder (default: the newest)")


def cmd_report(args: argparse.Namespace) -> int:
    from memplan.commands.output import console as output_console

    from memplan.commands.report import output_path, plot, prepare_plot, summary_renderables
    from memplan.commands.run_logs import NoRankLogs, load_run

    try:  # (matplotlib imported while worker processes read a large folder)
        logs = load_run(args.log_dir, version=args.version, run=args.run_id, meanwhile=prepare_plot)
    except NoRankLogs as err:
        return _usage_error(str(err))
    try:  # before anything prints: a read-only folder is one clear line, not a crash after the summary
        path, note = output_path(args.output, args.log_dir)
    except OSError as err:
        return _usage_error(str(err))
    console = output_console()
    for renderable in summary_renderables(logs):
        console.print(renderable)
    if note:
        print(f"memplan: {note}", file=sys.stderr)
    try:
        plot(logs.histories, path)
    except OSError as err:
        print(f"memplan: could not write {path}: {err.strerror or err}; pass --output PATH", file=sys.stderr)
        return EXIT_ERROR
    print(f"wrote {path}")
    return EXIT_OK


def _add_watch(sub) -> None:
    p = sub.add_parser("watch", help="each rank's latest memory reading, refreshed (like gpustat -i)")
    p.add_argument("log_dir", help="the run's log directory (lightning_logs/, a version_N folder, or its memplan/ "
                   "folder); waits for logs to appear")
    p.add_argument("--interval", type=arg.seconds("--interval", MIN_INTERVAL_S, MAX_INTERVAL_S), default=2.0,
                   help=f"seconds between refreshes, {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g} (default 2)")
    p.add_argument("--once", action="store_true", help="print the table once and exit")
    _add_run_choice(p)
    p.set_defaults(run=cmd_watch)


def cmd_watch(args: argparse.Namespace) -> int:
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
        return _usage_error(str(err))
    if args.once:
        output_console().print(first)
        return EXIT_OK
    try:
        with _sigterm_ends_watch(), Live(first, refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                try:
                    live.update(view())
                except NoRankLogs as err:  # a --version / --run that went away: say so, keep watching
                    live.update(f"memplan: {escape(str(err))}")
    except KeyboardInterrupt:
        return EXIT_OK


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
                        return _usage_error(str(err))
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
                    return EXIT_OK
                time.sleep(args.interval)
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:  # `memplan watch DIR | head`: the reader left
        sys.stderr.close()
        return EXIT_OK


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


def _add_validate(sub) -> None:
    p = sub.add_parser("validate", help="run real training steps on this machine and compare with the estimate")
    p.add_argument("config", help="a LightningCLI config (model: / data: / trainer: / memplan:)")
    p.add_argument("--batch-size", type=arg.positive_int("--batch-size", "samples per device", MAX_BATCH_SIZE), default=None,
                   help="micro-batch size per device (default: the plan's, else the config's data batch size)")
    p.add_argument("--plan", default=None, help="a plan file from memplan suggest --output (*.plan.json): "
                   "its micro-batch, precision and checkpointing")
    p.add_argument("--precision", type=arg.precision("--precision"), default=None, help="Lightning precision or "
                   "alias (default: the plan's, "
                   "else the config's trainer.precision, else 32-true)")
    p.add_argument("--checkpointing", action="store_true", help="checkpoint each repeated block")
    p.add_argument("--steps", type=arg.positive_int("--steps", "real training steps", MAX_VALIDATE_STEPS), default=2,
                   help=f"real training steps to run, 1 to {MAX_VALIDATE_STEPS} (default 2)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON (bytes as ints)")
    p.add_argument("--force", action="store_true", help="run even when the estimate exceeds the memory free "
                   "on this host (or GPU); without it validate refuses, with the figures")
    p.set_defaults(run=cmd_validate)


def _read_plan(path: str):
    """The plan file of `validate --plan`, every failure a ValueError naming the flag and the file."""
    from memplan.files import PLAN_MAX_BYTES, FileTooLarge, NotAFile, read_bounded
    from memplan.plan import Plan

    try:
        data = json.loads(read_bounded(path, limit_bytes=PLAN_MAX_BYTES, name="--plan").decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--plan {path}: no such file; write one with "
                         "`memplan suggest ... --output planned.yaml`") from None
    except (NotAFile, FileTooLarge) as err:
        raise ValueError(str(err)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--plan {path}: cannot read it ({getattr(err, 'strerror', None) or err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--plan {path} is not JSON ({err}); pass the *.plan.json `memplan suggest` wrote") from None
    try:
        return Plan.from_dict(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--plan {path}: {err}") from None


def cmd_validate(args: argparse.Namespace) -> int:
    import torch

    from memplan.estimator.calibration import calibration_path, save_calibration
    from memplan.config import load_config
    from memplan.commands.validate import (Setting, calibration_from, check_room, compare, estimate_for,
                                           measure_in_subprocess, report_lines)

    if args.plan and args.batch_size is not None:
        return _usage_error("pass --batch-size or --plan, not both")
    try:
        loaded = load_config(args.config)
        plan = _read_plan(args.plan) if args.plan else None
        wrong_model = loaded.plan_mismatch(plan, plan_name=f"--plan {args.plan}") if plan else None
        if wrong_model is not None:
            return _usage_error(wrong_model)
        batch_size = plan.micro_batch_size if plan else args.batch_size or loaded.data_batch_size
        if batch_size is None:
            return _usage_error("the config has no data batch size; pass --batch-size N or --plan FILE")
        setting = Setting(
            config=args.config, batch_size=batch_size, steps=args.steps,
            precision=args.precision or (plan.precision if plan else None) or loaded.trainer_precision or "32-true",
            checkpointing=args.checkpointing or bool(plan and plan.gradient_checkpointing),
        )
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if plan is not None and (plan.gpu_name == "cpu") != (device == "cpu"):
            print(f"memplan: note: --plan {args.plan} was made for {plan.world_size} x {plan.gpu_name}; validate runs "
                  f"its micro-batch in one process on {device} here: it checks the estimate on {device}, not that "
                  f"the plan fits {plan.gpu_name}", file=sys.stderr)
        est = estimate_for(loaded, setting, device)
    except (OSError, ValueError) as err:  # ConfigError and EstimateError are ValueErrors naming the field
        return _usage_error(str(err))
    rooms = check_room(est, device, force=args.force)
    if rooms is None:
        return EXIT_ERROR
    try:
        measured = measure_in_subprocess(setting)
    except RuntimeError as err:
        print(f"memplan: {err}", file=sys.stderr)
        return EXIT_ERROR
    rows = compare(est, measured)
    calibration = calibration_from(measured)
    saved = save_calibration(calibration, calibration_path()) if calibration is not None else None
    if measured.device == "cpu":
        calib_line = "CPU run: no CUDA context to calibrate; nothing saved"
    elif saved is None:
        calib_line = "GPU run, but NVML could not see this process: no calibration saved"
    else:
        calib_line = (f"saved calibration to {saved}: CUDA context {calibration.context_bytes} bytes, "
                      f"allocator overhead {calibration.allocator_overhead:.4f} ({calibration.key.as_str()})")
    failed = any(not r.within_goal for r in rows)
    if args.json:
        print(json.dumps({"setting": setting.__dict__, "device": measured.device, "estimate": est.to_dict(),
                          "measurement": measured.__dict__,
                          "rows": [dict(r.__dict__, error_pct=r.error_pct) for r in rows],
                          "within_goal": not failed, "room": [room.to_dict() for room in rooms],
                          "calibration": calibration.to_dict() if calibration else None}, indent=2))
    else:
        print(f"validate {args.config}: batch {setting.batch_size}, {setting.precision}, checkpointing "
              f"{'on' if setting.checkpointing else 'off'}, {setting.steps} steps on {measured.device}")
        print("\n".join(report_lines(rows, measured.device)))
        print(calib_line)
    if failed:  # the loud line goes to stderr too, so --json and pipes still show it
        print("memplan: " + report_lines(rows, measured.device)[-1], file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def _estimate_demo(args: argparse.Namespace, options: dict):
    import memplan
    from memplan.compat.torch import FakeTensorMode
    from memplan.demos import DEMOS

    if args.demo not in DEMOS:
        raise ValueError(f"--demo must be one of {', '.join(DEMOS)}; got {args.demo!r}")
    with FakeTensorMode():
        model = DEMOS[args.demo]()  # born fake: no weight allocated
    _check_batch_memory(model.example_batch(1), args.batch_size)
    return memplan.estimate(model, model.example_batch(args.batch_size), optimizer=args.optimizer,
                            precision=args.precision or "32-true", **options)


def _estimate_config(args: argparse.Namespace, options: dict):
    from memplan.config import load_config

    loaded = load_config(args.config)
    precision = args.precision or loaded.trainer_precision or "32-true"
    optimizer = args.optimizer or loaded.optimizer
    _check_batch_memory(loaded.example_batch(1), args.batch_size)
    return loaded.estimate(args.batch_size, precision=precision, optimizer=optimizer, **options)


def _check_batch_memory(one_sample, batch_size: int) -> None:
    """--batch-size whose batch (built for real in host memory, to trace the step on it) would not fit here."""
    from memplan.batching import iter_tensors
    from memplan.hardware import host_info
    from memplan.units import format_bytes

    sample = sum(t.numel() * t.element_size() for t in iter_tensors(one_sample))
    available = host_info().available_bytes
    if sample * batch_size > available // 2:
        raise arg.UsageError(
            f"--batch-size {batch_size}: the batch alone is {format_bytes(sample * batch_size)} ({format_bytes(sample)} "
            f"a sample), over half the {format_bytes(available)} of host memory available; memplan builds one batch "
            "in host memory to trace the step: use a smaller --batch-size")


def _add_suggest(sub) -> None:
    p = sub.add_parser("suggest", help="plan micro-batch, GPUs, precision and checkpointing for a config")
    p.add_argument("config", help="a LightningCLI config (model: / data: / trainer: / memplan:)")
    p.add_argument("--gpus", type=arg.positive_int("--gpus", "GPUs per node", MAX_GPUS_PER_NODE,
                                                 hint="; for more GPUs, add nodes with --nodes"), default=None,
                   help="GPUs per node the plan may use (default: all visible / 1 named)")
    p.add_argument("--gpu", type=arg.gpu_name("--gpu"), default=None,
                   help="plan for this GPU model instead of the local ones (e.g. H100-80GB)")
    p.add_argument("--gpu-memory", type=arg.size("--gpu-memory"), default=None,
                   help="plan for a GPU of this much memory, with its unit (e.g. 24GiB)")
    p.add_argument("--nodes", type=arg.positive_int("--nodes", "number of nodes", MAX_NODES), default=1,
                   help="number of nodes (default 1)")
    p.add_argument("--global-batch-size", type=arg.positive_int("--global-batch-size", "samples per optimizer "
                   "step over all GPUs", MAX_BATCH_SIZE), default=None, help="samples per optimizer step over all GPUs "
                   "(default: memplan.global_batch_size, else the config's own)")
    p.add_argument("--precision", type=arg.precision("--precision"), action="append", default=None,
                   help="allowed precision: bf16-mixed, 16-mixed, 32-true or an alias (bf16, 16, 32); "
                        "repeatable (default: memplan.precisions)")
    p.add_argument("--no-checkpointing", action="store_true", help="never turn on gradient checkpointing")
    p.add_argument("--margin", type=arg.fraction("--margin", "of each GPU's free memory left unused"), default=None,
                   help="fraction of each GPU's free memory left unused, in [0, 1) (default: memplan.margin, 0.10)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes as ints); no progress line")
    p.add_argument("--output", default=None, help="write the planned config here and the plan beside it "
                   "(<name>.plan.json); refuses to replace existing files without --force")
    p.add_argument("--force", action="store_true", help="replace the --output config and plan file if they exist")
    p.set_defaults(run=cmd_suggest)


def cmd_suggest(args: argparse.Namespace) -> int:
    from memplan.commands.output import check_output, write_output
    from memplan.commands.progress import Progress

    if args.gpu is not None and args.gpu_memory is not None:
        return _usage_error("--gpu and --gpu-memory name the same thing; pass one of them")
    progress = Progress(enabled=None if not args.json else False)
    progress.say(f"loading {args.config}")
    from memplan.commands.suggest import plan_config, resolve_hardware  # torch: seconds, with the line shown
    from memplan.config import load_config
    from memplan.planner import NoFit

    try:
        if args.output is not None:
            check_output(args.output, args.config, force=args.force)
        loaded = load_config(args.config)
        hardware = resolve_hardware(gpus=args.gpus, gpu=args.gpu, gpu_memory=args.gpu_memory)
        for note in hardware.notes:
            progress.clear()
            print(f"memplan: note: {note}", file=sys.stderr)
        plan = plan_config(
            loaded, hardware, nodes=args.nodes, global_batch_size=args.global_batch_size,
            precisions=tuple(dict.fromkeys(args.precision)) if args.precision else None,
            allow_checkpointing=False if args.no_checkpointing else None, margin=args.margin, progress=progress,
        )
    except NoFit as err:
        print(f"memplan: {err}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        progress.clear()  # the result, or the error, prints on a clean line
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        if args.gpus is not None and plan.gpus_per_node < args.gpus:  # said in the table otherwise; never silent
            why = next((r for r in plan.reasons if r.startswith("Uses ")), "")
            print(f"memplan: note: the plan uses {plan.gpus_per_node} of the {args.gpus} GPUs per node --gpus gives. "
                  f"{why}", file=sys.stderr)
    else:
        from memplan.commands.output import console as output_console

        from memplan.commands.plan_table import render_plan

        output_console().print(render_plan(plan, loaded))
    if args.output:
        write_output(loaded, plan, args.output, force=args.force, stream=sys.stderr if args.json else sys.stdout)
    return EXIT_OK


def _usage_error(message: str) -> int:
    print(f"memplan: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    from memplan import __version__

    parser = arg.Parser(prog="memplan", description="Memory planning for PyTorch Lightning training.")
    parser.add_argument("--version", action="version", version=f"memplan {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_estimate(sub)
    _add_suggest(sub)
    _add_devices(sub)
    _add_report(sub)
    _add_watch(sub)
    _add_validate(sub)
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
        return _usage_error(str(err))
    except OSError as err:  # a file memplan reads or writes
        if args.debug:
            raise
        print(f"memplan: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("memplan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
