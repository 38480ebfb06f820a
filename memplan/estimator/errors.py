"""The one error type for bad input to an estimate."""


class EstimateError(ValueError):
    """Bad input to memplan.estimate, with the argument at fault and the fix in the message."""
