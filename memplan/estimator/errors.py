"""The one error type for bad input to an estimate."""
from __future__ import annotations

from typing import Literal

Stage = Literal["build", "step"]
"""Where a model's failure happened: building it (its constructor / builder), or tracing its step."""


class EstimateError(ValueError):
    """Bad input to memplan.estimate, with the argument at fault and the fix in the message.

    Where another layer acts on the failure (a config names the YAML keys behind it), the parts are
    fields as well, so nothing reads them back out of the message:

        EstimateError(argument="batch", detail="the training step could not take this batch (...)",
                      fix="Pass the batch exactly as training_step receives it ...")

    renders as 'batch: the training step could not take this batch (...). Pass the batch ...'.
    """

    def __init__(self, message: str | None = None, *, argument: str | None = None, detail: str | None = None,
                 fix: str | None = None, stage: Stage | None = None, cause: str | None = None) -> None:
        if message is None:
            if argument is None or detail is None:
                raise TypeError("EstimateError needs a message, or an argument and a detail to render one from")
            message = f"{argument}: {detail}" + (f". {fix}" if fix else "")
        super().__init__(message)
        self.argument = argument
        """The estimate() argument at fault, as the caller wrote it: 'batch', 'model', 'loss', ... (None: not
        recorded; the message says it)."""
        self.detail = detail
        """What went wrong, in words, without the fix."""
        self.fix = fix
        """What to do about it, in words (None: the message has none)."""
        self.stage = stage
        """For argument='model': 'build' (the model could not be built) or 'step' (its training step failed)."""
        self.cause = cause
        """The user's own code's error, 'TypeError: ...', where the failure is theirs (None: none, or not recorded)."""


class NoRepeatedBlocks(EstimateError):
    """checkpointing= asks for memplan's own block checkpointing, and the model has no repeated blocks to wrap."""
