"""The private attribute of torchmetrics (Lightning's metrics package) that memplan reads.

Nothing here imports torchmetrics: a model holds its Metric objects, and memplan only looks at them.
"""
from __future__ import annotations

from typing import Any


def metric_defaults(metric: Any) -> dict[str, Any]:
    """`Metric._defaults` (torchmetrics 1.0-1.9): each state's name and initial value (a tensor, or a
    list for list states), which `reset()` copies back. The dict itself: writing to it sets a default."""
    return metric._defaults
