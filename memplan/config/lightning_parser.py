"""The last check of a config: Lightning's own LightningArgumentParser, built as LightningCLI builds its
`fit` parser, parses it (jsonargparse: every class_path imported, every init_args key and type checked
against the signatures, trainer.callbacks, trainer.logger and lr_scheduler included), nothing instantiated.
What it refuses, LightningCLI would refuse at launch: memplan refuses it first, in one line naming the key.

memplan's own checks (memplan.config.load) run before it and name the common mistakes with their fix
(a misspelt init_arg with did-you-mean, a strategy memplan does not plan); this parser is the authority
for the rest, so `memplan suggest` never plans a config its launch would refuse.
"""
from __future__ import annotations

import copy
import functools
import importlib
import re
from collections.abc import Mapping
from typing import Any, Optional, Union

from memplan.config.errors import ConfigError

FIT_SKIPS = {"model", "train_dataloaders", "val_dataloaders", "datamodule"}
"""Trainer.fit's arguments LightningCLI's fit takes from its sections, not from the config (its subcommands())."""
_NOISE = re.compile(r"^(Subtypes:|Given value|Errors:|Does not validate against any of the Union subtypes|"
                    r"- Expected a <class 'NoneType'>|Expected a <class 'NoneType'>)")


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


def check_with_lightning(raw: Mapping[str, Any], package: str) -> None:
    """Parse the config (its `config:` key aside) as LightningCLI's fit would; a ConfigError naming the key
    it refuses, with the parser's reason, in one line."""
    from jsonargparse import ArgumentError

    config = copy.deepcopy({key: value for key, value in raw.items() if key != "config"})  # (parse_object edits it)
    try:
        fit_parser(package).parse_object(config)
    except ArgumentError as err:
        key, reason = refusal(str(err), raw)
        raise ConfigError(key, f"{key or 'the config'}: LightningCLI would refuse this config at launch ({reason}); "
                          f"fix {key or 'it'}") from None


def refusal(message: str, raw: Mapping[str, Any]) -> tuple[str, str]:
    """(the YAML key, the reason in one line) from a jsonargparse error message: the key it names, made
    exact where the config tells (the list index of the class_path at fault, the init_arg holding the
    value refused), and the first reason under it (a Union's other alternatives left out)."""
    found = re.search(r'(?:Parser key|Key) "([^"]+)"', message)
    key = found.group(1) if found else ""
    lines = [line.strip().lstrip("- ").strip() for line in message.splitlines()]
    lines = [text for text in lines if text and not _NOISE.match(text) and not text.startswith(("Parser key", "Key \""))]
    problem = next((i for i, text in enumerate(lines) if text.startswith("Problem with given class_path")), None)
    reason = lines[problem + 1] if problem is not None and problem + 1 < len(lines) else (lines[0] if lines else "")
    section = _lookup(raw, key)
    if problem is not None:
        class_path = re.search(r"class_path '([^']+)'", lines[problem]).group(1)
        if isinstance(section, list):  # which entry: trainer.callbacks[i]
            index = [i for i, entry in enumerate(section) if isinstance(entry, Mapping)
                     and class_path.endswith(str(entry.get("class_path", "")).lstrip("."))]
            if len(index) == 1:
                key, section = f"{key}[{index[0]}]", section[index[0]]
        reason = f"{class_path}: {reason}"
        named = re.search(r"Option '([^'.]+)' is not accepted", reason)
        init_args = section.get("init_args") if isinstance(section, Mapping) else None
        got = re.search(r"Got value: (.*)$", reason)
        if named:
            key = f"{key}.init_args.{named.group(1)}"
        elif got and isinstance(init_args, Mapping):
            holding = [name for name, value in init_args.items() if str(value) == got.group(1)]
            if len(holding) == 1:
                key = f"{key}.init_args.{holding[0]}"
    return key, reason or message.replace("\n", " ")


def _lookup(raw: Mapping[str, Any], key: str) -> Any:
    node: Any = raw
    for part in key.split(".") if key else []:
        node = node.get(part) if isinstance(node, Mapping) else None
    return node
