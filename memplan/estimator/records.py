"""What the storage tracker (memplan.estimator.tracker) counts: each storage's record, by category and phase."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Category(enum.Enum):
    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    BATCH = "batch"
    WORKSPACES = "workspaces"


class Phase(enum.Enum):
    SETUP = "setup"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass
class Record:
    """One counted storage (or a real tensor's and its fake conversion's: conversions.py)."""

    handle: int
    nbytes: int
    """Bytes as the memory model counts them (the allocator block size)."""
    category: Category
    phase: Phase
    live: bool = True
    node: int | None = None
    """The number of the autograd node whose backward made the storage (accumulation.RunningNode; None outside
    backward)."""
    storage_bytes: int = -1
    """The storage's own size when last counted: a sighting at another size means it was resized in place."""
    storages: int = 1
    """Storages counted under this record (a real tensor and its fake conversion: conversions.py); freed with the
    last."""


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Live bytes per category at one moment."""

    total: int
    by_category: dict[Category, int]
    phase: Phase
