"""MemoryPlanner, the Lightning callback: apply a plan, watch every rank's memory, keep the run fitting.

    layout.py    the per-rank layout of the global batch (loader batch, micro-batch, accumulation)
    apply.py     plan -> layout on the running Trainer; the planner's request when no plan is given
    chunking.py  micro-batch chunks inside training_step (each loss weighted as it reduces), and OOM retries
                 (chunk_job.py: what the runner and each chunk take and give; step_wrapper.py: the training_step
                 wrapper put in place and taken away; held_logging.py: `self.log` held until the batch succeeds)
    logged.py    a split batch's `self.log` calls merged into the whole batch's
    rewrites.py  the user's settings MemoryPlanner changes, said out loud (or refused under strict=True)
    checks.py    what MemoryPlanner refuses, with the fix
    framework.py the two Lightning packages (pytorch_lightning, lightning.pytorch) it works under
    adjust.py    every rank's status gathered, and the shared decision to lower or grow
    runlog.py    the per-rank JSON-lines log's schema and parser (what `memplan report` reads); rank_log.py
                 its writer; logger_rows.py the readings put into the Trainer's logger rows
    memory_planner.py  the callback: thin hooks over the above and memplan.hardware.readings
"""
import importlib

__all__ = ["Layout", "MemoryPlanner", "NothingFitsError"]
_HOMES = {"Layout": "memplan.callback.layout", "MemoryPlanner": "memplan.callback.memory_planner",
          "NothingFitsError": "memplan.callback.chunking"}


def __getattr__(name: str):  # Lightning is imported when these are asked for, not by `memplan report` (PEP 562)
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'memplan.callback' has no attribute {name!r}")
