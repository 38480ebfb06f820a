"""Live-byte bookkeeping for the closed-form walk.

A `Buf` stands for one tensor storage: bytes and a reference count. References are held by the
program (a variable still in scope), by autograd nodes (a tensor saved for backward) or by the model
(`.grad`, optimizer state). `Tape` adds a storage's bytes when it is allocated and removes them when
its last reference goes, and remembers the breakdown at the highest point. Nothing here runs torch:
the layer rules in `rules.py` decide what is allocated, saved and released, in the order torch does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["parameters", "gradients", "optimizer_state", "batch", "activation"]
Phase = Literal["forward", "backward", "optimizer"]


@dataclass(eq=False)
class Buf:
    """One storage in the walk."""

    nbytes: int
    """Size of the storage."""
    kind: Kind = "activation"
    """Which bucket of the breakdown it belongs to; 'activation' splits into saved vs temporary."""
    refs: int = 1
    """References holding it alive (starts at 1: the program that allocated it)."""
    saves: int = 0
    """How many of those references are autograd nodes (saved for backward)."""


@dataclass(frozen=True, kw_only=True)
class TapePeak:
    """What was live at one moment, by bucket, in bytes."""

    parameters: int
    """Parameters and buffers."""
    gradients: int
    """`.grad` tensors."""
    optimizer_state: int
    """Optimizer state tensors."""
    batch: int
    """Inputs and targets."""
    activations: int
    """Activation storages saved for backward."""
    temporaries: int
    """Other activation storages: outputs in flight, gradients of activations, casts, scratch."""
    phase: Phase
    """The phase the moment belongs to."""

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_state + self.batch
                + self.activations + self.temporaries)


@dataclass
class Tape:
    """Running live bytes, per bucket, with the peak and the breakdown at the peak."""

    phase: Phase = "forward"
    """The phase being walked."""
    live: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("parameters", "gradients", "optimizer_state", "batch", "activation", "saved"), 0))
    """Live bytes per kind; 'saved' is the part of 'activation' that autograd nodes hold."""
    peak: TapePeak | None = None
    """The breakdown at the highest total so far (the first moment it was reached)."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Highest total per phase."""
    _at_peak: bool = False
    """Nothing was allocated or freed since the peak: saves made now belong to the peak moment (an op's
    outputs exist before autograd saves them, but both happen before the next op)."""

    def enter(self, phase: Phase) -> None:
        """Start a phase; what is live as it starts counts toward its peak."""
        self.phase = phase
        self._check()

    # -- allocation --------------------------------------------------------------------------------
    def new(self, nbytes: int, kind: Kind = "activation") -> Buf:
        """Allocate a storage held once by the program, and check the peak."""
        buf = Buf(nbytes=int(nbytes), kind=kind)
        self.live[kind] += buf.nbytes
        self._at_peak = False
        self._check()
        return buf

    def ref(self, buf: Buf | None) -> Buf | None:
        """One more reference to an existing storage (a view, a second variable)."""
        if buf is not None:
            buf.refs += 1
        return buf

    def drop(self, *bufs: Buf | None) -> None:
        """Release one reference each; a storage whose last reference goes is freed."""
        for buf in bufs:
            if buf is None:
                continue
            buf.refs -= 1
            if buf.refs == 0:
                self.live[buf.kind] -= buf.nbytes
                self._at_peak = False

    def adopt(self, buf: Buf, kind: Kind) -> Buf:
        """Move a storage to another bucket (AccumulateGrad stealing a gradient buffer as .grad)."""
        self.live[buf.kind] -= buf.nbytes
        self.live[kind] += buf.nbytes
        buf.kind = kind
        return buf

    # -- autograd ----------------------------------------------------------------------------------
    def save(self, *bufs: Buf | None) -> tuple[Buf, ...]:
        """An autograd node saves these for backward; returns them for `release`."""
        saved = tuple(b for b in bufs if b is not None)
        for buf in saved:
            if buf.kind == "activation" and buf.saves == 0:
                self.live["saved"] += buf.nbytes
            buf.saves += 1
            buf.refs += 1
        if self._at_peak:
            self._snapshot()
        return saved

    def release(self, saved: tuple[Buf, ...]) -> None:
        """The node ran (retain_graph=False): its saved tensors are released."""
        for buf in saved:
            buf.saves -= 1
            if buf.kind == "activation" and buf.saves == 0:
                self.live["saved"] -= buf.nbytes
            self.drop(buf)

    # -- accounting --------------------------------------------------------------------------------
    def saved_bytes(self) -> int:
        """Bytes of activation storages currently saved for backward."""
        return self.live["saved"]

    def total(self) -> int:
        live = self.live
        return (live["parameters"] + live["gradients"] + live["optimizer_state"] + live["batch"]
                + live["activation"])

    def _check(self) -> None:
        total = self.total()
        if total > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = total
        if self.peak is not None and total <= self.peak.total:
            return
        self._snapshot()

    def _snapshot(self) -> None:
        self._at_peak = True
        live = self.live
        self.peak = TapePeak(
            parameters=live["parameters"],
            gradients=live["gradients"],
            optimizer_state=live["optimizer_state"],
            batch=live["batch"],
            activations=live["saved"],
            temporaries=live["activation"] - live["saved"],
            phase=self.phase,
        )
