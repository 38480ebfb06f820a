"""Where memplan's settings live in a config: in the MemoryPlanner callback's init_args under
trainer.callbacks, where a plain LightningCLI accepts them, or (deprecated, read until memplan
REMOVED_IN) in a top-level `memplan:` section, which a plain LightningCLI refuses.

    trainer:
      callbacks:
        - class_path: memplan.MemoryPlanner
          init_args:
            global_batch_size: 512        # the callback's own arguments: it plans with them at fit start too
            allow_checkpointing: true
            plan_margin: 0.10             # the old memplan.margin
            suggest:                      # what only `memplan suggest` reads (training ignores it)
              precisions: [bf16-mixed, 16-mixed]
              batch_spec: {input: {shape: [1024], dtype: int64, high: 50257}}

Each old `memplan:` key has one place: global_batch_size and allow_checkpointing are MemoryPlanner
arguments of the same name and meaning; margin (the memory a plan leaves free) is MemoryPlanner's
plan_margin (its `margin` is the free memory under which a running fit lowers the micro-batch, and it
plans with plan_margin, default twice margin); precisions, batch_spec, optimizer, num_workers,
prefetch_factor and pin_memory tell `memplan suggest` what the callback sees for itself at fit start
(the Trainer's precision, the loaded batch, the optimizer, the DataLoader), so they go under its
`suggest:` argument.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from memplan.config.errors import ConfigError, did_you_mean
from memplan.config.settings import MemplanSettings

PLANNER_CLASS_PATHS = ("memplan.MemoryPlanner", "memplan.callback.MemoryPlanner",
                       "memplan.callback.memory_planner.MemoryPlanner")
"""The class_path spellings of the MemoryPlanner callback whose init_args memplan reads."""
CALLBACK_SETTINGS = ("global_batch_size", "allow_checkpointing")
"""memplan settings that are MemoryPlanner arguments of the same name and meaning."""
SUGGEST_SETTINGS = ("precisions", "batch_spec", "optimizer", "num_workers", "prefetch_factor", "pin_memory")
"""memplan settings only `memplan suggest` reads: under MemoryPlanner's `suggest:` argument."""
DEFAULT_CALLBACK_MARGIN = 0.05
"""MemoryPlanner's own default `margin` (memplan.callback.settings), for plan_margin's default."""
REMOVED_IN = "0.3"
"""The memplan release that stops reading a top-level `memplan:` section."""
UNPLACED = "trainer.callbacks[MemoryPlanner].init_args"
"""How messages name the place of a setting the config does not have yet: the init_args of a MemoryPlanner
entry in trainer.callbacks."""


class SettingsDeprecation(FutureWarning):
    """The config keeps memplan's settings where memplan will stop reading them; the message says how to move them."""


def settings_keys(prefix: str) -> dict[str, str]:
    """Each memplan setting's YAML key path, in the MemoryPlanner entry whose init_args are at `prefix`."""
    keys = {name: f"{prefix}.{name}" for name in CALLBACK_SETTINGS}
    keys.update({name: f"{prefix}.suggest.{name}" for name in SUGGEST_SETTINGS})
    keys["margin"] = f"{prefix}.plan_margin"
    return keys


def plan_margin_for(margin: float) -> float:
    """The memory a plan leaves free where only MemoryPlanner's `margin` is given: twice it, at most 0.5,
    as MemoryPlanner plans at fit start (a plan that fits is then not lowered at once)."""
    return min(0.5, 2 * margin)


@dataclass(frozen=True, kw_only=True)
class Placed:
    """memplan's settings as found in a config, and where."""

    settings: MemplanSettings
    """The settings (defaults for what is not given)."""
    callback_key: str | None
    """The MemoryPlanner entry they came from ('trainer.callbacks[0]'), or None."""
    deprecation: str | None
    """For a top-level `memplan:` section: how to move it, in one line; else None."""


def find_settings(raw: Mapping[str, Any], path: Path) -> Placed:
    """memplan's settings from the MemoryPlanner callback's init_args, else from a top-level `memplan:`
    section (with the words that move it); refuses both at once, and two MemoryPlanner callbacks."""
    entries = planner_entries(raw.get("trainer"))
    if len(entries) > 1:
        raise ConfigError(entries[1][0], f"{entries[1][0]}: a second MemoryPlanner callback ({entries[0][0]} is one); "
                          "a Trainer runs one: keep one entry")
    if entries and "memplan" in raw:
        key = entries[0][0]
        raise ConfigError("memplan", (
            f"memplan: and the MemoryPlanner callback at {key} both hold memplan's settings; move what memplan: holds "
            f"into {key}.init_args (margin as plan_margin; {', '.join(SUGGEST_SETTINGS)} under suggest:) and delete "
            "memplan:"))
    if entries:
        key, entry = entries[0]
        return Placed(settings=_from_callback(key, entry), callback_key=key, deprecation=None)
    if "memplan" in raw:
        settings = MemplanSettings.from_dict(raw["memplan"])
        return Placed(settings=settings, callback_key=None, deprecation=moving_words(raw, path))
    return Placed(settings=MemplanSettings(keys=settings_keys(UNPLACED)), callback_key=None, deprecation=None)


def planner_entries(trainer: Any) -> list[tuple[str, Mapping[str, Any]]]:
    """(YAML key, entry) of each MemoryPlanner in trainer.callbacks (a list, or one mapping)."""
    callbacks = trainer.get("callbacks") if isinstance(trainer, Mapping) else None
    if isinstance(callbacks, Mapping):
        items = [("trainer.callbacks", callbacks)]
    elif isinstance(callbacks, list):
        items = [(f"trainer.callbacks[{i}]", entry) for i, entry in enumerate(callbacks)]
    else:
        return []
    return [(key, entry) for key, entry in items
            if isinstance(entry, Mapping) and entry.get("class_path") in PLANNER_CLASS_PATHS]


def _from_callback(key: str, entry: Mapping[str, Any]) -> MemplanSettings:
    prefix = f"{key}.init_args"
    init_args = entry.get("init_args") or {}
    if not isinstance(init_args, Mapping):
        raise ConfigError(prefix, f"{prefix} must be a mapping of MemoryPlanner's arguments; got {init_args!r}")
    keys = settings_keys(prefix)
    section = {name: init_args[name] for name in CALLBACK_SETTINGS if name in init_args}
    if init_args.get("plan_margin") is not None:
        section["margin"] = init_args["plan_margin"]
    elif init_args.get("margin") is not None:
        margin = init_args["margin"]
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ConfigError(f"{prefix}.margin", f"{prefix}.margin must be a fraction in [0, 1) (MemoryPlanner's "
                              f"margin: the free memory under which a fit lowers the micro-batch); got {margin!r}")
        section["margin"] = plan_margin_for(margin)
    else:
        section["margin"] = plan_margin_for(DEFAULT_CALLBACK_MARGIN)
    section.update(_suggest_section(init_args.get("suggest"), f"{prefix}.suggest"))
    return MemplanSettings.from_dict(section, keys=keys, where=prefix)


def _suggest_section(suggest: Any, key: str) -> Mapping[str, Any]:
    if suggest is None:
        return {}
    if not isinstance(suggest, Mapping):
        raise ConfigError(key, f"{key} must be a mapping of memplan suggest's settings ({', '.join(SUGGEST_SETTINGS)}); "
                          f"got {suggest!r}")
    prefix = key.rsplit(".", 1)[0]
    for name in suggest:
        if name not in SUGGEST_SETTINGS:
            placed = (f"; {name} goes directly under {prefix}" + (" (as plan_margin)" if name == "margin" else "")
                      if name in (*CALLBACK_SETTINGS, "margin") else "")
            raise ConfigError(f"{key}.{name}", (
                f"{key}.{name} is not a memplan suggest setting{did_you_mean(str(name), SUGGEST_SETTINGS)}{placed}; "
                f"its settings are {', '.join(SUGGEST_SETTINGS)}"))
    return suggest


def check_suggest(suggest: Any, key: str = "suggest") -> MemplanSettings:
    """MemoryPlanner's `suggest` argument checked as `memplan suggest` reads it (a ConfigError, a ValueError,
    naming `key`.<setting>); the callback checks it at construction, so a launch refuses what suggest would."""
    keys = {name: f"{key}.{name}" for name in SUGGEST_SETTINGS}
    return MemplanSettings.from_dict(_suggest_section(suggest, key), keys=keys, where=key)


def callback_arguments(section: Mapping[str, Any]) -> dict[str, Any]:
    """A `memplan:` section's settings as MemoryPlanner's init_args: margin as plan_margin, the settings
    only suggest reads under suggest:."""
    init_args: dict[str, Any] = {name: section[name] for name in CALLBACK_SETTINGS if name in section}
    if "margin" in section:
        init_args["plan_margin"] = section["margin"]
    suggest = {name: section[name] for name in SUGGEST_SETTINGS if name in section}
    if suggest:
        init_args["suggest"] = suggest
    return init_args


def moving_words(raw: Mapping[str, Any], path: Path) -> str:
    """The deprecation message for a top-level `memplan:` section, in one line, with the YAML to write instead."""
    section = raw.get("memplan") or {}
    entry = {"class_path": PLANNER_CLASS_PATHS[0], "init_args": callback_arguments(section)}
    if not entry["init_args"]:
        del entry["init_args"]
    others = (raw.get("trainer") or {}).get("callbacks") if isinstance(raw.get("trainer"), Mapping) else None
    where = "append this entry to trainer.callbacks" if others else "add it as trainer.callbacks"
    flow = yaml.safe_dump([entry], default_flow_style=True, width=math.inf, sort_keys=False).strip()
    return (f"{path}: the top-level memplan: section is deprecated (a plain LightningCLI refuses a config with it) "
            f"and is read only until memplan {REMOVED_IN}; move it into the MemoryPlanner callback, whose init_args "
            f"LightningCLI accepts ({where}: {flow}) and delete memplan:. Training then runs MemoryPlanner too: it "
            "plans at fit start, or applies the plan `memplan suggest --output` writes, and watches memory")
