"""memplan's settings in a config: what the planner may choose, and what it must keep.

They live where a plain LightningCLI accepts them, in the MemoryPlanner callback's init_args under
trainer.callbacks (memplan.config.placement finds them there): global_batch_size, allow_checkpointing and
plan_margin are the callback's own arguments (it plans with them at fit start too), and what only
`memplan suggest` needs, planning before any Trainer exists, goes under its `suggest:` argument. The old
top-level `memplan:` section is still read, with a deprecation message (memplan.config.placement).
Every message names the key where the setting was written (MemplanSettings.key)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memplan.config.batch_spec import BatchSpec, parse_batch_spec
from memplan.config.errors import ConfigError, did_you_mean
from memplan.optimizers import OPTIMIZER_NAMES as OPTIMIZERS
from memplan.plan import MAX_BATCH_SIZE
from memplan.precision import PRECISIONS, Precision, canonical_precision

MAX_WORKERS = 256
"""DataLoader workers per rank at most (memplan.num_workers, data.init_args.num_workers)."""
MAX_PREFETCH_FACTOR = 64
"""Batches loaded ahead per worker at most (memplan.prefetch_factor, data.init_args.prefetch_factor)."""

DEFAULT_PRECISIONS: tuple[Precision, ...] = ("32-true", "16-mixed", "bf16-mixed")
"""The planner's default choices: full and mixed precision, which keep fp32 weights. The '-true' half
precisions change what training computes and must be allowed by name."""

def normalize_precision(value: Any, *, name: str = "trainer.precision") -> Precision:
    """Lightning's canonical string for a precision or alias (16 -> '16-mixed'); a ConfigError naming
    `name` (the YAML key) for anything memplan does not estimate."""
    try:
        return canonical_precision(value, name=name)
    except ValueError as err:
        raise ConfigError(name, str(err)) from None


@dataclass(frozen=True, kw_only=True)
class MemplanSettings:
    """What the planner may choose and must keep; the `memplan:` section of a config."""

    global_batch_size: int | None = None
    """Samples per optimizer step, kept by every plan. None: the config's own, trainer batch x
    trainer.devices x trainer.num_nodes x trainer.accumulate_grad_batches."""
    precisions: tuple[Precision, ...] = DEFAULT_PRECISIONS
    """Lightning precision strings the planner may choose from."""
    allow_checkpointing: bool = True
    """Whether the planner may turn on activation checkpointing to fit."""
    margin: float = 0.10
    """Fraction of each GPU's free memory kept free as a safety margin (0.10 plans within 90 %)."""
    batch_spec: BatchSpec | None = None
    """Describes the batch instead of running the datamodule (see memplan.config.batch_spec)."""
    optimizer: str | None = None
    """Optimizer to estimate with, by memplan's name (sgd, sgd-momentum, adam, adamw, rmsprop, adagrad).
    None: the config's `optimizer:` section, else the model's configure_optimizers()."""
    num_workers: int | None = None
    """DataLoader workers per rank, for the host-memory estimate, when data.init_args does not say."""
    prefetch_factor: int | None = None
    """Batches each worker loads ahead, when data.init_args does not say."""
    pin_memory: bool | None = None
    """Whether loaders pin host memory, when data.init_args does not say."""
    keys: Mapping[str, str] | None = None
    """Each setting's YAML key path, as the config spells it (None: the old `memplan.<name>`)."""

    def key(self, name: str) -> str:
        """Where setting `name` is written (or would be) in the config, e.g.
        'trainer.callbacks[0].init_args.global_batch_size' or 'memplan.global_batch_size'."""
        return (self.keys or {}).get(name, f"memplan.{name}")

    def __post_init__(self) -> None:
        gbs = self.global_batch_size
        if gbs is not None and (not _is_int(gbs) or not 1 <= gbs <= MAX_BATCH_SIZE):
            self._fail("global_batch_size", f"must be a positive int up to {MAX_BATCH_SIZE:,} (samples per optimizer step, "
                  "over all GPUs), or null to keep the config's own", gbs)
        if not isinstance(self.precisions, tuple) or not self.precisions:
            self._fail("precisions", f"must be a non-empty list of Lightning precision strings ({', '.join(PRECISIONS)})",
                  self.precisions)
        for precision in self.precisions:
            if precision not in PRECISIONS:
                self._fail("precisions", f"must hold Lightning precision strings ({', '.join(PRECISIONS)})", precision)
        if not isinstance(self.allow_checkpointing, bool):
            self._fail("allow_checkpointing", "must be true or false", self.allow_checkpointing)
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 1:
            self._fail("margin", "must be a fraction in [0, 1), e.g. 0.10 to keep 10 % of each GPU free", self.margin)
        if self.batch_spec is not None and not isinstance(self.batch_spec, BatchSpec):
            self._fail("batch_spec", "must be a BatchSpec (in YAML: per-sample shapes, dtypes and ranges)", self.batch_spec)
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            self._fail("optimizer", f"must be one of {', '.join(OPTIMIZERS)}, or null to use the config's optimizer"
                  f"{did_you_mean(str(self.optimizer), OPTIMIZERS)}", self.optimizer)
        if self.num_workers is not None and (not _is_int(self.num_workers) or not 0 <= self.num_workers <= MAX_WORKERS):
            self._fail("num_workers", f"must be an int >= 0 and at most {MAX_WORKERS} (DataLoader workers per rank)",
                  self.num_workers)
        if self.prefetch_factor is not None and (not _is_int(self.prefetch_factor)
                                                 or not 1 <= self.prefetch_factor <= MAX_PREFETCH_FACTOR):
            self._fail("prefetch_factor", f"must be a positive int up to {MAX_PREFETCH_FACTOR} (batches loaded ahead per "
                  "worker; DataLoader's default is 2)", self.prefetch_factor)
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            self._fail("pin_memory", "must be true or false", self.pin_memory)

    def _fail(self, name: str, requirement: str, got: Any) -> None:
        shown = repr(got) if len(repr(got)) <= 40 else f"{repr(got)[:20]}... ({len(repr(got))} characters)"
        raise ConfigError(self.key(name), f"{self.key(name)} {requirement}; got {shown}")

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None, *, keys: Mapping[str, str] | None = None,
                  where: str = "memplan") -> MemplanSettings:
        """From a YAML mapping of settings (None: the defaults): the old `memplan:` section, or what
        memplan.config.placement gathers from the MemoryPlanner callback. `keys`: each setting's YAML key
        path (default `memplan.<name>`); `where`: the mapping's own key. Unknown keys are refused by name."""
        if section is None:
            return cls(keys=keys)
        if not isinstance(section, Mapping):
            raise ConfigError(where, f"{where} must be a mapping of settings (global_batch_size: ..., "
                              f"precisions: [...]); got {section!r}")
        named = cls(keys=keys).key
        known = [f.name for f in dataclasses.fields(cls) if f.name != "keys"]
        for key in section:
            if key not in known:
                raise ConfigError(f"{where}.{key}", (
                    f"{where}.{key} is not a memplan setting{did_you_mean(str(key), known)}; "
                    f"the settings are {', '.join(known)}"))
        values = dict(section)
        if "precisions" in values:
            given = values["precisions"]
            given = [given] if isinstance(given, (str, int)) else given
            if isinstance(given, list):
                values["precisions"] = tuple(dict.fromkeys(
                    normalize_precision(p, name=f"{named('precisions')}[{i}]") for i, p in enumerate(given)))
        if values.get("batch_spec") is not None:
            values["batch_spec"] = parse_batch_spec(values["batch_spec"], named("batch_spec"))
        return cls(**values, keys=keys)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
