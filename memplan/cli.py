"""The memplan command line. Each subcommand is a small function; main() returns the exit code."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _add_estimate(sub) -> None:
    p = sub.add_parser("estimate", help="peak memory of one training step, as a breakdown table")
    p.add_argument("--demo", required=True, help="a bundled model: mlp, cnn, resnet, gpt2-small")
    p.add_argument("--batch-size", type=int, required=True, help="micro-batch size per GPU")
    p.add_argument("--precision", default="32-true", help="Lightning precision string (default 32-true)")
    p.add_argument("--checkpointing", action="store_true", help="checkpoint each repeated block")
    p.add_argument("--optimizer", default=None, help="sgd, sgd-momentum, adam, adamw, rmsprop, adagrad "
                   "(default: the model's configure_optimizers)")
    p.add_argument("--device", default=None, help="'cpu', or a GPU model such as A100-80GB (default: the local GPU)")
    p.add_argument("--ddp", type=int, default=None, metavar="WORLD_SIZE", help="estimate a DDP rank of this world size")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON (bytes as ints)")
    p.set_defaults(run=cmd_estimate)


def cmd_estimate(args: argparse.Namespace) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    import memplan
    from memplan.demos import DEMOS

    if args.demo not in DEMOS:
        return _usage_error(f"--demo must be one of {', '.join(DEMOS)}; got {args.demo!r}")
    if args.batch_size < 1:
        return _usage_error(f"--batch-size must be a positive integer; got {args.batch_size}")
    with FakeTensorMode():
        model = DEMOS[args.demo]()  # born fake: no weight allocated
    batch = model.example_batch(args.batch_size)
    try:
        est = memplan.estimate(
            model, batch, optimizer=args.optimizer, precision=args.precision,
            checkpointing=args.checkpointing, device=args.device,
            strategy="ddp" if args.ddp else None, world_size=args.ddp or 1,
        )
    except ValueError as err:
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
    from memplan.hardware import devices_dict, devices_table, host_info, visible_gpus

    gpus, host = visible_gpus(), host_info()
    if args.json:
        print(json.dumps(devices_dict(gpus, host), indent=2))
    else:
        from rich.console import Console

        Console().print(devices_table(gpus, host))
    return EXIT_OK


def _usage_error(message: str) -> int:
    print(f"memplan: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memplan", description="Memory planning for PyTorch Lightning training.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_estimate(sub)
    _add_devices(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
