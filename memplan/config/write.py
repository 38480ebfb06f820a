"""Write the planned config: the user's YAML with the plan applied, and the plan file beside it."""
from __future__ import annotations

import contextlib
import copy
import inspect
import json
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from memplan.config.errors import ConfigError
from memplan.config.load import BATCH_SIZE_ARGS, LoadedConfig
from memplan.config.placement import PLANNER_CLASS_PATHS, callback_arguments
from memplan.plan import Plan
from memplan.units import format_bytes

PLANNER_CLASS_PATH = "memplan.MemoryPlanner"


def plan_path_for(config_path: str | Path) -> Path:
    """Where write_planned_config puts the plan file: beside the config, `<name>.plan.json`."""
    return Path(config_path).with_suffix(".plan.json")


def planner_callback(plan_path: str | Path, *, config_path: str | Path | None = None) -> dict[str, Any]:
    """The trainer.callbacks entry that applies a plan file (checkpointing included) and watches memory.
    With `config_path` (the planned config it goes into), the plan is named relative to that config's
    folder, so the pair can be moved together; MemoryPlanner looks for it beside the config LightningCLI
    was given (memplan.callback.plan_file), from any working directory. Without, by absolute path."""
    plan = Path(plan_path).resolve()
    if config_path is not None:
        plan = Path(os.path.relpath(plan, Path(config_path).resolve().parent))
    return {"class_path": PLANNER_CLASS_PATH, "init_args": {"plan": plan.as_posix()}}


class OutputExists(FileExistsError):
    """A file write_planned_config would replace exists, and force was not given."""

    def __init__(self, paths: list[Path]) -> None:
        names = " and ".join(str(p) for p in paths)
        super().__init__(f"--output would replace {names}; pass --force to replace "
                         f"{'them' if len(paths) > 1 else 'it'}, or choose another --output")
        self.paths = paths
        """The files that exist."""


def existing_outputs(path: str | Path) -> list[Path]:
    """The files write_planned_config(path) would replace: the config and its plan file, where they exist."""
    return [p for p in (Path(path), plan_path_for(path)) if p.exists()]


def write_planned_config(loaded: LoadedConfig, plan: Plan, path: str | Path, *,
                         callback: Mapping[str, Any] | None = None, force: bool = False) -> None:
    """Write the user's config with the plan applied to `path`, and the plan (Plan.to_dict()) as JSON
    to plan_path_for(path).

    Sets trainer.devices (the planned GPUs' indices when the plan chose local GPUs, else the count per
    node), num_nodes, precision, accumulate_grad_batches and strategy, and the micro-batch size in the
    datamodule's batch_size / train_batch_size init_arg. `callback` (e.g. planner_callback(plan_path_for(path)))
    goes into trainer.callbacks: merged into the config's own MemoryPlanner entry (its other init_args,
    memplan's settings included, kept), else appended. Every other key keeps its value and order; a
    deprecated top-level `memplan:` section is left out (LightningCLI refuses keys it does not know), its
    settings moved into the MemoryPlanner entry; YAML comments are not carried over.

    Safe with the user's files: without `force`, an existing config or plan file at the target raises
    OutputExists naming each one. Each file is written to a temporary file in the same folder and
    renamed over the target (the plan first, so a config never names a partial plan), under a lock
    on the folder, so two writers leave one writer's pair.
    """
    path = Path(path)
    if path.resolve() == loaded.path.resolve():
        raise ConfigError("", f"refusing to overwrite the source config {path}; "
                          "write the planned config to another file")
    raw = copy.deepcopy(loaded.raw)
    legacy = raw.pop("memplan", None)
    if callback is not None and isinstance(legacy, Mapping) and callback.get("class_path") in PLANNER_CLASS_PATHS:
        callback = {**callback, "init_args": {**callback_arguments(legacy), **(callback.get("init_args") or {})}}
    raw["trainer"] = _planned_trainer(dict(raw.get("trainer") or {}), plan, callback, loaded.model.cls)
    _set_batch_size(raw, loaded, plan.micro_batch_size)
    fsdp1 = plan.strategy == "fsdp" and raw["trainer"]["strategy"]["class_path"] == FSDP_CLASS_PATH
    by_policy = fsdp1 and plan.checkpointing.mode == "full"  # FSDPStrategy checkpoints whole blocks, by its policy
    if plan.gradient_checkpointing and callback is None and not by_policy:
        warnings.warn("the plan checkpoints activations, which the MemoryPlanner callback applies, and no callback "
                      f"was given: {path} will not fit as planned unless the model checkpoints itself", stacklevel=2)
    plan_path = plan_path_for(path)
    config_text = _header(loaded, plan, plan_path) + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _folder_lock(path.parent), signals_deferred():
        existing = existing_outputs(path)
        if existing and not force:
            raise OutputExists(existing)
        write_pair(((plan_path, json.dumps(plan.to_dict(), indent=2) + "\n"), (path, config_text)))


def write_pair(files: tuple[tuple[Path, str], ...]) -> None:
    """Write each (path, text) so that an interrupted write leaves all of them or none of the new ones:
    every text goes to a temporary file beside its target (flushed to disk) first, then each is renamed
    over its target in order; a failure before the last rename takes back the renames already done
    (the files they replaced are gone: --force said so) and every temporary file."""
    temps: list[tuple[str, Path]] = []
    done: list[Path] = []
    try:
        for path, text in files:
            temps.append((_temp_with(path, text), path))
        for temp, path in temps:
            os.replace(temp, path)
            done.append(path)
    except BaseException:
        for temp, path in temps:
            if path not in done:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
        if len(done) < len(temps):
            for path in done:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        raise


def _temp_with(path: Path, text: str) -> str:
    """A temporary file beside `path` holding `text`, on disk, with a normal file's mode."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)  # mkstemp makes it private; give it a normal file's mode
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return temp


DEFERRED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
"""Signals held back while a planned config and its plan are written (milliseconds), then delivered."""


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Within it, SIGTERM, SIGINT and SIGHUP wait: each is recorded, and delivered again once the
    block is done (its files whole or taken back), with the handler that was in place. A no-op off
    the main thread, where Python cannot set handlers."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    for name in DEFERRED_SIGNALS:
        number = getattr(signal, name, None)
        if number is not None:
            previous[number] = signal.signal(number, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk, and rename it over `path`:
    a reader sees the old file or the whole new one, never a part (a full disk fails before the rename)."""
    write_pair(((path, text),))


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive flock on the folder itself (no lock file left behind); a no-op where flock is absent."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; the atomic renames still hold
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _planned_trainer(trainer: dict[str, Any], plan: Plan, callback: Mapping[str, Any] | None,
                     model_class: type | None = None) -> dict[str, Any]:
    local = plan.nodes == 1 and len(plan.gpus) == plan.gpus_per_node
    trainer["devices"] = list(plan.gpus) if local else plan.gpus_per_node
    trainer["num_nodes"] = plan.nodes
    trainer["precision"] = plan.precision
    trainer["accumulate_grad_batches"] = plan.accumulate_grad_batches
    if plan.strategy == "fsdp":
        trainer["strategy"] = fsdp_strategy(plan, model_class)
    elif not (plan.strategy == "ddp" and is_ddp_strategy(trainer.get("strategy"))):
        trainer["strategy"] = plan.strategy  # a DDP variant of the user's (find_unused_parameters ...) is kept
    if callback is not None:
        trainer["callbacks"] = _with_callback(trainer.get("callbacks"), callback)
    return trainer


def _with_callback(callbacks: Any, callback: Mapping[str, Any]) -> list[Any]:
    """trainer.callbacks with `callback` in: merged into the user's MemoryPlanner entry where there is one (in
    its place, its class_path and other init_args kept: the user's training settings and memplan's), else
    replacing an entry of the same class_path, else appended."""
    existing = [callbacks] if isinstance(callbacks, Mapping) else list(callbacks or [])
    ours = callback.get("class_path")
    merge = ours in PLANNER_CLASS_PATHS
    for i, entry in enumerate(existing):
        if isinstance(entry, Mapping) and (entry.get("class_path") == ours
                                           or merge and entry.get("class_path") in PLANNER_CLASS_PATHS):
            init_args = {**(entry.get("init_args") or {}), **(callback.get("init_args") or {})} if merge \
                else dict(callback.get("init_args") or {})
            existing[i] = {**entry, "class_path": entry["class_path"] if merge else ours, "init_args": init_args}
            others = [e for e in existing[i + 1:] if not (isinstance(e, Mapping) and e.get("class_path") == ours)]
            return [*existing[:i + 1], *others]
    return [*existing, dict(callback)]


FSDP_CLASS_PATH = "FSDPStrategy"
MODEL_PARALLEL_CLASS_PATH = "ModelParallelStrategy"
"""By class name: LightningCLI resolves them in the Lightning package it runs (lightning.pytorch or
pytorch_lightning); a full import path would tie the config to one of the two."""


def fsdp_strategy(plan: Plan, model_class: type | None = None) -> dict[str, Any]:
    """The trainer.strategy entry of an FSDP plan.

    Lightning's ModelParallelStrategy (FSDP2, what memplan traces) where the model shards itself (its
    configure_model applies fully_shard: `applies_fully_shard`) and the plan is FULL_SHARD without CPU
    offload, the layout such a configure_model gives: data_parallel_size = the world size, no tensor
    parallelism. Checkpointing is then MemoryPlanner's to turn on. Otherwise Lightning's FSDPStrategy
    (FSDP1) with the planned sharding, each repeated block wrapped (auto_wrap_policy, a list of class
    paths LightningCLI turns into a set of classes), the same classes checkpointed when the plan
    checkpoints (activation_checkpointing_policy), CPU offload, and (HYBRID_SHARD) the (replicate,
    shard) device mesh."""
    if (model_class is not None and applies_fully_shard(model_class) and plan.sharding_strategy == "FULL_SHARD"
            and not plan.cpu_offload):
        return {"class_path": MODEL_PARALLEL_CLASS_PATH,
                "init_args": {"data_parallel_size": plan.world_size, "tensor_parallel_size": 1}}
    if not plan.block_classes:
        raise ConfigError("model", (
            "the plan uses FSDP but names no block class to wrap (Plan.block_classes is empty): re-run memplan "
            "suggest, or set trainer.strategy.init_args.auto_wrap_policy to your model's block classes"))
    args: dict[str, Any] = {"sharding_strategy": plan.sharding_strategy,
                            "auto_wrap_policy": list(plan.block_classes), "cpu_offload": plan.cpu_offload}
    if plan.checkpointing.mode == "full":  # partial and per-op checkpointing: MemoryPlanner applies them
        args["activation_checkpointing_policy"] = list(plan.block_classes)
    if plan.sharding_strategy == "HYBRID_SHARD":
        args["device_mesh"] = [plan.nodes, plan.gpus_per_node]
    return {"class_path": FSDP_CLASS_PATH, "init_args": args}


def applies_fully_shard(model_class: type) -> bool:
    """Whether the LightningModule class shards itself: it overrides configure_model, whose source
    (its own or a base class's) calls torch's `fully_shard`."""
    method = getattr(model_class, "configure_model", None)
    if method is None or getattr(method, "__qualname__", "").startswith(("LightningModule.", "ModelHooks.")):
        return False
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):  # no source to read (a compiled or dynamically made class)
        return False
    return "fully_shard(" in source


def is_ddp_strategy(strategy: Any) -> bool:
    if isinstance(strategy, str):
        return strategy == "ddp" or strategy.startswith("ddp_find_unused_parameters")
    if isinstance(strategy, Mapping):
        return str(strategy.get("class_path", "")).endswith(".DDPStrategy")
    return False


def _set_batch_size(raw: dict[str, Any], loaded: LoadedConfig, micro_batch_size: int) -> None:
    found = loaded.batch_size_arg
    if found is None:
        where = "data.init_args" if loaded.data is not None else "model.init_args (there is no data: section)"
        raise ConfigError("data", (
            f"cannot apply the plan's micro-batch size: {where} has no {' or '.join(BATCH_SIZE_ARGS)}; "
            "give the datamodule a batch_size init argument"))
    section, name = found
    if isinstance(raw[section], str):
        raw[section] = {"class_path": raw[section]}
    raw[section]["init_args"] = {**(raw[section].get("init_args") or {}), name: micro_batch_size}


def _checkpointing_words(plan: Plan) -> str:
    """'off', 'on', or a partial / per-op setting with its text form ('op: selective (per-op) checkpointing')."""
    if plan.user_checkpointing is not None:
        return "the model's own, kept"
    setting = plan.checkpointing
    if setting.mode in ("none", "full"):
        return "on" if setting else "off"
    return f"{setting} ({setting.describe()}, applied by MemoryPlanner)"


def _header(loaded: LoadedConfig, plan: Plan, plan_path: Path) -> str:
    lines = [
        f"Planned by memplan from {loaded.path}, for {plan.world_size} x {plan.gpu_name} "
        f"({plan.nodes} node(s) x {plan.gpus_per_node} GPU(s)).",
        f"Micro-batch {plan.micro_batch_size} x {plan.world_size} rank(s) x {plan.accumulate_grad_batches} "
        f"accumulation = global batch {plan.global_batch_size}; precision {plan.precision}; activation "
        f"checkpointing {_checkpointing_words(plan)}"
        + (f"; FSDP {plan.sharding_strategy}{' with CPU offload' if plan.cpu_offload else ''}."
           if plan.strategy == "fsdp" else "."),
        f"Predicted peak per GPU {format_bytes(plan.predicted_peak_bytes)} of "
        f"{format_bytes(plan.device_budget_bytes)} usable. Plan file: {plan_path.name}.",
        "The source's comments are not carried over" + (" (its memplan: section is, into the MemoryPlanner "
                                                         "callback's init_args)." if "memplan" in loaded.raw else "."),
    ]
    return "".join(f"# {line}\n" for line in lines)
