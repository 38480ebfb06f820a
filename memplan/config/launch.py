"""What a launch needs from a config: the torchrun command, and (for old configs) a LightningCLI that accepts
the deprecated top-level `memplan:` section."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from memplan.plan import Plan


TRAIN_MODULE = "memplan.train"
"""The LightningCLI entry point, shipped in the package: any install of memplan has it."""


def torchrun_command(plan: Plan, config_path: str | Path, *, entry_point: str | Path | None = None,
                     rdzv_endpoint: str = "$MASTER_ADDR:29500", python: str | Path | None = None) -> list[str]:
    """argv that runs the planned config: `PYTHON -m torch.distributed.run --nproc-per-node=G --nnodes=N ...
    -m memplan.train fit --config PATH`, from any working directory and without an activated environment:
    PYTHON is this interpreter (`python`, default sys.executable), where torch and memplan are installed (a
    bare `torchrun` is not on PATH outside an activated venv), and PATH is absolute. `entry_point`: a
    training script to run instead of memplan.train (made absolute).

    One node uses torchrun's standalone rendezvous. Several nodes rendezvous at `rdzv_endpoint` (the
    first node's host:port; the default leaves $MASTER_ADDR for the shell, so print it with ' '.join,
    not shlex.join), and the same command runs on every node.
    """
    argv = [str(python or sys.executable), "-m", "torch.distributed.run", f"--nproc-per-node={plan.gpus_per_node}",
            f"--nnodes={plan.nodes}"]
    if plan.nodes == 1:
        argv.append("--standalone")
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    entry = ["-m", TRAIN_MODULE] if entry_point is None else [str(Path(entry_point).absolute())]
    return [*argv, *entry, "fit", "--config", str(Path(config_path).absolute())]


def add_memplan_argument(parser: Any) -> None:
    """Let a LightningCLI parser accept (and ignore) an old config's top-level `memplan:` section, which
    memplan reads until memplan.config.placement.REMOVED_IN (new configs keep memplan's settings in the
    MemoryPlanner callback's init_args, which any LightningCLI accepts):

        class CLI(LightningCLI):
            def add_arguments_to_parser(self, parser):
                add_memplan_argument(parser)

    Plain LightningCLI refuses keys it does not know ("Option 'memplan.global_batch_size' is not accepted").
    """
    # jsonargparse reads the annotation at runtime, so it must be a typing object, not a string.
    parser.add_argument("--memplan", type=Optional[dict[str, Any]], default=None,  # noqa: UP045
                        help="memplan's planning settings; training ignores them")
