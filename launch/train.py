"""LightningCLI entry point for memplan-planned configs.

    torchrun --nproc-per-node=4 --nnodes=1 --standalone launch/train.py fit --config planned.yaml

The same as `python -m pytorch_lightning.cli`-style training scripts, except that it accepts (and
ignores) a config's `memplan:` section, so a config can be planned and trained from one file. The plan
itself reaches the Trainer through the MemoryPlanner callback entry that `memplan suggest --output` writes.

SIGTERM to any one rank ends the whole job (memplan.callback.sigterm): the rank exits at once with
status 143 and torchrun stops the others, where Lightning's own handler would wait in a broadcast.
"""
from __future__ import annotations

import torch.distributed as dist
from pytorch_lightning.cli import LightningCLI

from memplan.callback.sigterm import end_rank_on_sigterm
from memplan.config import add_memplan_argument


class MemplanCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        add_memplan_argument(parser)

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        end_rank_on_sigterm(trainer)
        return trainer


def main(args: list[str] | None = None) -> None:
    MemplanCLI(subclass_mode_model=True, subclass_mode_data=True, save_config_kwargs={"overwrite": True}, args=args)
    close_process_group()


def close_process_group() -> None:
    """After a successful run, destroy the process group while the interpreter is whole: left to
    interpreter shutdown, gloo's worker threads can abort the process ("terminate called without an
    active exception", pytorch/pytorch#190489) and turn a finished run into a failed exit code. Not
    on error: destroying while other ranks are in a collective deadlocks (as torchtitan does it)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
