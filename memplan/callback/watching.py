"""MemoryPlanner during and after training: a reading every few steps on every rank, a shared decision
(memplan.callback.adjust), each change applied on every rank, OOM retries recorded, the end-of-fit summary.

A mixin of MemoryPlanner (memplan.callback.memory_planner): it works on the callback's settings, its FitSession
and the plan and layout the callback exposes; the hooks there call it.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any


import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

from memplan.callback import mesh
from memplan.callback.chunking import NothingFitsError, OomRetry
from memplan.callback.adjust import Change, RankStatus, gather_statuses
from memplan.callback.collectives import gather_rows
from memplan.callback.rewrites import (
    checkpointing_rewrite, summary_lines,
)
from memplan.callback.oom_site import oom_site
from memplan.callback.session import CallbackState
from memplan.callback.sigterm import RankTerminated
from memplan.callback.layout import Layout
from memplan.callback.logger_rows import logger_metrics
from memplan.compat.lightning import writes_logger_row
from memplan.hardware import readings
from memplan.units import format_bytes

log = logging.getLogger("memplan.callback.memory_planner")  # (one logger for the callback's lines, as before)


class Watching(CallbackState):
    """Watching and adjusting (module docstring)."""

    def _maybe_check(self, trainer: pl.Trainer, batch: Any = None) -> None:
        """A reading every `every` steps, then a shared decision; recorded only: the first step, the
        step after a change, and each step Lightning writes a logger row (so every row has fresh
        figures). Every rank takes the same branch: the gather is a collective."""
        step = trainer.global_step
        if step == self._fit.last_step or self.layout is None:
            return
        due = step % self._fit.every == 0
        row = self._fit.has_loggers and writes_logger_row(trainer, self._fit.row_step())
        if not (due or row or self._fit.record_next):
            return
        self._fit.last_step, self._fit.record_next = step, False
        statuses = gather_statuses(trainer.strategy, self._status(trainer), trainer.world_size)
        self._record_sample(trainer, statuses[trainer.global_rank])
        if row:  # into Lightning's own row for this step (its loggers write from rank 0, which has all ranks)
            predicted = None if self.plan is None else self.plan.predicted_peak_bytes
            on_gpu = trainer.strategy.root_device.type == "cuda"
            self._fit.rows.add(logger_metrics(statuses, self.layout, predicted, on_gpu), self._fit.row_step(), trainer.loggers)
        if not self._fit.adjusting:
            return
        if not due:  # a reading between decisions still tells whether this layout fits
            self._update_guard(statuses[trainer.global_rank])
            return
        self._fit.batch_now = batch  # (for a first decision whether a split is exact; not kept past the check)
        try:
            change = self._fit.adjuster.decide(statuses, self.layout)
        finally:
            self._fit.batch_now = None
        if change is not None:
            self._apply_change(trainer, change)  # guards every rank: the new layout is untried
        else:
            self._update_guard(statuses[trainer.global_rank])

    def _update_guard(self, status: RankStatus) -> None:
        """Unguard this rank's backwards once a reading at the current layout shows the margin free
        and no OOM since the last check: those steps fit, and steps of the same shapes will. A change
        of layout guards it again (layout_changed), as does an OOM (memplan.callback.chunking)."""
        retried = status.oom_retries > self._fit.oom_retries_seen
        self._fit.oom_retries_seen = status.oom_retries
        self._fit.runner.guarded = self.settings.guard == "always" or retried or not self._fit.adjuster.has_margin(status.reading)

    def _status(self, trainer: pl.Trainer) -> RankStatus:
        return dataclasses.replace(self._status_without_reading(trainer),
                                   reading=readings.read_memory(trainer.strategy.root_device))

    def _status_without_reading(self, trainer: pl.Trainer) -> RankStatus:
        runner, layout = self._fit.runner, self.layout
        return RankStatus(
            rank=trainer.global_rank, reading=readings.MemoryReading(),
            micro_batch_size=runner.micro_batch_size if runner else layout.micro_batch_size,
            gradient_checkpointing=runner.gradient_checkpointing if runner else layout.gradient_checkpointing,
            oom_retries=runner.oom_retries if runner else 0,
            oom_micro_batch_size=runner.oom_micro_batch_size if runner else None,
        )

    def _record_sample(self, trainer: pl.Trainer, status: RankStatus) -> None:
        reading = status.reading
        self._fit.sampled = True
        peak = reading.process_bytes if reading.process_peak_bytes is None else reading.process_peak_bytes
        if peak is not None:
            self._fit.peak_process_bytes = max(peak, self._fit.peak_process_bytes or 0)
        if reading.headroom_bytes is not None:
            low = self._fit.min_headroom_bytes
            self._fit.min_headroom_bytes = reading.headroom_bytes if low is None else min(low, reading.headroom_bytes)
        self._fit.log.write("sample", trainer.global_step, **reading.to_dict(), **self._runs_as(status))

    def _runs_as(self, status: RankStatus) -> dict[str, Any]:
        layout = self.layout.with_micro_batch(status.micro_batch_size, status.gradient_checkpointing)
        return {"micro_batch_size": layout.micro_batch_size, "loader_batch_size": layout.loader_batch_size,
                "accumulate_grad_batches": layout.micro_batches_per_step,
                "trainer_accumulate_grad_batches": layout.accumulate_grad_batches,
                "gradient_checkpointing": layout.gradient_checkpointing,
                "global_batch_size": layout.global_batch_size, "oom_retries": status.oom_retries,
                "guarded": self._fit.runner.guarded if self._fit.runner is not None else None}

    def _apply_change(self, trainer: pl.Trainer, change: Change) -> None:
        before = self.layout
        self.layout = before.with_micro_batch(change.micro_batch_size, change.gradient_checkpointing)
        self._fit.runner.layout_changed()
        record = self._fit.log.write("change", trainer.global_step, cause=change.cause, ranks=list(change.ranks),
                                 reason=change.reason, before=before.to_dict(), after=self.layout.to_dict())
        self.changes.append(record)
        if self.layout.gradient_checkpointing and not before.gradient_checkpointing:
            self.rewrites.append(checkpointing_rewrite(trainer.global_step, change.reason))
            rank_zero_warn(f"MemoryPlanner changes {self.rewrites[-1].describe()}")
        self._fit.record_next = True  # the new layout's first step is recorded
        rank_zero_info(f"MemoryPlanner at step {trainer.global_step}: {change.reason}; now {self.layout.describe()}")

    def _record_retry(self, trainer: pl.Trainer, retry: OomRetry) -> None:
        reading = readings.read_memory(trainer.strategy.root_device, new_interval=False)
        self._fit.log.write("oom_retry", trainer.global_step, batch=trainer.fit_loop.epoch_loop.batch_idx,
                        phase=retry.phase, failed_micro_batch_size=retry.failed_micro_batch_size,
                        micro_batch_size=retry.micro_batch_size, gradient_checkpointing=retry.gradient_checkpointing,
                        error=retry.message, **reading.to_dict())
        log.warning("MemoryPlanner: rank %d ran out of memory at step %d in a %s of %d samples; retrying the same "
                    "samples with micro-batch %d%s", trainer.global_rank, trainer.global_step, retry.phase,
                    retry.failed_micro_batch_size, retry.micro_batch_size,
                    " and checkpointing" if retry.gradient_checkpointing else "")

    def _out_of_memory(self, trainer: pl.Trainer, message: str, size: int) -> NothingFitsError:
        reading = readings.read_memory(trainer.strategy.root_device, new_interval=False)
        checkpointing = self._fit.runner is not None and self._fit.runner.gradient_checkpointing
        self._fit.log.write("fatal", trainer.global_step, batch=trainer.fit_loop.epoch_loop.batch_idx,
                        micro_batch_size=size, gradient_checkpointing=checkpointing, error=message,
                        **reading.to_dict())
        return NothingFitsError(
            f"MemoryPlanner: rank {trainer.global_rank} ran out of memory at step {trainer.global_step} (batch "
            f"{trainer.fit_loop.epoch_loop.batch_idx}) with micro-batch {size}"
            f"{' and activation checkpointing on' if checkpointing else ''}, and "
            f"{'nothing smaller fits' if self.exactness is None or self.exactness.can_split else 'MemoryPlanner does not run it smaller: ' + self.exactness.no_split}. "
            f"{reading.describe()}. Use GPUs with more memory, more of them, a lower precision or shorter "
            f"samples. torch: {message}"
        )

    def _record_exception(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """An OOM MemoryPlanner did not raise itself happened outside the chunks it retries: log it,
        with the rank, the step and the memory figures. Then take the training_step wrapper off, as
        teardown would (Lightning skips it after an error)."""
        if self._fit is None:  # (before setup: nothing of this fit to record)
            return
        if self._fit.log is not None and isinstance(exception, torch.OutOfMemoryError) \
                and not isinstance(exception, NothingFitsError):
            reading = readings.read_memory(trainer.strategy.root_device, new_interval=False)
            site = oom_site(trainer, exception, lightning_backward=self._fit.runner is not None
                            and self._fit.runner.lightning_backward)
            self._fit.log.write("fatal", trainer.global_step, error=str(exception), where=site.where, fix=site.fix,
                                **reading.to_dict())
            log.error("MemoryPlanner: rank %d ran out of memory at step %d, %s, where MemoryPlanner does not retry. "
                      "%s. What can help: %s.", trainer.global_rank, trainer.global_step, site.where,
                      reading.describe(), site.fix)
        self._close(f"failed: {type(exception).__name__}: {str(exception)[:200]}",
                    signal=exception.signal_name if isinstance(exception, RankTerminated) else None)

    def _finish(self, trainer: pl.Trainer) -> None:
        """The last step's reading, when no check took it (every rank: a collective), then the summary."""
        if self.layout is None:
            return
        if trainer.global_step != self._fit.last_step or not self._fit.sampled:
            self._fit.last_step = trainer.global_step
            statuses = gather_statuses(trainer.strategy, self._status(trainer), trainer.world_size)
            self._record_sample(trainer, statuses[trainer.global_rank])
        self._summarize(trainer)

    def _summarize(self, trainer: pl.Trainer) -> None:
        """Every rank's peak, least headroom and how it ran at the end, gathered, printed on rank 0."""
        if self.layout is None:
            return
        status = self._status_without_reading(trainer)
        fallbacks = readings.reading_fallbacks(trainer.strategy.root_device)  # NVML lost mid-run, ...
        mine = [-1 if self._fit.peak_process_bytes is None else self._fit.peak_process_bytes,
                -1 if self._fit.min_headroom_bytes is None else self._fit.min_headroom_bytes,
                status.micro_batch_size, status.gradient_checkpointing, status.oom_retries, self._fit.log.dropped,
                readings.fallback_mask(fallbacks)]
        rows = gather_rows(trainer.strategy, [float(v) for v in mine], trainer.world_size)
        self._fit.log.write("summary", trainer.global_step, peak_process_bytes=self._fit.peak_process_bytes,
                        min_headroom_bytes=self._fit.min_headroom_bytes, oom_retries=status.oom_retries,
                        heavier_batches=self._fit.runner.heavier_batches if self._fit.runner is not None else 0,
                        dropped_lines=self._fit.log.dropped, layout=self.layout.to_dict(),
                        reading_fallbacks=list(fallbacks))
        lines = []
        for rank, (peak, low, micro, checkpointing, ooms, dropped, _) in enumerate(rows):
            runs = self.layout.with_micro_batch(int(micro), bool(checkpointing))
            lines.append(summary_line(rank, None if peak < 0 else int(peak), None if low < 0 else int(low), runs,
                                      int(ooms), int(dropped)))
        lines += readings.fallback_lines([int(row[-1]) for row in rows])
        repeated = mesh.repeated_work(trainer)
        if repeated is not None:  # (warned at setup; the summary is where the plan is stated)
            lines.append(repeated)
        rank_zero_info("MemoryPlanner summary:\n  " + "\n  ".join(lines + summary_lines(self.rewrites, self._fit.mismatches)))

    def _close(self, status: str, *, signal: str | None = None) -> None:
        """Close this rank's log with its `end` record: `status` ("finished" or the error that ended the fit) and
        `signal`, the name of the signal that ended it ('SIGTERM'; None: none)."""
        if self._fit is None:
            return
        if self._fit.apply_record is not None and self._fit.log is not None:  # ended before training started
            self._fit.log.write("apply", self._fit.last_step, **self._fit.apply_record)
            self._fit.apply_record = None
        self._fit.rows.remove()
        if self._fit.runner is not None:
            self._fit.runner.remove()
            self._fit.runner = None
        if self._fit.log is not None:
            rank_log, self._fit.log = self._fit.log, None
            rank_log.write("end", self._fit.last_step, status=status, signal=signal, dropped_lines=rank_log.dropped)
            rank_log.close()
            if rank_log.dropped:
                warnings.warn(f"MemoryPlanner: rank {rank_log.rank} could not write {rank_log.dropped} of "
                              f"{rank_log.dropped + rank_log.written} lines of its log {rank_log.path}", stacklevel=2)

    def _state_dict(self) -> dict[str, Any]:
        if self.layout is None or self._fit is None:
            return {}
        state = {**self.layout.to_dict(), "planned_micro_batch_size": self._fit.planned_micro_batch_size}
        if self._fit.adjuster is not None:
            state.update(self._fit.adjuster.state_dict())
        return state


def summary_line(rank: int, peak_process_bytes: int | None, min_headroom_bytes: int | None, runs: Layout,
                 oom_retries: int, dropped_lines: int = 0) -> str:
    """One rank's end-of-fit summary, for people: its peak, least headroom, how it ran at the end (`runs`)."""
    peak = "n/a" if peak_process_bytes is None else format_bytes(peak_process_bytes)
    headroom = "n/a" if min_headroom_bytes is None else format_bytes(min_headroom_bytes)
    dropped = f", {dropped_lines} log line(s) not written" if dropped_lines else ""
    return (f"rank {rank}: peak {peak} in this process, least headroom {headroom}, micro-batch "
            f"{runs.micro_batch_size} x {runs.micro_batches_per_step} per step"
            f"{', checkpointing' if runs.gradient_checkpointing else ''}, "
            f"{oom_retries} OOM retr{'y' if oom_retries == 1 else 'ies'}{dropped}")
