"""Estimating: the peak memory of one training step, traced on fake tensors."""
from memplan.estimate.api import estimate
from memplan.estimate.errors import EstimateError
from memplan.estimate.result import PRECISIONS, MemoryEstimate

__all__ = ["estimate", "EstimateError", "MemoryEstimate", "PRECISIONS"]
