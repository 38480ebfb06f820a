"""MemoryPlanner, the Lightning callback: apply a plan, watch every rank's memory, keep the run fitting.

    layout.py    the per-rank layout of the global batch (loader batch, micro-batch, accumulation)
    apply.py     plan -> layout on the running Trainer; the planner's request when no plan is given
    chunking.py  micro-batch chunks inside training_step (each loss weighted as it reduces), and OOM retries
    logged.py    a split batch's `self.log` calls merged into the whole batch's
    rewrites.py  the user's settings MemoryPlanner changes, said out loud (or refused under strict=True)
    checks.py    what MemoryPlanner refuses, with the fix
    framework.py the two Lightning packages (pytorch_lightning, lightning.pytorch) it works under
    memory_planner.py  the callback: thin hooks over the above and memplan.monitor
"""
from memplan.callback.chunking import NothingFitsError
from memplan.callback.layout import Layout
from memplan.callback.memory_planner import MemoryPlanner

__all__ = ["Layout", "MemoryPlanner", "NothingFitsError"]
