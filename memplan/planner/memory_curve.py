"""One group's memory curve: per-rank device bytes by micro-batch, from the traces made so far (a line
through the largest two, or the sibling group's slope), predicted between and beyond them with slack."""
from __future__ import annotations

from dataclasses import dataclass, field

from memplan.estimator.result import MemoryEstimate
from memplan.units import MiB


SAFETY_BYTES = 32 * MiB
"""Added to every predicted (not traced) figure: the caching allocator rounds large blocks to
2 MiB and carves mid-size ones from 20 MiB segments, so a line between traces can be off by that."""
EXTRAPOLATION_SLACK = 0.02
"""Extra fraction of the predicted growth beyond the largest traced micro-batch."""


@dataclass
class MemoryCurve:
    """One group's per-rank device bytes (NCCL buffers excluded) by micro-batch: traced points,
    a line through the largest two, or the sibling group's slope."""

    points: dict[int, int] = field(default_factory=dict)
    """micro-batch -> device_total - communication, the largest seen."""
    activation_growth: dict[int, int] = field(default_factory=dict)
    """micro-batch -> forward_activations + batch (grows with the micro-batch whatever the peak)."""
    phase_peaks: dict[int, dict[str, int]] = field(default_factory=dict)
    """micro-batch -> the trace's peak allocated bytes in each phase of the step."""
    reserved: dict[int, tuple[int, int]] = field(default_factory=dict)
    """micro-batch -> the trace's peak (allocated, reserved) bytes."""
    has_communication: bool = False
    """Whether the estimator reports NCCL buffers (a CUDA target with DDP)."""
    siblings: tuple[MemoryCurve, ...] = ()
    """The same precision and checkpointing at the other world kind, whose slope this one may reuse."""

    def add(self, micro: int, est: MemoryEstimate) -> None:
        self.points[micro] = max(self.points.get(micro, 0), est.device_total - est.communication)
        self.activation_growth[micro] = est.forward_activations + est.batch
        self.phase_peaks[micro] = dict(est.peak_allocated_by_phase)
        self.reserved[micro] = (est.peak_allocated, est.peak_reserved)
        self.has_communication |= est.communication > 0

    def own_slope(self) -> float | None:
        """Bytes per sample from this curve's two largest traces; None with fewer than two."""
        if len(self.points) < 2:
            return None
        lo, hi = sorted(self.points)[-2:]
        chord = (self.points[hi] - self.points[lo]) / (hi - lo)
        growth = (self.activation_growth[hi] - self.activation_growth[lo]) / (hi - lo)
        # the peak is the largest of the phases' peaks, each about linear in the micro-batch: the
        # steepest phase holds it at larger micro-batches, even where another holds it here. Its
        # allocated bytes are scaled to reserved ones: the allocator's segments grew by this much per
        # allocated byte between the two traces (never less than one)
        (alloc_lo, reserved_lo), (alloc_hi, reserved_hi) = self.reserved[lo], self.reserved[hi]
        scale = max(1.0, (reserved_hi - reserved_lo) / (alloc_hi - alloc_lo)) if alloc_hi > alloc_lo else 1.0
        phases = [scale * (self.phase_peaks[hi][name] - self.phase_peaks[lo][name]) / (hi - lo)
                  for name in self.phase_peaks[hi].keys() & self.phase_peaks[lo].keys()]
        return max(chord, growth, *phases, 0.0)

    def sibling_slope(self) -> float | None:
        """The first sibling's own slope, None when no sibling has two traces."""
        return next((s for s in (c.own_slope() for c in self.siblings) if s is not None), None)

    def slope(self) -> float:
        own = self.own_slope()
        if own is None:
            own = self.sibling_slope()
        return own or 0.0

    def predict(self, micro: int) -> int:
        """Traced value where traced; else interpolated between traces or extrapolated, plus slack."""
        known = sorted(self.points)
        if micro in self.points:
            return self.points[micro]
        below = [b for b in known if b < micro]
        above = [b for b in known if b > micro]
        if not below:  # memory grows with the micro-batch: the next trace bounds it
            return self.points[above[0]]
        lo = below[-1]
        if above:
            hi = above[0]
            value = self.points[lo] + (self.points[hi] - self.points[lo]) * (micro - lo) / (hi - lo)
            return int(value) + SAFETY_BYTES
        growth = self.slope() * (micro - lo)
        return int(self.points[lo] + growth * (1 + EXTRAPOLATION_SLACK)) + SAFETY_BYTES
