"""memplan: memory planning for distributed PyTorch Lightning training.

    import memplan
    est = memplan.estimate(model, batch, precision="bf16-mixed", device="A100-80GB")
    print(est)

Every public name is imported when first used (PEP 562), so `import memplan` (and `memplan --help`)
does not import torch; `memplan.estimate` imports it, `memplan.MemoryPlanner` also imports Lightning.
"""
import importlib

__all__ = ["analytic", "estimate", "EstimateError", "MemoryEstimate", "MemoryPlanner"]
__version__ = "0.1.0"

_LAZY = {
    "analytic": ("memplan.analytic", None),
    "estimate": ("memplan.estimator", "estimate"),
    "EstimateError": ("memplan.estimator", "EstimateError"),
    "MemoryEstimate": ("memplan.estimator", "MemoryEstimate"),
    "MemoryPlanner": ("memplan.callback", "MemoryPlanner"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'memplan' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
