"""LightningCLI configs (class_path / init_args) with memplan's settings in the MemoryPlanner callback's
init_args (memplan.config.placement): load, plan, write.

    loaded = load_config("configs/gpt2-small.yaml")
    est = memplan.estimate(loaded.build_model, loaded.example_batch(8), device="A100-80GB")
    out = "gpt2.planned.yaml"
    write_planned_config(loaded, plan, out, callback=planner_callback(plan_path_for(out)))
    print(" ".join(torchrun_command(plan, "gpt2.planned.yaml")))
"""
from memplan.config.batch_spec import BatchSpec, TensorSpec, parse_batch_spec
from memplan.config.classes import ClassSpec
from memplan.config.errors import ConfigError
from memplan.config.launch import add_memplan_argument, torchrun_command
from memplan.config.load import LoadedConfig, LoaderHints, load_config
from memplan.config.settings import DEFAULT_PRECISIONS, MemplanSettings
from memplan.config.write import plan_path_for, planner_callback, write_planned_config

__all__ = [
    "BatchSpec", "ClassSpec", "ConfigError", "DEFAULT_PRECISIONS", "LoadedConfig", "LoaderHints", "MemplanSettings",
    "TensorSpec", "add_memplan_argument", "load_config", "parse_batch_spec", "plan_path_for", "planner_callback",
    "torchrun_command", "write_planned_config",
]
