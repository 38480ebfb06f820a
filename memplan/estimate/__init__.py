"""Estimating: the peak memory of one training step, traced on fake tensors."""
from memplan.estimate.api import estimate
from memplan.estimate.fake import EstimateError
from memplan.estimate.result import PRECISIONS, MemoryEstimate

__all__ = ["estimate", "EstimateError", "MemoryEstimate", "PRECISIONS"]
