"""Estimating: the peak memory of one training step, traced on fake tensors.

Each name is imported when first used (PEP 562): memplan.estimator.errors and .result import no torch, so a
command can catch an EstimateError, or a config can be refused, before torch is imported.
"""
import importlib

_LAZY = {
    "estimate": "memplan.estimator.api",
    "EstimateError": "memplan.estimator.errors",
    **dict.fromkeys(("PRECISIONS", "MemoryEstimate"), "memplan.estimator.result"),
}

__all__ = ["estimate", "EstimateError", "MemoryEstimate", "PRECISIONS"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'memplan.estimator' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
