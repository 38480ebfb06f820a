"""What a launch needs from a config: the torchrun command, and a LightningCLI that accepts `memplan:`."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from memplan.plan import Plan


TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "train.py"
"""This checkout's launch/train.py, by absolute path (scripts/install.py installs memplan editable)."""


def torchrun_command(plan: Plan, config_path: str | Path, *, entry_point: str | Path = TRAIN_SCRIPT,
                     rdzv_endpoint: str = "$MASTER_ADDR:29500") -> list[str]:
    """argv that runs the planned config: `torchrun --nproc-per-node=G --nnodes=N ... ENTRY fit --config PATH`,
    from any working directory: ENTRY and PATH are made absolute (relative ones against the current one).

    One node uses torchrun's standalone rendezvous. Several nodes rendezvous at `rdzv_endpoint` (the
    first node's host:port; the default leaves $MASTER_ADDR for the shell, so print it with ' '.join,
    not shlex.join), and the same command runs on every node.
    """
    argv = ["torchrun", f"--nproc-per-node={plan.gpus_per_node}", f"--nnodes={plan.nodes}"]
    if plan.nodes == 1:
        argv.append("--standalone")
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    return [*argv, str(Path(entry_point).absolute()), "fit", "--config", str(Path(config_path).absolute())]


def add_memplan_argument(parser: Any) -> None:
    """Let a LightningCLI parser accept (and ignore) a config's `memplan:` section:

        class CLI(LightningCLI):
            def add_arguments_to_parser(self, parser):
                add_memplan_argument(parser)

    Plain LightningCLI refuses keys it does not know ("Option 'memplan.global_batch_size' is not accepted").
    """
    # jsonargparse reads the annotation at runtime, so it must be a typing object, not a string.
    parser.add_argument("--memplan", type=Optional[dict[str, Any]], default=None,  # noqa: UP045
                        help="memplan's planning settings; training ignores them")
