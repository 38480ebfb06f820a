"""memplan: memory planning for distributed PyTorch Lightning training.

    import memplan
    est = memplan.estimate(model, batch, precision="bf16-mixed", device="A100-80GB")
    print(est)
"""
from memplan import analytic
from memplan.estimator import EstimateError, MemoryEstimate, estimate

__all__ = ["analytic", "estimate", "EstimateError", "MemoryEstimate"]
__version__ = "0.1.0"
