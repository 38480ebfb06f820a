"""memplan: memory planning for distributed PyTorch Lightning training.

    import memplan
    est = memplan.estimate(model, batch, precision="bf16-mixed", device="A100-80GB")
    print(est)
"""
from memplan import analytic
from memplan.estimator import EstimateError, MemoryEstimate, estimate

__all__ = ["analytic", "estimate", "EstimateError", "MemoryEstimate", "MemoryPlanner"]
__version__ = "0.1.0"


def __getattr__(name: str):  # MemoryPlanner imports Lightning (~2 s): only when asked for (PEP 562)
    if name == "MemoryPlanner":
        from memplan.callback import MemoryPlanner

        return MemoryPlanner
    raise AttributeError(f"module 'memplan' has no attribute {name!r}")
