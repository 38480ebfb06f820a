"""`memplan estimate`: peak memory of one training step for a config or a bundled model, as a table or JSON.

Nothing here imports torch at import time (`memplan --help` stays fast); `run` loads it.
"""
from __future__ import annotations

import argparse
import json

from memplan.commands import args as arg
from memplan.plan import MAX_BATCH_SIZE, MAX_WORLD_SIZE


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("estimate", help="peak memory of one training step, as a breakdown table")
    p.add_argument("config", nargs="?", help="a LightningCLI config (model: / data: / trainer:)")
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
    p.add_argument("--deterministic", type=arg.deterministic("--deterministic"), default=None,
                   help="whether the step runs with deterministic algorithms, as Lightning's "
                        "Trainer(deterministic=...): true, false or warn (warn-only) (default: the config's "
                        "trainer.deterministic, else false)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON (bytes as ints)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if (args.config is None) == (args.demo is None):
        return arg.usage_error("pass a config file or --demo NAME (one of them)")
    options = dict(checkpointing=args.checkpointing, device=args.device,
                   strategy="ddp" if args.ddp else None, world_size=args.ddp or 1, loop=args.loop,
                   data_dependent=args.data_dependent, deterministic=args.deterministic)
    from memplan.estimator.errors import NoRepeatedBlocks

    try:
        est = _estimate_config(args, options) if args.config else _estimate_demo(args, options)
    except NoRepeatedBlocks as err:
        if not args.checkpointing:  # (a config's own checkpointing setting: its message names it)
            return arg.usage_error(str(err))
        return arg.usage_error("--checkpointing: the model has no repeated blocks (an nn.ModuleList or nn.Sequential "
                               "of >= 2 modules of one class) to checkpoint; drop --checkpointing")
    except ValueError as err:  # EstimateError and ConfigError are ValueErrors naming the field
        return arg.usage_error(str(err))
    import dataclasses

    est = dataclasses.replace(est, notes=tuple(_in_our_words(n) for n in est.notes))
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        from memplan.commands.output import console as output_console

        output_console().print(est)
    return arg.EXIT_OK


def _in_our_words(note: str) -> str:
    """An estimator note as this command words it, rendered from its code and fields: the generic-GPU note names
    --device where memplan.estimate's names its device= argument."""
    from memplan.estimator.notes import GENERIC_GPU, generic_gpu_note

    if getattr(note, "code", "") == GENERIC_GPU:
        return generic_gpu_note(**note.fields, choose="pass --device H100-80GB (or another GPU)")
    return note


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
    from memplan.hardware.catalog import UnknownGpu, custom_gpu, lookup_gpu
    from memplan.units import parse_size

    try:
        return lookup_gpu(text)
    except UnknownGpu as err:
        if err.boards:  # a family name (A100, V100): name the boards, as --gpu does
            raise argparse.ArgumentTypeError(err.what) from None
    try:
        return custom_gpu(parse_size(text))
    except ValueError:
        from memplan.hardware.catalog import known_gpu_names

        raise argparse.ArgumentTypeError(
            f"must be 'cpu', 'cuda' (this machine's GPU), a GPU memplan knows ({', '.join(known_gpu_names())}) or "
            f"a GPU's memory with its unit, e.g. 24GiB; got {text!r}") from None


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
    from memplan.commands.loading import load_config_for_command

    loaded = load_config_for_command(args.config)
    precision = args.precision or loaded.trainer_precision or "32-true"
    if options["deterministic"] is None:
        options = dict(options, deterministic=loaded.trainer_deterministic)
    optimizer = args.optimizer or loaded.optimizer
    _check_batch_memory(loaded.example_batch(1), args.batch_size)
    return loaded.estimate(args.batch_size, precision=precision, optimizer=optimizer, **options)


def _check_batch_memory(one_sample, batch_size: int) -> None:
    """--batch-size whose batch (built for real in host memory, to trace the step on it) would not fit here."""
    from memplan.batching import tensor_bytes
    from memplan.hardware import host_info
    from memplan.units import format_bytes

    sample = tensor_bytes(one_sample)
    available = host_info().available_bytes
    if sample * batch_size > available // 2:
        raise arg.UsageError(
            f"--batch-size {batch_size}: the batch alone is {format_bytes(sample * batch_size)} ({format_bytes(sample)} "
            f"a sample), over half the {format_bytes(available)} of host memory available; memplan builds one batch "
            "in host memory to trace the step: use a smaller --batch-size")
