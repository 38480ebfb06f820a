"""The adjust policy: every rank's status gathered, and the decision every rank shares.

Readings are gathered from every rank with one collective, so each rank holds the same table and
`Adjuster.decide`, a pure function of that table and of state every rank keeps alike, gives every
rank the same answer.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from memplan.callback.collectives import gather_rows
from memplan.callback.layout import Layout
from memplan.hardware.readings import READING_FIELDS, MemoryReading
from memplan.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class RankStatus:
    """What one rank reports at a check: its reading and how it runs now."""

    rank: int
    """Global rank."""
    reading: MemoryReading
    """Its memory reading."""
    micro_batch_size: int
    """Its micro-batch now: below the shared one after it retried an OOM on its own."""
    gradient_checkpointing: bool
    """Whether checkpointing is on for it (an OOM at micro-batch 1 turns it on locally)."""
    oom_retries: int
    """OOMs it has recovered from since the run started."""
    oom_micro_batch_size: int | None = None
    """The smallest micro-batch that ran out of memory on it, if any did."""

    def to_row(self) -> list[float]:
        """Fixed-width numbers for the gather (float64 holds every byte count exactly; None is -1)."""
        values = [getattr(self.reading, name) for name in READING_FIELDS]
        row = [float(self.rank), *(-1.0 if v is None else float(v) for v in values)]
        failed = -1.0 if self.oom_micro_batch_size is None else float(self.oom_micro_batch_size)
        return [*row, float(self.micro_batch_size), float(self.gradient_checkpointing), float(self.oom_retries), failed]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> RankStatus:
        n = len(READING_FIELDS)
        reading = MemoryReading(**{name: None if v < 0 else int(v) for name, v in zip(READING_FIELDS, row[1:1 + n])})
        micro, checkpointing, ooms, failed = row[1 + n:]
        return cls(rank=int(row[0]), reading=reading, micro_batch_size=int(micro),
                   gradient_checkpointing=bool(checkpointing), oom_retries=int(ooms),
                   oom_micro_batch_size=None if failed < 0 else int(failed))


def gather_statuses(strategy: Any, status: RankStatus, world_size: int) -> tuple[RankStatus, ...]:
    """Every rank's status, in rank order, on every rank: one all-gather through the Trainer's strategy."""
    return tuple(RankStatus.from_row(row) for row in gather_rows(strategy, status.to_row(), world_size))


@dataclass(frozen=True, kw_only=True)
class Change:
    """A shared decision: the micro-batch and checkpointing every rank runs from the next step."""

    micro_batch_size: int
    """The new micro-batch."""
    gradient_checkpointing: bool
    """Checkpointing from now on."""
    cause: Literal["oom", "headroom", "grow"]
    """What triggered it: an OOM retried on some rank, headroom under the margin, or lasting headroom."""
    ranks: tuple[int, ...]
    """The ranks whose readings or OOMs triggered it (every rank, for growth)."""
    reason: str
    """The same, in words, for people reading the log."""


class Adjuster:
    """Decides, from every rank's status, whether all ranks lower or grow the micro-batch.

    Lower (about half, in even chunks of the loaded batch; at 1, turn checkpointing on) when its
    headroom is under `margin` x its device memory; after an OOM on some rank, every rank takes the
    size that rank went back to (the largest that ran there). Grow after `grow_patience` checks in a
    row where every rank has `grow_margin` x its memory free, by bisection between the size that runs
    and the smallest that ran out of memory (or the planned size, at most the loaded batch), only to a
    size that cuts the loaded batch into fewer even chunks: 8 x 2 for a batch of 16, never 15 + 1 or
    7 + 7 + 2. A size that ran out of memory is never grown back to. Checkpointing, once on, stays on.
    """

    def __init__(self, *, margin: float, grow: bool, grow_margin: float, grow_patience: int,
                 planned_micro_batch_size: int, can_checkpoint: bool,
                 can_split: Callable[[], bool] | None = None) -> None:
        self.margin = margin
        self.grow = grow
        self.grow_margin = grow_margin
        self.grow_patience = grow_patience
        self.planned_micro_batch_size = planned_micro_batch_size
        """The plan's micro-batch: growth goes back toward it, never above, nor above the loaded batch
        (`growth_cap`)."""
        self.can_checkpoint = can_checkpoint
        self._can_split = can_split or _yes
        """Whether the micro-batch may go below the loaded batch (memplan.callback.exactness, decided when
        first asked); else only checkpointing lowers memory."""
        self.calm_checks = 0
        """Checks in a row with room to grow."""
        self.ceiling: int | None = None
        """Smallest micro-batch that ran out of memory; growth stays below it."""
        self._ooms_seen: dict[int, int] = {}

    def decide(self, statuses: Sequence[RankStatus], layout: Layout) -> Change | None:
        """The change every rank makes from the shared `layout` they run now, or None. The micro-batches
        chosen cut the layout's loaded batch into even chunks."""
        micro_batch_size, checkpointing = layout.micro_batch_size, layout.gradient_checkpointing
        oom_ranks = tuple(s.rank for s in statuses if s.oom_retries > self._ooms_seen.get(s.rank, 0))
        self._ooms_seen = {s.rank: s.oom_retries for s in statuses}
        if oom_ranks:
            return self._after_ooms(statuses, oom_ranks, micro_batch_size, checkpointing)
        tight = tuple(s.rank for s in statuses if _fraction_free(s.reading) is not None and not self.has_margin(s.reading))
        if tight:
            self.calm_checks = 0
            return self._lower(statuses, tight, layout)
        roomy = all(self.roomy(s.reading) for s in statuses)
        self.calm_checks = self.calm_checks + 1 if roomy else 0
        if self.grow and self.calm_checks >= self.grow_patience:
            return self._grow(layout, tuple(s.rank for s in statuses))
        return None

    def roomy(self, reading: MemoryReading) -> bool:
        """Whether a reading shows `grow_margin` of the device free at its interval's peak: room to grow."""
        free = _fraction_free(reading)
        return free is not None and free >= self.grow_margin

    def has_margin(self, reading: MemoryReading) -> bool:
        """Whether a reading shows `margin` of the device free at its interval's peak (unknown: no)."""
        free = _fraction_free(reading)
        return free is not None and free >= self.margin

    def _after_ooms(self, statuses, ranks, micro_batch_size, checkpointing) -> Change | None:
        self.calm_checks = 0
        smallest = min(s.micro_batch_size for s in statuses)
        failed = [s.oom_micro_batch_size for s in statuses if s.oom_micro_batch_size is not None]
        self.ceiling = min([*failed, *([self.ceiling] if self.ceiling else [])], default=self.ceiling)
        checkpoint = checkpointing or any(s.gradient_checkpointing for s in statuses)
        if smallest == micro_batch_size and checkpoint == checkpointing:
            return None
        return Change(micro_batch_size=smallest, gradient_checkpointing=checkpoint, cause="oom", ranks=ranks,
                      reason=f"rank(s) {_ranks(ranks)} ran out of memory and retried with micro-batch {smallest}"
                             f"{' and checkpointing' if checkpoint and not checkpointing else ''}")

    def _lower(self, statuses, ranks, layout: Layout) -> Change | None:
        micro_batch_size, checkpointing = layout.micro_batch_size, layout.gradient_checkpointing
        worst = min((s for s in statuses if s.rank in ranks), key=lambda s: _fraction_free(s.reading))
        left = f"rank {worst.rank} has {format_bytes(worst.reading.headroom_bytes)} free at its peak, " \
               f"under the margin of {self.margin:.0%} of {format_bytes(worst.reading.device_total_bytes)}"
        smaller = smaller_micro_batch(micro_batch_size, layout.loader_batch_size)
        smaller = smaller if smaller is not None and self._can_split() else None
        if smaller is not None:
            return Change(micro_batch_size=smaller, gradient_checkpointing=checkpointing, cause="headroom",
                          ranks=ranks, reason=f"{left}: micro-batch {micro_batch_size} -> {smaller}")
        if self.can_checkpoint and not checkpointing:
            return Change(micro_batch_size=1, gradient_checkpointing=True, cause="headroom", ranks=ranks,
                          reason=f"{left}: at micro-batch 1, activation checkpointing on")
        return None

    def _grow(self, layout: Layout, ranks) -> Change | None:
        micro_batch_size, checkpointing = layout.micro_batch_size, layout.gradient_checkpointing
        larger = larger_micro_batch(micro_batch_size, self.growth_cap(layout), layout.loader_batch_size)
        if larger is None:
            return None
        self.calm_checks = 0
        return Change(micro_batch_size=larger, gradient_checkpointing=checkpointing, cause="grow", ranks=ranks,
                      reason=f"every rank has had {self.grow_margin:.0%} of its memory free for "
                             f"{self.grow_patience} checks: micro-batch {micro_batch_size} -> {larger}")

    def growth_cap(self, layout: Layout) -> int:
        """The largest micro-batch growth may reach from `layout`: the planned size, below the smallest that ran
        out of memory, and at most the loaded batch (a batch never runs in chunks larger than itself: a plan's
        micro-batch above the loader's batch is a size growth cannot reach, and bisecting toward it overshoots)."""
        cap = min(self.planned_micro_batch_size, layout.loader_batch_size)
        if self.ceiling is not None:
            cap = min(cap, self.ceiling - 1)
        return max(cap, 1)

    def state_dict(self) -> dict[str, int]:
        return {"calm_checks": self.calm_checks, "ceiling": self.ceiling or 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calm_checks = int(state.get("calm_checks", 0))
        self.ceiling = int(state.get("ceiling", 0)) or None


def _yes() -> bool:
    return True


def even_chunk(batch: int, chunks: int) -> int:
    """The micro-batch that cuts `batch` samples into `chunks` chunks as evenly as it can."""
    return -(-batch // chunks)


def smaller_or_even(batch: int, micro: int) -> int:
    """`micro` lowered to the even chunk of `batch` with as many chunks: 8 for 16 at 10 (2 chunks)."""
    return even_chunk(batch, -(-batch // micro))


def smaller_micro_batch(size: int, batch: int | None = None) -> int | None:
    """The next micro-batch to try below `size`, or None at 1: the largest even chunk of the loaded
    `batch` (when given) of at most half of `size`, e.g. 16 -> 8 -> 4, and 9 -> 3 (3 + 3 + 3, not 4 + 4 + 1)."""
    if size <= 1:
        return None
    half = size // 2
    return half if batch is None else even_chunk(batch, -(-batch // half))


def larger_micro_batch(size: int, cap: int, batch: int | None = None) -> int | None:
    """The next micro-batch to grow to from `size`, at most `cap` (the smallest size that ran out of
    memory, less one, or the planned size), or None: among the sizes that cut the loaded `batch` into
    fewer even chunks than `size` does, the one nearest halfway to `cap` (bisection). Without `batch`:
    double, at most `cap`."""
    if size >= cap:
        return None
    if batch is None:
        return min(2 * size, cap)
    chunks = -(-batch // size)
    larger = sorted({even_chunk(batch, k) for k in range(1, chunks)} & set(range(size + 1, cap + 1)))
    if not larger:
        return None
    middle = (size + cap) / 2
    return min(larger, key=lambda m: (abs(m - middle), m))


def _fraction_free(reading: MemoryReading) -> float | None:
    if reading.headroom_bytes is None or not reading.device_total_bytes:
        return None
    return reading.headroom_bytes / reading.device_total_bytes


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
