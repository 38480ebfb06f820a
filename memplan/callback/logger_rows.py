"""memplan's rows for the Trainer's loggers: every rank's readings (gathered) as `memplan/...` metrics, put
into the row Lightning writes for the same step."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from memplan.units import GiB

if TYPE_CHECKING:
    from memplan.callback.adjust import RankStatus
    from memplan.callback.layout import Layout


METRIC_FIELDS = ("process", "device_used", "peak", "headroom")
"""Per-rank readings sent to the Trainer's loggers, as memplan/rank<R>/<name>_gib."""


def logger_metrics(statuses: Sequence[RankStatus], layout: Layout, predicted_peak_bytes: int | None,
                   on_gpu: bool = True) -> dict[str, float]:
    """Every rank's readings for the Trainer's loggers, sizes in GiB with the unit in the key:
    memplan/rank<R>/process_gib (this process on its device), device_used_gib, peak_gib (the process's
    peak in the interval), headroom_gib; and the plan's per-device prediction at its micro-batch. On a
    GPU that is memplan/predicted_peak_gib, comparable with peak_gib. On CPU the readings are the
    process's resident memory (Python, libraries, allocator caches: hundreds of MiB before any tensor)
    while the prediction counts the step's tensors, so it is logged as
    memplan/predicted_tensor_peak_gib, a name nobody reads against the process's figures."""
    metrics: dict[str, float] = {
        "memplan/micro_batch_size": float(layout.micro_batch_size),
        "memplan/micro_batches_per_step": float(layout.micro_batches_per_step),
        "memplan/gradient_checkpointing": float(layout.gradient_checkpointing),
    }
    if predicted_peak_bytes is not None:
        key = "memplan/predicted_peak_gib" if on_gpu else "memplan/predicted_tensor_peak_gib"
        metrics[key] = predicted_peak_bytes / GiB
    for status in statuses:
        reading = status.reading
        values = (reading.process_bytes, reading.device_used_bytes, reading.process_peak_bytes, reading.headroom_bytes)
        for name, value in zip(METRIC_FIELDS, values):
            if value is not None:
                metrics[f"memplan/rank{status.rank}/{name}_gib"] = value / GiB
        metrics[f"memplan/rank{status.rank}/oom_retries"] = float(status.oom_retries)
    return metrics


class LoggerRows:
    """memplan's metrics inside the row Lightning writes for the same step, one row per step.

    Lightning writes a step's row with one `log_metrics(metrics, step)` call per logger, after the
    batch-end hooks. `add` keeps memplan's metrics for that step; each logger's `log_metrics`, wrapped
    by `install` (an attribute on the logger object, removed by `remove`), adds them to the first call
    for that step. This costs a dict merge, where `LightningModule.log` costs ~100 us a metric. A
    logger whose attribute cannot be set gets memplan's metrics in a call of their own.
    """

    def __init__(self) -> None:
        self._pending: tuple[int, dict[str, float], set[int]] | None = None
        self._wrapped: list[tuple[Any, Any]] = []

    def install(self, loggers: Sequence[Any]) -> None:
        for logger in loggers:
            own = vars(logger).get("log_metrics") if hasattr(logger, "__dict__") else None
            original = logger.log_metrics

            def log_metrics(metrics: dict[str, float], step: int | None = None, *, _logger=logger,
                            _original=original) -> Any:
                return _original(self._with_pending(_logger, metrics, step), step)

            try:
                logger.log_metrics = log_metrics
            except AttributeError:  # __slots__ or a read-only attribute: add() calls it directly
                continue
            self._wrapped.append((logger, own))

    def add(self, metrics: dict[str, float], step: int, loggers: Sequence[Any]) -> None:
        """memplan's metrics for the row Lightning writes at `step` (its step index)."""
        self._pending = (step, metrics, set())
        wrapped = {id(logger) for logger, _ in self._wrapped}
        for logger in loggers:
            if id(logger) not in wrapped:
                logger.log_metrics(metrics, step=step)

    def _with_pending(self, logger: Any, metrics: dict[str, float], step: int | None) -> dict[str, float]:
        pending = self._pending
        if pending is None or pending[0] != step or id(logger) in pending[2]:
            return metrics
        pending[2].add(id(logger))
        return {**metrics, **pending[1]}

    def remove(self) -> None:
        for logger, own in self._wrapped:
            if own is None:
                del logger.log_metrics
            else:
                logger.log_metrics = own
        self._wrapped, self._pending = [], None
