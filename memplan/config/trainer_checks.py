"""The trainer: section's checks: devices and node counts, the seed, and an accelerator and strategy memplan
can plan for, each refused by its key with the fix."""
from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from typing import Any

from memplan.config.errors import ConfigError
from memplan.plan import MAX_BATCH_SIZE, MAX_GPUS_PER_NODE, MAX_NODES, check_count


def device_count(devices: Any) -> int | None:
    """GPUs per node from trainer.devices as Lightning parses it; None when the machine decides."""
    if devices is None or devices == "auto" or devices == -1 or devices == "-1":
        return None
    count = None
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        count = devices
    elif isinstance(devices, list) and devices:
        count = len(devices)
    elif isinstance(devices, str):
        text = devices.strip()
        if "," in text and all(p.strip().isdigit() for p in text.split(",") if p.strip()):
            count = len([p for p in text.split(",") if p.strip()])
        elif text.isdigit() and len(text) < 10 and int(text) > 0:
            count = int(text)
    if count is not None:
        if count > MAX_GPUS_PER_NODE:
            shown = repr(devices) if len(repr(devices)) <= 40 else f"{count} devices"
            raise ConfigError("trainer.devices", (
                f"trainer.devices is per node and must be at most {MAX_GPUS_PER_NODE} devices; got {shown}. For more "
                "GPUs, set trainer.num_nodes"))
        return count
    raise ConfigError("trainer.devices", (
        "trainer.devices must be a positive number of devices, a list of device indices, 'auto' or -1; "
        f"got {devices!r}"))


SEED_RANGE = (0, 2**32 - 1)
"""The seeds Lightning's seed_everything takes (numpy's uint32)."""


PLANNED_ACCELERATORS = ("auto", "gpu", "cuda", "cpu")
"""trainer.accelerator values memplan plans for: CUDA GPUs (and CPU, which it estimates)."""


PLANNED_STRATEGY_CLASSES = ("DDPStrategy", "FSDPStrategy", "ModelParallelStrategy", "SingleDeviceStrategy")
"""trainer.strategy class_path names memplan plans (DDP and FSDP, and one device)."""


def check_seed(seed: Any) -> None:
    """seed_everything as LightningCLI takes it: true/false (a random seed or none) or an int seed."""
    if seed is None or isinstance(seed, bool):
        return
    if not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ConfigError("seed_everything", f"seed_everything must be true, false or an int seed from "
                          f"{SEED_RANGE[0]} to {SEED_RANGE[1]}; got {seed!r}")


def check_accelerator(accelerator: Any, package: str) -> None:
    """trainer.accelerator: one Lightning (`package`) knows, and one memplan plans (CUDA GPUs, or CPU)."""
    if accelerator is None or (isinstance(accelerator, str) and accelerator.lower() in PLANNED_ACCELERATORS):
        return
    if isinstance(accelerator, Mapping):  # an Accelerator class_path: its own business, if a CUDA one
        name = str(accelerator.get("class_path", "")).rsplit(".", 1)[-1]
        if name in ("CUDAAccelerator", "CPUAccelerator"):
            return
        raise ConfigError("trainer.accelerator", f"trainer.accelerator.class_path {name or '(missing)'!r}: memplan "
                          "plans CUDA GPUs (CUDAAccelerator) and CPU; set trainer.accelerator to gpu or auto")
    known = sorted(importlib.import_module(package + ".accelerators")
                   .AcceleratorRegistry.available_accelerators())
    if isinstance(accelerator, str) and accelerator.lower() in known:
        raise ConfigError("trainer.accelerator", f"trainer.accelerator {accelerator!r}: memplan plans CUDA GPUs "
                          "(and estimates CPU), not this device; set trainer.accelerator to gpu or auto")
    raise ConfigError("trainer.accelerator", f"trainer.accelerator must be one of {', '.join(PLANNED_ACCELERATORS)} "
                      f"(Lightning knows {', '.join(known)}); got {accelerator!r}")


def check_strategy(strategy: Any, package: str) -> None:
    """trainer.strategy: one Lightning knows, and one memplan plans (DDP and its variants, FSDP, one
    device, auto). Another would be replaced by the plan's strategy, which memplan never does silently."""
    if strategy is None or strategy == "auto":
        return
    if isinstance(strategy, Mapping):
        name = str(strategy.get("class_path", "")).rsplit(".", 1)[-1]
        if name in PLANNED_STRATEGY_CLASSES:
            return
        raise ConfigError("trainer.strategy", f"trainer.strategy.class_path {name or '(missing)'!r}: memplan plans "
                          f"{', '.join(PLANNED_STRATEGY_CLASSES)}; use one of them, or leave trainer.strategy out")
    if not isinstance(strategy, str):
        raise ConfigError("trainer.strategy", f"trainer.strategy must be a strategy name (e.g. ddp, fsdp) or a "
                          f"class_path mapping; got {strategy!r}")
    known = importlib.import_module(package + ".strategies").StrategyRegistry.available_strategies()
    planned = [k for k in known if k.startswith(("ddp", "fsdp")) or k == "single_device"]
    if strategy in planned:
        return
    if strategy in known:
        raise ConfigError("trainer.strategy", f"trainer.strategy {strategy!r}: memplan plans DDP and FSDP (ddp, ddp_spawn, "
                          "fsdp, ... or auto), not this engine; its memory is not what memplan estimates")
    close = difflib.get_close_matches(strategy, planned, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError("trainer.strategy", f"trainer.strategy {strategy!r} is not a Lightning strategy{hint}; memplan "
                      "plans ddp (and its variants: ddp_spawn, ddp_find_unused_parameters_true, ...), fsdp or auto")


def positive_int(trainer: Mapping[str, Any], name: str) -> int:
    value = trainer.get(name, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"trainer.{name}", f"trainer.{name} must be a positive int; got {value!r}")
    try:
        return check_count(value, name=f"trainer.{name}", low=1, high=MAX_NODES if name == "num_nodes" else MAX_BATCH_SIZE)
    except ValueError as err:
        raise ConfigError(f"trainer.{name}", str(err)) from None


def check_deterministic(value: Any) -> bool | str | None:
    """trainer.deterministic as Lightning's Trainer takes it: True, False, 'warn' (warn-only) or None (unset)."""
    if value is None or value is True or value is False or value == "warn":
        return value
    raise ConfigError("trainer.deterministic", "trainer.deterministic must be true, false or warn (Lightning's "
                      f"Trainer(deterministic=...): warn is warn-only), or left out; got {value!r}")
