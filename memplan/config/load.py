"""Read a LightningCLI config (the YAML given to `fit --config`) and memplan's settings in it (the
MemoryPlanner callback's init_args, or the deprecated `memplan:` section: memplan.config.placement).

Nothing is instantiated when the config loads: Lightning's own parser reads it (memplan.config.lightning_parser),
after memplan's own checks, which import neither torch nor Lightning. The model is built only by `build_model`, which memplan calls under fake
tensors, so a 7B-parameter config allocates no weights. The datamodule runs once, for one batch, the
first time `example_batch` needs it.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memplan.config.classes import MISSING, ClassSpec, check_shape, from_parsed
from memplan.config.errors import ConfigError
from memplan.config.lightning_parser import package_of, parse_config
from memplan.config.placement import SettingsDeprecation, find_settings
from memplan.config.sections import check_sections
from memplan.config.settings import MAX_PREFETCH_FACTOR, MAX_WORKERS, MemplanSettings, normalize_precision
from memplan.config.trainer_checks import (
    check_accelerator, check_deterministic, check_seed, check_strategy, device_count, positive_int,
)
from memplan.config.yaml_file import expand_dotted, merge_overrides, read_yaml
from memplan.plan import MAX_BATCH_SIZE, check_count

if TYPE_CHECKING:
    from torch import nn

    from memplan.estimator import MemoryEstimate

BATCH_SIZE_ARGS = ("batch_size", "train_batch_size")
"""init_args names that hold the per-GPU (micro-)batch size, looked for in this order."""


@dataclass(frozen=True, kw_only=True)
class LoaderHints:
    """How the training DataLoader loads, for the host-memory estimate."""

    num_workers: int
    """Worker processes per rank (0: in the training process)."""
    prefetch_factor: int
    """Batches each worker loads ahead (DataLoader's default 2; unused without workers)."""
    pin_memory: bool
    """Whether batches are copied into pinned host memory."""


@dataclass(frozen=True, kw_only=True)
class LoadedConfig:
    """A loaded config: checked, not instantiated."""

    path: Path
    """The YAML file."""
    raw: dict[str, Any]
    """The YAML as a dict, with the overrides merged in; the planned config is written from it."""
    settings: MemplanSettings
    """memplan's settings (defaults where absent); settings.key(name) is where each is written."""
    model: ClassSpec
    """`model:`: the LightningModule."""
    data: ClassSpec | None
    """`data:`: the LightningDataModule, if any."""
    optimizer_section: ClassSpec | None
    """`optimizer:`, if any (LightningCLI then replaces the model's configure_optimizers with it)."""
    trainer: dict[str, Any]
    """`trainer:` (Trainer keyword arguments) as written."""
    trainer_world_size: int | None
    """trainer.devices x trainer.num_nodes, or None when the devices depend on the machine ('auto', -1)."""
    accumulate_grad_batches: int
    """trainer.accumulate_grad_batches (default 1)."""
    deprecations: tuple[str, ...] = ()
    """What the config does that memplan will stop reading, each in one line with how to change it (a
    top-level `memplan:` section); load_config also warns each as a SettingsDeprecation."""

    def build_model(self) -> nn.Module:
        """Instantiate the model: class_path(**init_args). memplan calls this under fake tensors
        (memplan.estimate with model=loaded.build_model); called outside them, it allocates every weight."""
        return self.model.instantiate()

    def example_batch(self, batch_size: int) -> Any:
        """One batch of `batch_size` samples, as training_step receives it: from memplan.batch_spec, or
        else one batch of the datamodule's train_dataloader() resized (rows repeated or cut)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
        if self.settings.batch_spec is not None:
            return self.settings.batch_spec.make(batch_size)
        from memplan.batching import resize_batch

        return resize_batch(self._datamodule_batch, batch_size)

    @property
    def batch_size_arg(self) -> tuple[str, str] | None:
        """(section, init_arg) holding the micro-batch size, e.g. ('data', 'batch_size'); the model's
        init_args are searched only when there is no datamodule."""
        spec = self.data if self.data is not None else self.model
        for name in BATCH_SIZE_ARGS:
            if name in spec.init_args or spec.value(name) is not MISSING:
                return spec.key, name
        return None

    @property
    def data_batch_size(self) -> int | None:
        """The datamodule's batch size as LightningCLI passes it: its init_arg, else its signature default (None if
        it has none)."""
        found = self.batch_size_arg
        if found is None:
            return None
        spec = self.data if found[0] == "data" else self.model
        value = spec.value(found[1])
        value = spec.init_args.get(found[1]) if value is MISSING else value  # (a **kwargs argument: as written)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def global_batch_size(self) -> int:
        """The global_batch_size setting, else the config's own: batch size x devices x nodes x accumulation."""
        if self.settings.global_batch_size is not None:
            return self.settings.global_batch_size
        key = self.settings.key("global_batch_size")
        fix = f"set {key} (samples per optimizer step, over all GPUs)"
        if self.data_batch_size is None:
            raise ConfigError(key, (
                f"{key} is not set, and the config has no batch size to derive it from "
                f"(the datamodule has no {' or '.join(BATCH_SIZE_ARGS)} argument); {fix}"))
        if self.trainer_world_size is None:
            devices = self.trainer.get("devices", "auto")
            raise ConfigError(key, (
                f"{key} is not set, and trainer.devices is {devices!r}, so the config's "
                f"global batch depends on the machine; {fix}, or set trainer.devices to a number"))
        return self.data_batch_size * self.trainer_world_size * self.accumulate_grad_batches

    @property
    def trainer_precision(self) -> str | None:
        """trainer.precision as Lightning's canonical string (16 -> '16-mixed'), or None if unset."""
        value = self.trainer.get("precision")
        return None if value is None else normalize_precision(value, name="trainer.precision")

    @property
    def trainer_deterministic(self) -> bool | str | None:
        """trainer.deterministic: True, False, 'warn' (warn-only), or None if unset (the process as it is)."""
        return check_deterministic(self.trainer.get("deterministic"))

    @property
    def optimizer(self) -> str | Callable[..., Any] | None:
        """What to pass as memplan.estimate(optimizer=...): the optimizer setting, else a callable(params)
        building the `optimizer:` section, else None (the model's configure_optimizers)."""
        if self.settings.optimizer is not None:
            return self.settings.optimizer
        if self.optimizer_section is not None:
            return self._build_optimizer
        return None

    def _build_optimizer(self, params: Any) -> Any:
        """The `optimizer:` section on `params`; its class refusing its init_args is a ConfigError naming them."""
        section = self.optimizer_section
        try:
            return section.instantiate(params)
        except (TypeError, ValueError) as err:  # torch.optim's own checks: "Invalid learning rate: -1"
            raise ConfigError(f"{section.key}.init_args", (
                f"{section.key}: {section.cls.__name__}(params, **{section.key}.init_args) raised "
                f"{type(err).__name__}: {err}; fix {section.key}.init_args")) from err

    @property
    def loader(self) -> LoaderHints:
        """DataLoader settings: data.init_args, else memplan's settings, else the datamodule's and
        torch's defaults."""
        def pick(name: str, default: Any) -> Any:
            if self.data is not None and name in self.data.init_args:  # given: as the parser read it ('3' -> 3)
                value = self.data.value(name)
                return self.data.init_args[name] if value is MISSING else value
            if getattr(self.settings, name) is not None:
                return getattr(self.settings, name)
            if self.data is not None and self.data.value(name) not in (MISSING, None):
                return self.data.value(name)
            return default

        hints = LoaderHints(num_workers=pick("num_workers", 0), pin_memory=bool(pick("pin_memory", False)),
                            prefetch_factor=pick("prefetch_factor", None) or 2)
        for name, low, high in (("num_workers", 0, MAX_WORKERS), ("prefetch_factor", 1, MAX_PREFETCH_FACTOR)):
            value = getattr(hints, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                key = (f"data.init_args.{name}" if self.data is not None and name in self.data.init_args
                       else self.settings.key(name))
                raise ConfigError(key, f"{key} must be a whole number from {low} to {high} (DataLoader's "
                                  f"{name}, for the host-memory estimate); got {value!r}")
        return hints

    def estimate(self, batch_size: int, **kwargs: Any) -> MemoryEstimate:
        """memplan.estimate of this config at `batch_size` per GPU (kwargs: precision, checkpointing,
        device, strategy, world_size; optimizer defaults to `self.optimizer`), with config_errors()."""
        kwargs.setdefault("optimizer", self.optimizer)
        batch = self.example_batch(batch_size)
        with self.config_errors():
            return estimate(self.build_model, batch, **kwargs)

    def plan_mismatch(self, plan: Any, *, plan_name: str = "--plan") -> str | None:
        """Why `plan` (a memplan.plan.Plan) was made for another model than this config's, in words; None
        when it was made for this one (or recorded no model). Builds the model on fake tensors to compare
        parameter names and shapes (memplan.plan.model_fingerprint); allocates no weight."""
        if plan.model_fingerprint is None:
            return None
        import torch

        from memplan.estimator.fake import fake_model, new_fake_mode
        from memplan.plan import model_fingerprint

        with self.config_errors():
            skeleton = fake_model(self.build_model, new_fake_mode(), device=torch.device("cpu"),
                                  param_dtype=torch.float32)
        if model_fingerprint(skeleton) == plan.model_fingerprint:
            return None
        return (f"{plan_name} was made for {plan.model_class or 'another model'}, not this config's "
                f"{self.model.class_path} with its model.init_args (parameter names or shapes differ); re-plan "
                "with `memplan suggest CONFIG --output ...`")

    @contextlib.contextmanager
    def config_errors(self) -> Iterator[None]:
        """Around anything that traces this config (an estimate, the planner's search): an EstimateError
        about the batch is re-raised as a ConfigError naming where the batch came from (memplan.batch_spec
        or data); one about building the model, naming model.init_args. Others pass unchanged."""
        from memplan.config.blame import estimate_blame
        from memplan.estimator import EstimateError  # (called around a trace: torch is imported by then)

        try:
            yield
        except EstimateError as err:  # (its fields, not its message: memplan.config.blame)
            found = estimate_blame(err, raw=self.raw, model_class=self.model.class_path,
                                   init_args=self.model.init_args,
                                   batch_spec_key=self.settings.key("batch_spec") if self.settings.batch_spec is not None
                                   else None)
            if found is None:
                raise
            raise found from err

    @property
    def planned_for(self) -> str | None:
        """Which batch of the datamodule's loader the plan is for, in words (None: a batch_spec, or
        several loaders)."""
        if self.settings.batch_spec is not None:
            return None
        return self._datamodule_scan[1]

    @property
    def _datamodule_batch(self) -> Any:
        return self._datamodule_scan[0]

    @functools.cached_property
    def _datamodule_scan(self) -> tuple[Any, str | None]:
        if self.data is None:  # load_config refuses a config with neither
            raise ConfigError("data", f"no data: section and no {self.settings.key('batch_spec')}")
        from memplan.config.first_batch import first_batch

        return first_batch(self.data)


def estimate(*args: Any, **kwargs: Any) -> MemoryEstimate:
    """memplan.estimate, imported when first used (torch: seconds), so a refused config never imports it."""
    from memplan.estimator import estimate as run

    return run(*args, **kwargs)


def load_config(path: str | Path, *, overrides: Mapping[str, Any] | None = None) -> LoadedConfig:
    """Read a LightningCLI YAML and memplan's settings in it; nothing is instantiated.

    overrides: merged over the YAML before it is read, nested ({"trainer": {"precision": "bf16-mixed"}}) or
    dotted ({"trainer.precision": "bf16-mixed"}).
    Raises ConfigError (a ValueError, exit_code 2) naming the key at fault and the fix. A top-level
    `memplan:` section is still read, with a SettingsDeprecation warning saying how to move it.
    """
    path = Path(path)
    raw = read_yaml(path)
    if overrides:
        raw = merge_overrides(raw, expand_dotted(overrides))
    check_sections(raw, path)
    if "model" not in raw:
        raise ConfigError("model", (
            f"{path}: no model: section; memplan reads the YAML you pass to LightningCLI's `fit --config`, "
            "with model: {class_path: ..., init_args: {...}} at the top level"))
    placed = find_settings(raw, path)
    settings = placed.settings
    trainer = raw.get("trainer") or {}
    if not isinstance(trainer, Mapping):
        raise ConfigError("trainer", f"trainer must be a mapping of Trainer arguments; got {trainer!r}")
    devices = device_count(trainer.get("devices", "auto"))
    nodes = positive_int(trainer, "num_nodes")
    accumulate = positive_int(trainer, "accumulate_grad_batches")
    if trainer.get("precision") is not None:
        normalize_precision(trainer["precision"], name="trainer.precision")
    check_deterministic(trainer.get("deterministic"))
    check_seed(raw.get("seed_everything"))
    for key in ("model", "data", "optimizer"):
        if raw.get(key) is not None:
            check_shape(raw[key], key, bare_names=key == "optimizer")
    # memplan's own checks are done, none importing torch or Lightning; now Lightning's parser reads the rest
    package = package_of(raw["model"]["class_path"] if isinstance(raw["model"], Mapping) else raw["model"])
    check_accelerator(trainer.get("accelerator"), package)
    check_strategy(trainer.get("strategy"), package)
    parsed = parse_config(raw, package)
    sections = {key: from_parsed(raw[key], parsed[key], key, package) if raw.get(key) is not None else None
                for key in ("model", "data", "optimizer")}
    model = sections["model"]
    if sections["data"] is None and settings.batch_spec is None:
        raise no_batch(model.cls, settings.key("batch_spec"))
    loaded = LoadedConfig(
        path=path, raw=raw, settings=settings, model=model, data=sections["data"],
        optimizer_section=sections["optimizer"], trainer=dict(trainer),
        trainer_world_size=None if devices is None else devices * nodes, accumulate_grad_batches=accumulate,
        deprecations=(placed.deprecation,) if placed.deprecation else (),
    )
    found = loaded.batch_size_arg
    if found is not None and loaded.data_batch_size is not None and not 1 <= loaded.data_batch_size <= MAX_BATCH_SIZE:
        key = f"{found[0]}.init_args.{found[1]}"
        if loaded.data_batch_size < 1:
            raise ConfigError(key, f"{key} must be a positive int (samples per batch); got {loaded.data_batch_size!r}")
        try:
            check_count(loaded.data_batch_size, name=key, low=1, high=MAX_BATCH_SIZE, what="samples per batch")
        except ValueError as err:
            raise ConfigError(key, str(err)) from None
    loaded.loader  # noqa: B018  (its ranges checked now, before any work)
    if loaded.optimizer_section is not None:  # its own checks (a negative lr ...) before any trace: on one parameter
        import torch

        loaded._build_optimizer([torch.nn.Parameter(torch.zeros(1))])
    if placed.deprecation:
        warnings.warn(placed.deprecation, SettingsDeprecation, stacklevel=2)
    return loaded


def no_batch(model_cls: type, key: str) -> ConfigError:
    """The refusal of a config with neither a datamodule nor a batch_spec (`key`: where it goes)."""
    owns = "train_dataloader" in vars(model_cls) or any(
        "train_dataloader" in vars(c) for c in model_cls.__mro__[1:] if c.__name__ != "LightningModule"
        and not c.__module__.startswith(("pytorch_lightning", "lightning")))
    why = (f"{model_cls.__name__} loads its own data (train_dataloader), which memplan does not run: it would "
           "build the model for real" if owns else "the config has no data: section (a LightningDataModule)")
    return ConfigError(key, (
        f"no batch to plan with: {why}; describe one batch in {key} (per-sample shape, dtype and value range "
        "of each tensor, as training_step receives them), e.g. trainer: {callbacks: [{class_path: "
        "memplan.MemoryPlanner, init_args: {suggest: {batch_spec: {input: {shape: [1024], dtype: int64, high: "
        "50257}}}}}]} (README: 'Describing the batch')"))
