"""A config as LightningCLI reads it: Lightning's own LightningArgumentParser, built as LightningCLI builds its
`fit` parser, parses it (jsonargparse: every class_path imported, every init_args key and type checked against
the signatures, trainer.callbacks, trainer.logger and lr_scheduler included), nothing instantiated. What it
refuses, LightningCLI would refuse at launch: memplan refuses it first, in one line naming the key
(memplan.config.refusal). It is the one authority on classes and their arguments; memplan's own checks
(memplan.config.load) are of what only memplan needs: its settings, device and node counts, a strategy and
accelerator it can plan.

The parsed namespace is what memplan builds from: the model (under fake tensors) and the datamodule are
instantiated by the same parser, nested class_path values in their init_args (a backbone) included, as
LightningCLI instantiates them; the optimizer by Lightning's instantiate_class, as LightningCLI calls it.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Optional, Union

FIT_SKIPS = {"model", "train_dataloaders", "val_dataloaders", "datamodule"}
"""Trainer.fit's arguments LightningCLI's fit takes from its sections, not from the config (its subcommands())."""


@functools.cache
def fit_parser(package: str) -> Any:
    """LightningCLI's `fit` parser of `package` ('lightning.pytorch' or 'pytorch_lightning'), as LightningCLI
    builds it with subclass_mode_model and subclass_mode_data (memplan.train's), plus memplan.train's
    deprecated `memplan:` argument."""
    from torch.optim import Optimizer

    cli = importlib.import_module(f"{package}.cli")
    pl = importlib.import_module(package)
    parser = cli.LightningArgumentParser(exit_on_error=False)
    parser.add_argument("--seed_everything", type=Union[bool, int], default=True)  # noqa: UP007 (read at runtime)
    parser.add_lightning_class_args(pl.Trainer, "trainer")
    parser.add_lightning_class_args(pl.LightningModule, "model", subclass_mode=True)
    parser.add_lightning_class_args(pl.LightningDataModule, "data", subclass_mode=True, required=False)
    parser.add_argument("--memplan", type=Optional[dict[str, Any]], default=None)  # noqa: UP045
    parser.add_optimizer_args((Optimizer,))
    parser.add_lr_scheduler_args(cli.LRSchedulerTypeTuple)
    parser.add_method_arguments(pl.Trainer, "fit", skip=set(FIT_SKIPS))
    return parser


def parse_config(raw: Mapping[str, Any], package: str) -> Any:
    """The config (its `config:` key aside) parsed as LightningCLI's fit parses it: a jsonargparse Namespace
    with every default filled in. What the parser refuses is a ConfigError naming the key, in one line."""
    from jsonargparse import ArgumentError

    from memplan.config.refusal import refused

    config = copy.deepcopy({key: value for key, value in raw.items() if key != "config"})  # (parse_object edits it)
    try:
        with cwd_on_path():
            return fit_parser(package).parse_object(config)
    except ArgumentError as err:
        raise refused(str(err), raw, package) from None


def instantiate(cls: type, section: Any) -> Any:
    """The parsed section (a Namespace with class_path and init_args) instantiated as LightningCLI instantiates
    it: its init_args by the parser (nested class_path values, a backbone, built innermost first), then
    cls(**init_args), called here so that what the class raises reaches the caller unchanged (the parser
    would fold it into a Union's message)."""
    from jsonargparse import Namespace

    with cwd_on_path():
        built = _init_args_parser(cls).instantiate(Namespace(init_args=section.get("init_args") or Namespace()))
    kwargs = {name: value for name, value in vars(built.init_args).items() if not name.startswith("__")}
    return cls(**kwargs, **(section.get("dict_kwargs") or {}))


@functools.cache
def _init_args_parser(cls: type) -> Any:
    """A parser of cls's arguments alone (nested under `init_args`, the class itself not instantiated)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "init_args", fail_untyped=False, instantiate=False)
    return parser


def instantiate_with(package: str, args: tuple[Any, ...], section: Any) -> Any:
    """The parsed `optimizer`/`lr_scheduler` section on `args`, by Lightning's instantiate_class, as LightningCLI
    builds them for configure_optimizers (nested values stay as parsed)."""
    cli = importlib.import_module(f"{package}.cli")
    return cli.instantiate_class(args, section.as_dict())


def package_of(class_path: Any) -> str:
    """The Lightning package the model's class_path is written for: 'lightning.pytorch' where it imports and
    derives from lightning.pytorch's LightningModule, else 'pytorch_lightning' (the parser then says what is
    wrong with the class_path)."""
    module_name, _, name = str(class_path).rpartition(".")
    try:
        with cwd_on_path():
            cls = getattr(importlib.import_module(module_name), name, None) if module_name else None
    except ImportError:
        cls = None
    if isinstance(cls, type) and any(c.__module__.startswith("lightning.pytorch") for c in cls.__mro__):
        return "lightning.pytorch"
    return "pytorch_lightning"


@contextlib.contextmanager
def cwd_on_path() -> Iterator[None]:
    """The working directory on sys.path: `python train.py` imports the user's modules from the directory it
    runs in, and memplan does the same."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
