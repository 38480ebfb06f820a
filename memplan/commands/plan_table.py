"""What `memplan suggest` prints: the user's config before -> after the plan, the plan, why, and the
alternatives weighed. Rich renderables; bytes formatted here only."""
from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from memplan.config.write import is_ddp_strategy
from memplan.plan import Plan
from memplan.units import format_bytes


def device_word(plan: Plan) -> str:
    """'GPU' for a GPU plan, 'device' for a plan made for CPU ranks (the callback on a CPU-only machine)."""
    return "device" if plan.gpu_name.lower() == "cpu" else "GPU"


def changes_table(loaded: Any, plan: Plan) -> Table:
    """The user's config, before -> after: each trainer / batch setting the planned config changes."""
    trainer = loaded.trainer
    found = loaded.batch_size_arg
    batch_key = f"{found[0]}.init_args.{found[1]}" if found else "batch size"
    local = plan.nodes == 1 and len(plan.gpus) == plan.gpus_per_node
    own_global = _own_global_batch(loaded)
    rows = [
        ("trainer.devices", _show(trainer.get("devices", "auto")), _show(list(plan.gpus) if local else plan.gpus_per_node)),
        ("trainer.num_nodes", _show(trainer.get("num_nodes", 1)), _show(plan.nodes)),
        ("trainer.precision", loaded.trainer_precision or "32-true (default)", plan.precision),
        (batch_key, _show(loaded.data_batch_size), _show(plan.micro_batch_size)),
        ("trainer.accumulate_grad_batches", _show(loaded.accumulate_grad_batches), _show(plan.accumulate_grad_batches)),
        ("global batch", _show(own_global), _show(plan.global_batch_size)),
        ("activation checkpointing", "off" if plan.user_checkpointing is None else "the model's own",
         _checkpointing_after(plan)),
        ("trainer.strategy", _show(trainer.get("strategy", "auto")),
         _show(trainer.get("strategy")) if plan.strategy == "ddp" and is_ddp_strategy(trainer.get("strategy"))
         else plan.strategy),
    ]
    table = Table(title=f"Changes to {loaded.path}", title_justify="left")
    table.add_column("setting", no_wrap=True)
    table.add_column("before")
    table.add_column("after")
    for key, before, after in rows:
        changed = before != after
        table.add_row(key, Text(before), Text(after, style="bold" if changed else ""), style=None if changed else "dim")
    return table


def _checkpointing_after(plan: Plan) -> str:
    """The plan's checkpointing for people: 'off', 'on (by MemoryPlanner)', 'op: selective (per-op)
    checkpointing (by MemoryPlanner)', or the model's own, kept."""
    if plan.user_checkpointing is not None:
        return f"the model's own, kept ({plan.user_checkpointing})"
    setting = plan.checkpointing
    if not setting:
        return "off"
    if setting.mode == "full":
        return "on (by MemoryPlanner)"
    return f"{setting}: {setting.describe()} (by MemoryPlanner)"


def render_plan(plan: Plan, loaded: Any = None) -> Group:
    """The plan as a rich table (after the before -> after table of `loaded`, when given), its reasons,
    and the alternatives weighed."""
    word = device_word(plan)
    table = Table(title=f"memplan plan: {plan.gpu_name}", title_justify="left", show_header=False)
    table.add_column("setting")
    table.add_column("value")
    gpus = ", ".join(map(str, plan.gpus)) if plan.gpus else f"{plan.gpus_per_node} per node"
    rows = [
        (f"{word}s", f"{plan.world_size} ({gpus}{f', {plan.nodes} nodes' if plan.nodes > 1 else ''})"),
        ("strategy", plan.strategy if plan.strategy != "fsdp" else
         f"fsdp ({plan.sharding_strategy}{', CPU offload' if plan.cpu_offload else ''})"),
        ("precision", plan.precision),
        (f"micro-batch per {word}", str(plan.micro_batch_size)),
        ("gradient accumulation", str(plan.accumulate_grad_batches)),
        ("global batch", f"{plan.global_batch_size} = {plan.micro_batch_size} x {plan.world_size} x "
                         f"{plan.accumulate_grad_batches}"),
        ("gradient checkpointing", _checkpointing_after(plan).removesuffix(" (by MemoryPlanner)")),
        (f"predicted per-{word} peak", format_bytes(plan.predicted_peak_bytes)
         + (" (NVML, context included)" if word == "GPU" else "")),
        (f"per-{word} budget", f"{format_bytes(plan.device_budget_bytes)} (free memory less the margin)"),
        ("headroom", format_bytes(plan.headroom_bytes)),
        ("host RAM per rank", format_bytes(plan.host_bytes_per_rank)),
    ]
    if plan.predicted_step_seconds is not None and word == "GPU":
        rows += [
            ("predicted step time", f"{format_seconds(plan.predicted_step_seconds)} per optimizer step on {plan.gpu_name}"),
            ("predicted throughput", _throughput(plan.samples_per_s, plan.tokens_per_s)),
            ("predicted MFU", f"{plan.mfu:.0%} (of the {plan.precision} dense peak)"),
        ]
    for name, value in rows:
        table.add_row(name, Text(value))
    parts: list = [] if loaded is None else [changes_table(loaded, plan)]
    parts.append(table)
    if plan.speed_reason and word == "GPU":
        parts.append(Text("Fastest: " + plan.speed_reason, style="bold"))
    if plan.reasons:
        parts.append(Text("Why: " + " ".join(plan.reasons)))
    if plan.alternatives:
        speed = "predicted step time, throughput and MFU" if word == "GPU" else "speed relative to the plan"
        lines = [f"Alternatives weighed ({word}s x micro-batch x accumulation, precision, checkpointing: "
                 f"per-{word} peak, {speed}):"]
        for a in plan.alternatives:
            lines.append(
                f"  {a.world_size} x {a.micro_batch_size} x {a.accumulate_grad_batches}, {a.strategy}, {a.precision}, "
                f"checkpointing {a.checkpointing or ('on' if a.gradient_checkpointing else 'off')}: "
                f"{format_bytes(a.predicted_peak_bytes)}, {_speed(a, word)}"
                f"{'' if a.fits or a.why_not else ', does not fit'}{f' - {a.why_not}' if a.why_not else ''}"
            )
        parts.append(Text("\n".join(lines)))
    return Group(*parts)


def format_seconds(seconds: float) -> str:
    """'412 ms', '3.2 s', '85 us'."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def _rate(value: float) -> str:
    """12300 -> '12.3k', 4.56e6 -> '4.56M'."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def _throughput(samples_per_s: float | None, tokens_per_s: float | None) -> str:
    if samples_per_s is None:
        return "not predicted"
    text = f"{_rate(samples_per_s)} samples/s"
    return f"{_rate(tokens_per_s)} tokens/s ({text})" if tokens_per_s is not None else text


def _speed(a: Any, word: str) -> str:
    """An alternative's predicted step time, throughput and MFU (relative speed on CPU ranks)."""
    if a.predicted_step_seconds is None or word != "GPU":
        return f"{a.relative_speed:.2f}x"
    rate = f"{_rate(a.tokens_per_s)} tokens/s" if a.tokens_per_s is not None else f"{_rate(a.samples_per_s)} samples/s"
    return f"{format_seconds(a.predicted_step_seconds)}/step, {rate}, MFU {a.mfu:.0%} ({a.relative_speed:.2f}x)"


def _own_global_batch(loaded: Any) -> int | None:
    if loaded.data_batch_size is None or loaded.trainer_world_size is None:
        return None
    return loaded.data_batch_size * loaded.trainer_world_size * loaded.accumulate_grad_batches


def _show(value: Any) -> str:
    return "not set" if value is None else str(value)


