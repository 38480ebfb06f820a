"""The estimate as a breakdown table, with the seeds' rules of thumb beside what they miss."""
from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from memplan.units import format_bytes

if TYPE_CHECKING:  # the estimate renders itself through this module (MemoryEstimate.__str__, __rich__)
    from memplan.estimator.result import MemoryEstimate


def _rule_terms(est: MemoryEstimate) -> dict[str, int | None]:
    """The seeds' rule '4 bytes x (3 x params + 2 x activations x batch)', term by term: fp32 weights,
    fp32 gradients, one optimizer copy, and twice the activations."""
    weights = 4 * est.num_parameters
    return {
        "parameters": weights,
        "gradients": weights,
        "optimizer_state": weights,
        "activations": 2 * est.forward_activations,
    }


def render_table(est: MemoryEstimate) -> Table:
    title = (
        f"memplan estimate: {est.device}, {est.precision}"
        f"{', checkpointing' if est.checkpointing else ''}"
        f"{f', DDP x{est.world_size}' if est.strategy == 'ddp' else ''}"
        f"{f', batch {est.batch_size}' if est.batch_size is not None else ''}"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("component")
    table.add_column("memplan", justify="right")
    table.add_column("share", justify="right")
    table.add_column("rule of thumb", justify="right")
    table.add_column("rule misses", justify="right")
    rule = _rule_terms(est)
    peak = max(est.peak_allocated, 1)
    rows = [
        ("parameters", est.parameters), ("gradients", est.gradients),
        ("optimizer_state", est.optimizer_state), ("activations", est.activations),
        ("temporaries", est.temporaries), ("batch", est.batch), ("workspaces", est.workspaces),
    ]
    for name, value in rows:
        if name == "workspaces" and value == 0:
            continue
        seed = rule.get(name)
        table.add_row(
            name.replace("_", " "), format_bytes(value), f"{100 * value / peak:.1f}%",
            format_bytes(seed) if seed is not None else "-",
            format_bytes(value - seed) if seed is not None else format_bytes(value),
        )
    rule_total = sum(v for v in rule.values() if v is not None)
    table.add_section()
    table.add_row(
        f"peak allocated (at {est.peak_phase})", format_bytes(est.peak_allocated), "100.0%",
        format_bytes(rule_total), format_bytes(est.peak_allocated - rule_total), style="bold",
    )
    if est.peak_reserved != est.peak_allocated:
        table.add_row("peak reserved (caching allocator)", format_bytes(est.peak_reserved), "", "", "")
    if est.cuda_context:
        table.add_row("CUDA context", format_bytes(est.cuda_context), "", "", "")
    if est.communication:
        table.add_row("NCCL buffers", format_bytes(est.communication), "", "", "")
    if est.device_total != est.peak_allocated:
        table.add_row("device total (as NVML shows)", format_bytes(est.device_total), "", "", "", style="bold")
    caption = [
        f"{est.num_parameters:,} parameters; {format_bytes(est.forward_activations)} saved for backward at the "
        f"end of the forward; traced in {est.trace_seconds:.1f} s"
    ]
    caption.append("rule of thumb: 4 bytes x (3 x parameters + 2 x activations), i.e. fp32 weights, gradients and "
                   "one optimizer copy, and activations counted twice; 'rule misses' is memplan minus the rule")
    four_x = 16 * est.num_parameters
    caption.append(
        f"rule '4 x model size' says {format_bytes(four_x)} "
        f"({_relative(four_x, est.peak_allocated)} vs memplan's peak allocated)"
    )
    caption.extend(est.notes)
    table.caption = "\n".join(caption)
    table.caption_justify = "left"
    return table


def _relative(value: int, reference: int) -> str:
    if reference <= 0:
        return "n/a"
    return f"{100 * (value - reference) / reference:+.0f}%"


def render_text(est: MemoryEstimate, width: int = 100) -> str:
    """The table as plain text (for str(estimate) and logs)."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, soft_wrap=False).print(render_table(est))
    return buffer.getvalue().rstrip()
