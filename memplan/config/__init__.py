"""LightningCLI configs (class_path / init_args) with memplan's settings in the MemoryPlanner callback's
init_args (memplan.config.placement): load, plan, write.

    loaded = load_config("configs/gpt2-small.yaml")
    est = memplan.estimate(loaded.build_model, loaded.example_batch(8), device="A100-80GB")
    out = "gpt2.planned.yaml"
    write_planned_config(loaded, plan, out, callback=planner_callback(plan_path_for(out)))
    print(" ".join(torchrun_command(plan, "gpt2.planned.yaml")))

Each name is imported when first used (PEP 562): `memplan.config.load_config` imports neither torch nor
Lightning until a config passes memplan's own checks (a refused YAML or setting costs no torch import).
"""
from memplan.lazy import lazy_exports

_LAZY = {
    **dict.fromkeys(("BatchSpec", "TensorSpec", "parse_batch_spec"), "memplan.config.batch_spec"),
    "ClassSpec": "memplan.config.classes",
    "ConfigError": "memplan.config.errors",
    **dict.fromkeys(("add_memplan_argument", "torchrun_command"), "memplan.config.launch"),
    **dict.fromkeys(("LoadedConfig", "LoaderHints", "load_config"), "memplan.config.load"),
    **dict.fromkeys(("DEFAULT_PRECISIONS", "MemplanSettings"), "memplan.config.settings"),
    **dict.fromkeys(("plan_path_for", "planner_callback", "write_planned_config"), "memplan.config.write"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
