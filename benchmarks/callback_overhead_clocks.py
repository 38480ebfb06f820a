"""benchmarks.callback_overhead's clocks: a step clock over a fit, and OwnTime, which books the time a callback adds
inside that window (Lightning's dispatch of its hooks, its hooks' bodies, its training_step wrapper less the user's
work) by part and by step."""
from __future__ import annotations

import statistics
import time

import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.trainer import call

from memplan.callback import MemoryPlanner, chunking

WARMUP = 20
"""The first step a StepClock times (the steps before it warm the process)."""


class StepClock(Callback):
    """Mean wall time per step from step `start` (WARMUP) to the end of fit."""

    def __init__(self, start: int = WARMUP) -> None:
        self.start = self.end = 0.0
        self.first = self.steps = 0
        self.from_step = start
        self.timing = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.from_step and not self.timing:
            self.start, self.first, self.timing = time.perf_counter(), trainer.global_step, True

    def on_train_end(self, trainer, pl_module) -> None:
        self.end, self.steps = time.perf_counter(), trainer.global_step - self.first
        self.timing = False  # the end-of-fit summary is not a per-step cost

    @property
    def step_s(self) -> float:
        return (self.end - self.start) / self.steps


USER_PART = "the user's work inside the wrapper (subtracted)"


class OwnTime:
    """Time `target` adds inside the clock's window: Lightning's per-callback loop body for every hook
    (getattr, profiler context, the hook), MemoryPlanner's training_step wrapper less the user's work
    in it (training_step and the backward of each chunk), and Lightning's backward of the carrier.
    The other callbacks run first, `target` last."""

    def __init__(self, target: Callback, clock: StepClock) -> None:
        self.seconds = 0.0
        self.parts: dict[str, dict[int, float]] = {}
        """Seconds inside the clock's window by where they went and the global step they were booked at
        (`breakdown`); the user's work subtracted is booked negative, so the parts add up to `close()`."""
        self.per_step: dict[int, float] = {}
        """Own seconds by the global step they were booked at (a step's on_train_batch_end sees the next one's)."""
        self.carried_steps: set[int] = set()
        """The global steps whose training_step returned a carrier (guarded: every backward in training_step)."""
        self._trainer = None
        self._user = 0.0
        self._inside = False
        self._carried = False
        self._target, self._clock = target, clock
        self._original = call._call_callback_hooks
        call._call_callback_hooks = self._dispatch
        self._replay = chunking.replay_logged

    def _dispatch(self, trainer, hook_name, *args, monitoring_callbacks=None, **kwargs):
        everyone = trainer.callbacks
        trainer.callbacks = [c for c in everyone if c is not self._target]
        try:
            self._original(trainer, hook_name, *args, monitoring_callbacks=monitoring_callbacks, **kwargs)
        finally:
            trainer.callbacks = everyone
        if monitoring_callbacks:
            return
        self._trainer = trainer
        started = time.perf_counter()
        fn = getattr(self._target, hook_name)
        with trainer.profiler.profile(f"[Callback]{self._target.state_key}.{hook_name}"):
            fn(trainer, trainer.lightning_module, *args, **kwargs)
        if self._clock.timing:
            elapsed = time.perf_counter() - started
            self.seconds += elapsed
            self._book(f"hook {hook_name}", elapsed)
        if hook_name == "on_fit_start" and isinstance(self._target, MemoryPlanner):
            self._wrap_training_step(trainer.lightning_module)

    def _wrap_training_step(self, module) -> None:
        runner = self._target._fit.runner
        wrapper = module.training_step

        def inside_wrapper(*args, **kwargs):
            self._inside = True
            try:
                output = wrapper(*args, **kwargs)
            finally:
                self._inside = False
            loss = output if isinstance(output, torch.Tensor) else output.get("loss")
            self._carried = loss.grad_fn is not None and type(loss.grad_fn).__name__.startswith("_CarryGradients")
            if self._carried and self._clock.timing:
                self.carried_steps.add(self._trainer.global_step)
            return output

        def backward_seconds(seconds: float) -> None:
            # inside the wrapper: a chunk's backward, the user's work (timed in the wrapper: taken
            # out); outside it, Lightning's backward: of the carrier, which only hands the gradients
            # over (MemoryPlanner's: counted), or on an unguarded batch of the user's loss (neither)
            if self._inside:
                self._user += seconds
                self._book(USER_PART, -seconds)
            elif self._carried:
                self.seconds += seconds
                self._book("Lightning's backward of the carrier", seconds)

        runner._original = self._timed(runner._original, self._add_user)  # the user's training_step
        module.training_step = self._timed(inside_wrapper, self._add_wrapper)
        module.backward = self._timed(module.backward, backward_seconds)
        # the user's `self.log` calls, held during a chunk and made after it: the user's work
        chunking.replay_logged = self._timed(self._replay, self._add_user)

    def _timed(self, fn, book):
        """`fn`, with its wall time inside the clock's window passed to `book(seconds)`."""

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._clock.timing:
                    book(time.perf_counter() - started)

        return timed

    def _add_user(self, seconds: float) -> None:
        self._user += seconds
        self._book(USER_PART, -seconds)

    def _add_wrapper(self, seconds: float) -> None:
        self.seconds += seconds
        self._book("training_step wrapper", seconds)

    def _book(self, part: str, seconds: float) -> None:
        step = self._trainer.global_step if self._trainer is not None else -1
        by_step = self.parts.setdefault(part, {})
        by_step[step] = by_step.get(step, 0.0) + seconds
        self.per_step[step] = self.per_step.get(step, 0.0) + seconds

    def breakdown(self, steps: int, every: int) -> dict:
        """Own microseconds per step by part (the user's work subtracted booked negative; the wrapper net of it),
        mean and median over the steps (a loaded machine's preemptions land in the mean), and the same by kind of
        step: guarded (a carrier returned), reading (a multiple of `every`: the reading, the gather, the log line)
        and the rest."""
        parts = dict(self.parts)
        gross, user = parts.pop("training_step wrapper", {}), parts.pop(USER_PART, {})
        parts["training_step wrapper, net of the user's work"] = {k: v + user.get(k, 0.0) for k, v in gross.items()}

        def stats(values: list[float]) -> dict:
            return {"steps": len(values), "mean_us": statistics.mean(values) * 1e6 if values else None,
                    "median_us": statistics.median(values) * 1e6 if values else None,
                    "us_per_step_of_all": sum(values) / steps * 1e6}

        kinds: dict[str, list[float]] = {"guarded": [], "reading": [], "other": []}
        for step, seconds in self.per_step.items():
            kind = ("guarded" if step in self.carried_steps else
                    "reading" if step > 0 and step % every == 0 else "other")
            kinds[kind].append(seconds)
        return {"by_part": {k: stats(list(v.values()))
                            for k, v in sorted(parts.items(), key=lambda kv: -sum(kv[1].values()))},
                "by_kind_of_step": {k: stats(v) for k, v in kinds.items()}}

    def close(self) -> float:
        call._call_callback_hooks = self._original
        chunking.replay_logged = self._replay
        return self.seconds - self._user


