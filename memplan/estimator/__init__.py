"""Estimating: the peak memory of one training step, traced on fake tensors.

Each name is imported when first used (PEP 562): memplan.estimator.errors and .result import no torch, so a
command can catch an EstimateError, or a config can be refused, before torch is imported.
"""
from memplan.lazy import lazy_exports

_LAZY = {
    "estimate": "memplan.estimator.api",
    "EstimateError": "memplan.estimator.errors",
    **dict.fromkeys(("PRECISIONS", "MemoryEstimate"), "memplan.estimator.result"),
}

__all__ = ["estimate", "EstimateError", "MemoryEstimate", "PRECISIONS"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
