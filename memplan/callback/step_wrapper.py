"""A wrapper in place of a LightningModule's `training_step`: put there as an instance attribute (the class's
method, a user's override included, stays untouched), taken away, or stepped aside for a trace."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any


class StepWrapper:
    """Puts `self._training_step(args, kwargs)` (the subclass's) in place of the module's training_step (`wrap`)
    and takes it away (`remove`); the training_step it replaced is `_original`."""

    _module: Any

    _original: Callable[..., Any] | None = None
    """The module's training_step before `wrap` (None when not wrapped)."""
    _previous: Any = None
    """What the module's instance dict held under "training_step" before `wrap` (None: nothing)."""

    def wrap(self) -> None:
        self._previous = self._module.__dict__.get("training_step")
        original = self._module.training_step

        @functools.wraps(original)  # Lightning reads the signature (batch_idx or not) through __wrapped__
        def training_step(*args: Any, **kwargs: Any) -> Any:
            return self._training_step(args, kwargs)

        self._original = original
        self._module.training_step = training_step

    def _training_step(self, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def remove(self) -> None:
        if self._original is None:
            return
        if self._previous is None:
            self._module.__dict__.pop("training_step", None)
        else:
            self._module.training_step = self._previous
        self._original = None

    @contextlib.contextmanager
    def unwrapped(self) -> Iterator[None]:
        """The module's training_step as it was before `install`, for a trace of it (a fake copy of the
        module would otherwise call this runner, bound to the real module)."""
        wrapper = self._module.__dict__.get("training_step")
        if self._original is None or wrapper is None:
            yield
            return
        if self._previous is None:
            self._module.__dict__.pop("training_step", None)
        else:
            self._module.training_step = self._previous
        try:
            yield
        finally:
            self._module.training_step = wrapper
