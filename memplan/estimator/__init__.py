"""Estimating: the peak memory of one training step, traced on fake tensors."""
from memplan.estimator.api import estimate
from memplan.estimator.errors import EstimateError
from memplan.estimator.result import PRECISIONS, MemoryEstimate

__all__ = ["estimate", "EstimateError", "MemoryEstimate", "PRECISIONS"]
