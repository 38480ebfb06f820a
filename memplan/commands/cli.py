"""The memplan command line. Each subcommand is a small function; main() returns the exit code."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _add_estimate(sub) -> None:
    p = sub.add_parser("estimate", help="peak memory of one training step, as a breakdown table")
    p.add_argument("config", nargs="?", help="a LightningCLI config (model: / data: / trainer: / memplan:)")
    p.add_argument("--demo", help="a bundled model instead of a config: mlp, cnn, resnet, gpt2-small")
    p.add_argument("--batch-size", type=int, required=True, help="micro-batch size per GPU")
    p.add_argument("--precision", default=None,
                   help="Lightning precision string (default: the config's trainer.precision, else 32-true)")
    p.add_argument("--checkpointing", action="store_true", help="checkpoint each repeated block")
    p.add_argument("--optimizer", default=None, help="sgd, sgd-momentum, adam, adamw, rmsprop, adagrad "
                   "(default: the model's configure_optimizers)")
    p.add_argument("--device", default=None, help="'cpu', or a GPU model such as A100-80GB (default: the local GPU)")
    p.add_argument("--ddp", type=int, default=None, metavar="WORLD_SIZE", help="estimate a DDP rank of this world size")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON (bytes as ints)")
    p.set_defaults(run=cmd_estimate)


def cmd_estimate(args: argparse.Namespace) -> int:
    if (args.config is None) == (args.demo is None):
        return _usage_error("pass a config file or --demo NAME (one of them)")
    if args.batch_size < 1:
        return _usage_error(f"--batch-size must be a positive integer; got {args.batch_size}")
    options = dict(checkpointing=args.checkpointing, device=args.device,
                   strategy="ddp" if args.ddp else None, world_size=args.ddp or 1)
    try:
        est = _estimate_config(args, options) if args.config else _estimate_demo(args, options)
    except ValueError as err:  # EstimateError and ConfigError are ValueErrors naming the field
        return _usage_error(str(err))
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        from rich.console import Console

        Console().print(est)
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
        from rich.console import Console

        Console().print(devices_table(gpus, host))
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
    p.add_argument("--version", type=int, default=None, metavar="N",
                   help="read lightning_logs/version_N (default: the folder written last)")
    p.add_argument("--run", dest="run_id", default=None, metavar="ID",
                   help="the run whose id starts with ID, where runs shared a log folder (default: the newest)")


def cmd_report(args: argparse.Namespace) -> int:
    from rich.console import Console

    from memplan.commands.report import output_path, plot, summary_renderables
    from memplan.commands.run_logs import NoRankLogs, load_run

    try:
        logs = load_run(args.log_dir, version=args.version, run=args.run_id)
    except NoRankLogs as err:
        return _usage_error(str(err))
    try:  # before anything prints: a read-only folder is one clear line, not a crash after the summary
        path, note = output_path(args.output, args.log_dir)
    except OSError as err:
        return _usage_error(str(err))
    console = Console()
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
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true", help="print the table once and exit")
    _add_run_choice(p)
    p.set_defaults(run=cmd_watch)


def cmd_watch(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.live import Live
    from rich.markup import escape

    from memplan.commands.report import watch_view
    from memplan.commands.run_logs import NoRankLogs, load_run

    if not args.interval > 0:
        return _usage_error(f"--interval must be a positive number of seconds; got {args.interval}")

    def view():
        try:
            return watch_view(load_run(args.log_dir, version=args.version, run=args.run_id))
        except NoRankLogs as err:  # not yet: a run started with the watch has not written its logs
            if args.once or args.version is not None or args.run_id is not None:
                raise
            return f"waiting for MemoryPlanner logs ({escape(str(err))}); Ctrl-C to stop"

    try:
        first = view()
    except NoRankLogs as err:
        return _usage_error(str(err))
    if args.once:
        Console().print(first)
        return EXIT_OK
    try:
        with Live(first, refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                try:
                    live.update(view())
                except NoRankLogs as err:  # a --version / --run that went away: say so, keep watching
                    live.update(f"memplan: {escape(str(err))}")
    except KeyboardInterrupt:
        return EXIT_OK


def _add_validate(sub) -> None:
    p = sub.add_parser("validate", help="run real training steps on this machine and compare with the estimate")
    p.add_argument("config", help="a LightningCLI config (model: / data: / trainer: / memplan:)")
    p.add_argument("--batch-size", type=int, default=None, help="micro-batch size per device (default: the "
                   "plan's, else the config's data batch size)")
    p.add_argument("--plan", default=None, help="a plan file from memplan suggest --output (*.plan.json): "
                   "its micro-batch, precision and checkpointing")
    p.add_argument("--precision", default=None, help="Lightning precision string (default: the plan's, "
                   "else the config's trainer.precision, else 32-true)")
    p.add_argument("--checkpointing", action="store_true", help="checkpoint each repeated block")
    p.add_argument("--steps", type=int, default=2, help="real training steps to run (default 2)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON (bytes as ints)")
    p.set_defaults(run=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    import torch

    from memplan.estimator.calibration import calibration_path, save_calibration
    from memplan.config import load_config
    from memplan.plan import Plan
    from memplan.commands.validate import (Setting, calibration_from, compare, estimate_for, measure_in_subprocess,
                                  report_lines)

    if args.plan and args.batch_size is not None:
        return _usage_error("pass --batch-size or --plan, not both")
    try:
        loaded = load_config(args.config)
        plan = Plan.from_dict(json.loads(open(args.plan).read())) if args.plan else None
        batch_size = plan.micro_batch_size if plan else args.batch_size or loaded.data_batch_size
        if batch_size is None:
            return _usage_error("the config has no data batch size; pass --batch-size N or --plan FILE")
        setting = Setting(
            config=args.config, batch_size=batch_size, steps=args.steps,
            precision=args.precision or (plan.precision if plan else None) or loaded.trainer_precision or "32-true",
            checkpointing=args.checkpointing or bool(plan and plan.gradient_checkpointing),
        )
        device = "cuda" if torch.cuda.is_available() else "cpu"
        est = estimate_for(loaded, setting, device)
    except (OSError, ValueError) as err:  # ConfigError and EstimateError are ValueErrors naming the field
        return _usage_error(str(err))
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
                          "within_goal": not failed,
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
    from torch._subclasses.fake_tensor import FakeTensorMode

    import memplan
    from memplan.demos import DEMOS

    if args.demo not in DEMOS:
        raise ValueError(f"--demo must be one of {', '.join(DEMOS)}; got {args.demo!r}")
    with FakeTensorMode():
        model = DEMOS[args.demo]()  # born fake: no weight allocated
    return memplan.estimate(model, model.example_batch(args.batch_size), optimizer=args.optimizer,
                            precision=args.precision or "32-true", **options)


def _estimate_config(args: argparse.Namespace, options: dict):
    from memplan.config import load_config

    loaded = load_config(args.config)
    precision = args.precision or loaded.trainer_precision or "32-true"
    optimizer = args.optimizer or loaded.optimizer
    return loaded.estimate(args.batch_size, precision=precision, optimizer=optimizer, **options)


def _add_suggest(sub) -> None:
    p = sub.add_parser("suggest", help="plan micro-batch, GPUs, precision and checkpointing for a config")
    p.add_argument("config", help="a LightningCLI config (model: / data: / trainer: / memplan:)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs per node to use (default: all visible / 1 named)")
    p.add_argument("--gpu", default=None, help="plan for this GPU model instead of the local ones (e.g. H100-80GB)")
    p.add_argument("--gpu-memory", default=None, help="plan for a GPU of this much memory (e.g. 24GiB)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--global-batch-size", type=int, default=None, help="samples per optimizer step over all GPUs")
    p.add_argument("--precision", action="append", default=None,
                   help="allowed precision (repeatable; default: memplan.precisions)")
    p.add_argument("--no-checkpointing", action="store_true", help="never turn on gradient checkpointing")
    p.add_argument("--margin", type=float, default=None, help="fraction of each GPU's free memory left unused")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes as ints)")
    p.add_argument("--output", default=None, help="write the planned config here (and the plan beside it)")
    p.set_defaults(run=cmd_suggest)


def cmd_suggest(args: argparse.Namespace) -> int:
    from memplan.config import load_config
    from memplan.planner import NoFit
    from memplan.commands.suggest import plan_config, resolve_hardware

    if args.nodes < 1:
        return _usage_error(f"--nodes must be a positive integer; got {args.nodes}")
    try:
        loaded = load_config(args.config)
        hardware = resolve_hardware(gpus=args.gpus, gpu=args.gpu, gpu_memory=args.gpu_memory)
        plan = plan_config(
            loaded, hardware, nodes=args.nodes, global_batch_size=args.global_batch_size,
            precisions=tuple(args.precision) if args.precision else None,
            allow_checkpointing=False if args.no_checkpointing else None, margin=args.margin,
        )
    except NoFit as err:
        print(f"memplan: {err}", file=sys.stderr)
        return EXIT_ERROR
    except ValueError as err:
        return _usage_error(str(err))
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        from rich.console import Console

        from memplan.commands.suggest import render_plan

        Console().print(render_plan(plan))
    if args.output:
        _write_output(loaded, plan, args.output, stream=sys.stderr if args.json else sys.stdout)
    return EXIT_OK


def _write_output(loaded, plan, output: str, *, stream) -> None:
    """Write the planned config and plan file; say so on `stream` (stderr under --json, so stdout stays JSON)."""
    from memplan.config import plan_path_for, planner_callback, torchrun_command, write_planned_config

    callback = planner_callback(plan_path_for(output)) if _callback_available() else None
    write_planned_config(loaded, plan, output, callback=callback)
    print(f"wrote {output} and {plan_path_for(output)}", file=stream)
    print("launch with: " + " ".join(torchrun_command(plan, output)), file=stream)


def _callback_available() -> bool:
    import memplan

    return hasattr(memplan, "MemoryPlanner")


def _usage_error(message: str) -> int:
    print(f"memplan: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memplan", description="Memory planning for PyTorch Lightning training.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_estimate(sub)
    _add_suggest(sub)
    _add_devices(sub)
    _add_report(sub)
    _add_watch(sub)
    _add_validate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
