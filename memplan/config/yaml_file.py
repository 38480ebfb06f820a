"""Read the config file as LightningCLI reads it, with jsonargparse's own YAML loader (`1e-3` is a float, not
the string YAML 1.1 makes it; dates stay strings), bounded in size, and merge overrides (nested or dotted
keys) over it."""
from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from memplan.config.errors import ConfigError
from memplan.files import CONFIG_MAX_BYTES, FileTooLarge, NotAFile, read_bounded


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = read_bounded(path, limit_bytes=CONFIG_MAX_BYTES, name="config file").decode("utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"config file {path} does not exist; pass the YAML you give "
                          "LightningCLI's --config") from None
    except (NotAFile, FileTooLarge) as err:
        raise ConfigError("", str(err)) from None
    except OSError as err:
        raise ConfigError("", f"cannot read config file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError("", f"config file {path} is not UTF-8 text (byte {err.start}); pass the YAML you give "
                          "LightningCLI's --config") from None
    from jsonargparse import get_loader

    try:
        data = get_loader("yaml")(text)  # the loader LightningCLI's parser reads --config with
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = err.problem or "invalid YAML"
        if err.context and err.context_mark and err.context_mark is not mark:
            what = f"{what} ({err.context} started at line {err.context_mark.line + 1})"
        line = f"line {mark.line + 1}" if mark else "the line shown"
        raise ConfigError("", f"{where}: YAML syntax error at {line}: {what}") from None
    except yaml.YAMLError as err:
        raise ConfigError("", f"{path}: YAML error: {err}") from None
    if isinstance(data, str) and isinstance(yaml.safe_load(text), dict):  # jsonargparse reads `model:` alone so
        raise ConfigError("", f"{path} holds only a key without a value ({data.strip()}), which LightningCLI reads as "
                          "a string, not a config; give it its value, e.g. model: {class_path: ..., init_args: {...}}")
    if not isinstance(data, dict):
        raise ConfigError("", f"{path} must hold a YAML mapping (model:, data:, trainer:); got "
                          f"{'an empty file' if data is None else type(data).__name__}")
    return data


def expand_dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        *parents, leaf = str(key).split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = expand_dotted(value) if isinstance(value, Mapping) else value
    return out


def merge_overrides(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_overrides(dict(merged[key]), value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged
