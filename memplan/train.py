"""LightningCLI entry point for memplan-planned configs, shipped in the package (any install has it):

    python -m torch.distributed.run --nproc-per-node=4 --nnodes=1 --standalone -m memplan.train fit --config planned.yaml

The same as a LightningCLI training script, except that it still accepts (and ignores) an old config's
top-level `memplan:` section (deprecated: memplan's settings now live in the MemoryPlanner callback's
init_args, which any LightningCLI accepts). The plan itself reaches the Trainer through
the MemoryPlanner callback entry that `memplan suggest --output` writes. It runs LightningModules of either
Lightning package: the CLI of the package the config's model class comes from (`lightning.pytorch` or
`pytorch_lightning`; LightningCLI refuses the other one's classes).

SIGTERM to any one rank ends the whole job (memplan.callback.sigterm): the rank exits at once with
status 143 and torchrun stops the others, where Lightning's own handler would wait in a broadcast.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from memplan.callback.sigterm import end_rank_on_sigterm
from memplan.config import add_memplan_argument


def cli_class(package: str) -> type:
    """memplan's LightningCLI of `package` ('pytorch_lightning' or 'lightning.pytorch')."""
    base = importlib.import_module(f"{package}.cli").LightningCLI

    class MemplanCLI(base):
        def add_arguments_to_parser(self, parser) -> None:
            add_memplan_argument(parser)

        def instantiate_trainer(self, **kwargs):
            trainer = super().instantiate_trainer(**kwargs)
            end_rank_on_sigterm(trainer)
            return trainer

    return MemplanCLI


def lightning_package(args: list[str]) -> str:
    """The Lightning package whose LightningModule the model class named in `args` (a --model option, or the
    model.class_path of a --config file) subclasses: 'lightning.pytorch' for one of it, else 'pytorch_lightning'
    (also where the class cannot be found here: LightningCLI then names the problem itself)."""
    class_path = _model_class_path(args)
    if class_path is None or "." not in class_path or importlib.util.find_spec("lightning") is None:
        return "pytorch_lightning"
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
        from lightning.pytorch import LightningModule
    except Exception:  # (ImportError, AttributeError, or the user's module failing): LightningCLI reports it
        return "pytorch_lightning"
    return "lightning.pytorch" if isinstance(cls, type) and issubclass(cls, LightningModule) else "pytorch_lightning"


def _model_class_path(args: list[str]) -> str | None:
    """The model's class path as the command line gives it (the last word wins, as in LightningCLI)."""
    found = None
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if not eq and i + 1 < len(args):
            value = args[i + 1]
        if key in ("--model", "--model.class_path"):
            found = value
        elif key in ("--config", "-c"):
            found = _class_path_in(Path(value)) or found
    return found


def _class_path_in(config: Path) -> str | None:
    try:
        import yaml

        model = (yaml.safe_load(config.read_text()) or {}).get("model")
    except Exception:  # an unreadable config: LightningCLI says why
        return None
    if isinstance(model, str):
        return model
    return model.get("class_path") if isinstance(model, dict) else None


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    cli: Any = cli_class(lightning_package(argv))
    cli(subclass_mode_model=True, subclass_mode_data=True, save_config_kwargs={"overwrite": True}, args=args)
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
