"""Planning at fit start under an FSDP strategy (MemoryPlanner without plan=).

memplan estimates FSDP by tracing fully_shard in a fake process group of N ranks (memplan.estimator.fsdp),
and torch allows one default process group per process: the training job's is up by the time any
callback runs. So rank 0 plans in a Python process of its own (`python -m memplan.callback.fsdp_plan`,
which imports the model's module and never re-runs the training script): the model is rebuilt there on
the meta device from its class and `hparams` (`self.save_hyperparameters()`), traced on one train
batch, and the plan comes back. The job travels pickled with cloudpickle, so a model class defined in
the script run as `__main__` (how most training scripts are written) travels by value: the script is
not imported, nor run, there. The plan is made at
setup, before configure_model shards the model, so the model's parameters are its unsharded ones.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memplan.callback.framework import MODEL_PARALLEL_STRATEGIES, MisconfigurationException
from memplan.estimator.determinism import Deterministic
from memplan.estimator.fsdp import DTYPES, SHARDING_STRATEGIES, FsdpSettings
from memplan.plan import Plan


def parameter_count(module: nn.Module) -> int:
    """Elements of the model's parameters, unsharded (a DTensor counts its global shape)."""
    return sum(p.numel() for p in module.parameters())


def planning_settings(strategy: Any, module: nn.Module) -> tuple[FsdpSettings, list[str]]:
    """What MemoryPlanner estimates a fit-start plan with under an FSDP strategy (called at setup,
    before configure_model): the settings it can read, and in words what it assumes instead of
    reading. MisconfigurationException for what it cannot plan."""
    if not any(True for _ in module.parameters()):
        raise MisconfigurationException(
            f"MemoryPlanner plans at fit start from the model's parameters, and this {type(module).__name__} has "
            "none before configure_model (it builds its layers there): plan it with `memplan suggest CONFIG "
            "--output plan.json` and pass MemoryPlanner(plan='plan.json')")
    if isinstance(strategy, MODEL_PARALLEL_STRATEGIES):
        if callable(getattr(type(module), "configure_model", None)) and \
                type(module).configure_model is not getattr(_lightning_base(module), "configure_model", None):
            return FsdpSettings(configure_model=True), []  # traced as the model shards itself: nothing assumed
        return FsdpSettings(), [
            "ModelParallelStrategy's fully_shard is applied by configure_model, after planning: the estimate "
            "assumes fully_shard on each repeated block and on the root, parameters kept in their dtype, "
            "reshard_after_forward=True and no CPU offload; for a MixedPrecisionPolicy, CPUOffloadPolicy or other "
            "wrapping, plan with `memplan suggest` and pass plan="]
    sharding = getattr(strategy.sharding_strategy, "name", str(strategy.sharding_strategy))
    if sharding not in SHARDING_STRATEGIES:
        raise MisconfigurationException(f"MemoryPlanner plans FSDPStrategy(sharding_strategy=...) "
                                        f"{', '.join(SHARDING_STRATEGIES)}, not {sharding}: plan with `memplan "
                                        "suggest` and pass plan=")
    offload = bool(getattr(strategy.cpu_offload, "offload_params", False))
    precision = strategy.mixed_precision_config  # the one given, else the one Lightning's precision implies
    dtypes = {value: name for name, value in DTYPES.items()}
    assumed = []
    if strategy.kwargs.get("auto_wrap_policy") is not None:
        assumed.append("FSDPStrategy(auto_wrap_policy=...) is not read: the estimate wraps the model's repeated "
                       "blocks")
    return FsdpSettings(
        sharding_strategy=sharding, cpu_offload=offload,
        shard_size=strategy.num_processes if sharding == "HYBRID_SHARD" else None,
        param_dtype=dtypes.get(getattr(precision, "param_dtype", None)),
        reduce_dtype=dtypes.get(getattr(precision, "reduce_dtype", None)),
    ), assumed


def _lightning_base(module: nn.Module) -> type | None:
    """The Lightning base class `module` derives from (pytorch_lightning's or lightning.pytorch's)."""
    return next((c for c in type(module).__mro__ if c.__name__ == "LightningModule"
                 and c.__module__.split(".")[0] in ("pytorch_lightning", "lightning")), None)


def with_settings(estimator: Callable[..., Any], settings: FsdpSettings) -> Callable[..., Any]:
    """The planner's estimator with every candidate traced under the strategy's own FSDP settings (the
    planner proposes sharding strategies; the Trainer's strategy has one already). A one-rank candidate
    too: MemoryPlanner plans the data-parallel ranks, and a ModelParallelStrategy whose data-parallel mesh
    has one rank still runs fully_shard over it (whole parameters, FSDP's all-gather and reduce-scatter
    buffers)."""

    def estimate_at(**kwargs: Any) -> Any:
        kwargs["fsdp"] = settings
        return estimator(**kwargs)

    return estimate_at


def plan_as_run(plan: Any, settings: FsdpSettings) -> Any:
    """A plan made under `with_settings`, naming the strategy's sharding and offload (the planner
    may have named another layout of the same traced memory)."""
    sharding = settings.sharding_strategy if settings.sharding_strategy != "NO_SHARD" else plan.sharding_strategy
    return dataclasses.replace(plan, sharding_strategy=sharding, cpu_offload=settings.cpu_offload)


def plan_in_subprocess(module: nn.Module, batch: Any, request: Any, settings: FsdpSettings, planner: Callable,
                       device: str | None, deterministic: Deterministic) -> Plan:
    """`planner(request, estimator)` in a Python process of its own (`python -m memplan.callback.fsdp_plan`:
    it imports the model's module, and never re-runs the training script), the estimator tracing
    `module`'s class rebuilt from its hparams on meta, FSDP candidates under `settings`, with deterministic
    algorithms as `deterministic` says (the training process's: that process's torch flags do not travel)."""
    import cloudpickle

    cls = type(module)
    # LightningCLI adds its own keys to hparams (_class_path, _instantiator): not __init__ arguments
    hparams = {k: v for k, v in dict(getattr(module, "hparams", {}) or {}).items() if not k.startswith("_")}
    try:  # (cloudpickle: what __main__ defines goes by value, everything importable by reference)
        job = cloudpickle.dumps((cls, hparams, batch, request, settings, planner, device, deterministic))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise MisconfigurationException(
            f"MemoryPlanner plans FSDP in a process of its own and cannot send it the model's hparams, the train "
            f"batch or MemoryPlanner(planner=...) ({err}): use a module-level planner function, or plan with "
            "`memplan suggest` and pass plan=") from None
    with tempfile.TemporaryDirectory(prefix="memplan-fsdp-plan-") as folder:
        result = Path(folder) / "result.pickle"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # where this process imports
        run = subprocess.run([sys.executable, "-m", "memplan.callback.fsdp_plan", str(result)], input=job, env=env,
                             capture_output=True, check=False)
        if run.returncode != 0 or not result.exists():
            raise RuntimeError(f"MemoryPlanner: planning FSDP in a process of its own failed (exit status "
                               f"{run.returncode}):\n{run.stderr.decode(errors='replace')[-3000:]}")
        planned, value = pickle.loads(result.read_bytes())
    if not planned:
        raise value
    return value


def _plan(cls: type, hparams: dict[str, Any], batch: Any, request: Any, settings: FsdpSettings, planner: Callable,
          device: str | None, deterministic: Deterministic) -> Plan:
    from memplan.planner import estimator_for

    try:
        with torch.device("meta"):
            model = cls(**hparams)
    except TypeError as err:
        raise MisconfigurationException(
            f"MemoryPlanner plans FSDP in a process of its own and rebuilds {cls.__qualname__} there from its "
            f"hparams {sorted(hparams)}, which failed ({err}): call self.save_hyperparameters() in its __init__, or "
            "plan with `memplan suggest CONFIG --output plan.json` and pass MemoryPlanner(plan='plan.json')") from None
    made = planner(request, with_settings(estimator_for(model, batch, device=device, deterministic=deterministic),
                                          settings))
    return plan_as_run(made, settings) if made.strategy == "fsdp" else made


def _main(result_path: str) -> None:
    """The planning process: the job pickled on stdin, (True, plan) or (False, the error) pickled to
    `result_path`; an error of another kind ends it with its traceback on stderr."""
    from memplan.estimator.errors import EstimateError

    job = pickle.loads(sys.stdin.buffer.read())
    try:
        outcome = (True, _plan(*job))
    except (MisconfigurationException, EstimateError, ValueError) as err:
        outcome = (False, err)
    Path(result_path).write_bytes(pickle.dumps(outcome))


if __name__ == "__main__":
    _main(sys.argv[1])
