"""The analytic estimate's result: the breakdown at the peak, and per-layer rows that explain it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memplan.units import format_bytes

OPTIMIZERS: tuple[str, ...] = ("sgd", "sgd-momentum", "adam", "adamw")
ANALYTIC_PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed")


@dataclass(frozen=True, kw_only=True)
class LayerRow:
    """One layer's share of the forward pass."""

    name: str
    """Position and spec, e.g. '0: Dense(100, True)'."""
    parameter_bytes: int
    """Its parameters and buffers (fp32)."""
    output_bytes: int
    """Its output activation for the whole batch."""
    saved_bytes: int
    """Bytes it newly saves for backward: tensors already saved by an earlier layer count there."""


@dataclass(frozen=True, kw_only=True)
class AnalyticEstimate:
    """Closed-form peak of one steady-state training step on CPU. Every figure is an int in bytes.

    The six components are what is live at the peak and add up to `peak_bytes`.
    """

    parameters: int
    """Parameters and buffers."""
    gradients: int
    """`.grad` tensors live at the peak (last step's during the forward, this step's after)."""
    optimizer_state: int
    """Momentum buffers, or Adam's exp_avg / exp_avg_sq and step counters."""
    activations: int
    """Tensors saved for backward, live at the peak."""
    temporaries: int
    """Everything else live at the peak: outputs in flight, activation gradients, bf16 copies, optimizer scratch."""
    batch: int
    """Inputs and targets."""
    peak_bytes: int
    """Peak of live tensor bytes over the step; the sum of the six components."""
    peak_phase: Literal["forward", "backward", "optimizer"]
    """Where the peak falls."""
    forward_peak_bytes: int
    """Highest point of the forward + loss (last step's gradients still live)."""
    backward_peak_bytes: int
    """Highest point of the backward."""
    optimizer_peak_bytes: int
    """Highest point of optimizer.step()."""
    per_layer: tuple[LayerRow, ...]
    """The forward pass layer by layer, then the loss; saved_bytes sums to saved_at_loss_bytes."""
    saved_at_loss_bytes: int
    """Everything saved for backward once the loss is computed (the activations at their largest)."""
    num_parameters: int
    """Parameter elements."""
    rule_of_thumb_bytes: int
    """The seeds' 4 B x (3 x params + 2 x activations x batch), activations counted as layer outputs."""
    batch_size: int
    """Samples per step."""
    optimizer: str
    """One of sgd, sgd-momentum, adam, adamw."""
    precision: str
    """'32-true' or 'bf16-mixed'."""

    def __str__(self) -> str:
        width = max(len(row.name) for row in self.per_layer)
        lines = [f"{'layer':<{width}}  {'params':>11}  {'output':>11}  {'saved':>11}"]
        for row in self.per_layer:
            lines.append(
                f"{row.name:<{width}}  {format_bytes(row.parameter_bytes):>11}  "
                f"{format_bytes(row.output_bytes):>11}  {format_bytes(row.saved_bytes):>11}"
            )
        lines.append("")
        for label in ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "batch"):
            lines.append(f"{label:<16} {format_bytes(getattr(self, label)):>11}")
        lines.append(f"{'peak':<16} {format_bytes(self.peak_bytes):>11}  (in {self.peak_phase}; forward "
                     f"{format_bytes(self.forward_peak_bytes)}, backward {format_bytes(self.backward_peak_bytes)}, "
                     f"optimizer {format_bytes(self.optimizer_peak_bytes)})")
        lines.append(f"{'rule of thumb':<16} {format_bytes(self.rule_of_thumb_bytes):>11}")
        return "\n".join(lines)
