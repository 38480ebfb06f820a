"""`memplan suggest`: plan micro-batch, GPUs, precision and checkpointing for a config, as a table or JSON,
and write the planned config with --output (the planning itself: memplan.commands.planning).

Nothing here imports torch at import time (`memplan suggest --help` stays fast); `run` loads it.
"""
from __future__ import annotations

import argparse
import json
import sys

from memplan.commands import args as arg
from memplan.plan import MAX_BATCH_SIZE, MAX_GPUS_PER_NODE, MAX_NODES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("suggest", help="plan micro-batch, GPUs, precision and checkpointing for a config")
    p.add_argument("config", help="a LightningCLI config (model: / data: / trainer:; memplan's settings in the "
                   "MemoryPlanner entry of trainer.callbacks)")
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
                   "(default: MemoryPlanner's global_batch_size in the config, else the config's own)")
    p.add_argument("--precision", type=arg.precision("--precision"), action="append", default=None,
                   help="allowed precision: bf16-mixed, 16-mixed, 32-true or an alias (bf16, 16, 32); "
                        "repeatable (default: MemoryPlanner's suggest.precisions in the config)")
    p.add_argument("--no-checkpointing", action="store_true", help="never turn on gradient checkpointing")
    p.add_argument("--margin", type=arg.fraction("--margin", "of each GPU's free memory left unused"), default=None,
                   help="fraction of each GPU's free memory left unused, in [0, 1) (default: MemoryPlanner's plan_margin in "
                        "the config, else twice its margin: 0.10)")
    p.add_argument("--deterministic", type=arg.deterministic("--deterministic"), default=None,
                   help="whether training runs with deterministic algorithms, as Lightning's "
                        "Trainer(deterministic=...): true, false or warn (warn-only) (default: the config's "
                        "trainer.deterministic, else false)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes as ints); no progress line")
    p.add_argument("--output", default=None, help="write the planned config here and the plan beside it "
                   "(<name>.plan.json); refuses to replace existing files without --force")
    p.add_argument("--force", action="store_true", help="replace the --output config and plan file if they exist")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memplan.commands.output import check_output, write_output
    from memplan.commands.progress import Progress

    if args.gpu is not None and args.gpu_memory is not None:
        return arg.usage_error("--gpu and --gpu-memory name the same thing; pass one of them")
    progress = Progress(enabled=None if not args.json else False)
    progress.say(f"loading {args.config}")
    from memplan.commands.loading import load_config_for_command

    try:  # a config refused by memplan's own checks (YAML, settings) imports no torch: no seconds for a refusal
        if args.output is not None:
            check_output(args.output, args.config, force=args.force)
        loaded = load_config_for_command(args.config, before_print=progress.clear)
    finally:
        progress.clear()  # a refusal prints on a clean line; planning says what it does next
    from memplan.commands.planning import plan_config, resolve_hardware, with_deterministic  # torch: seconds, with the line shown
    from memplan.planner import NoFit

    try:
        hardware = resolve_hardware(gpus=args.gpus, gpu=args.gpu, gpu_memory=args.gpu_memory)
        for note in hardware.notes:
            progress.clear()
            print(f"memplan: note: {note}", file=sys.stderr)
        loaded = with_deterministic(loaded, args.deterministic)  # the plan and the planned config (--output) alike
        plan = plan_config(
            loaded, hardware, nodes=args.nodes, global_batch_size=args.global_batch_size,
            precisions=tuple(dict.fromkeys(args.precision)) if args.precision else None,
            allow_checkpointing=False if args.no_checkpointing else None, margin=args.margin, progress=progress,
        )
    except NoFit as err:
        print(f"memplan: {err}", file=sys.stderr)
        return arg.EXIT_ERROR
    finally:
        progress.clear()  # the result, or the error, prints on a clean line
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        if args.gpus is not None and plan.gpus_per_node < args.gpus:  # said in the table otherwise; never silent
            from memplan.planner.reasons import GPUS_USED

            why = next((r for r in plan.reasons if getattr(r, "code", None) == GPUS_USED), "")
            print(f"memplan: note: the plan uses {plan.gpus_per_node} of the {args.gpus} GPUs per node --gpus gives. "
                  f"{why}", file=sys.stderr)
    else:
        from memplan.commands.output import console as output_console

        from memplan.commands.plan_table import render_plan

        output_console().print(render_plan(plan, loaded))
    if args.output:
        write_output(loaded, plan, args.output, force=args.force, stream=sys.stderr if args.json else sys.stdout)
    return arg.EXIT_OK
