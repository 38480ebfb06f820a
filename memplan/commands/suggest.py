"""`memplan suggest`: from a config and the machine (or a named GPU) to a plan.

The glue between the config layer, the hardware readings and the pure planner: it decides which GPUs
and how much host RAM the plan may use, binds the estimator to the config's model and batch, and
renders the result. No planning logic lives here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Group
from rich.table import Table
from rich.text import Text

from memplan.config import LoadedConfig
from memplan.estimator.checkpointing import find_repeated_blocks
from memplan.estimator.fake import fake_model, new_fake_mode
from memplan.estimator.step import iter_tensors
from memplan.hardware import custom_gpu, host_info, lookup_gpu, visible_gpus
from memplan.commands.devices import OFF_BOX_HINT
from memplan.plan import Plan
from memplan.planner import DeviceBudget, HostLoad, PlanRequest, estimator_for, largest_block_bytes, make_plan
from memplan.planner.tracing import block_classes, tokens_per_sample
from memplan.planner.request import SEARCHED_PRECISIONS
from memplan.units import format_bytes


class NoDevice(ValueError):
    """No GPU to plan for: none visible, and none named."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """What the plan may use on each node."""

    devices: tuple[DeviceBudget, ...]
    """The GPUs of one node the job may use."""
    estimate_device: object
    """What memplan.estimate(device=...) gets: a GpuModel off-box, None for the local GPU."""
    host_available_bytes: int | None
    """Host RAM per node the ranks may use; None when planning off-box (this host is not the target)."""


def resolve_hardware(*, gpus: int | None, gpu: str | None, gpu_memory: str | None) -> Hardware:
    """Named GPUs (`--gpu H100-80GB` or `--gpu-memory 24GiB`, `--gpus` of them) or the local ones
    through NVML (the `--gpus` with the most free memory)."""
    if gpus is not None and gpus < 1:
        raise ValueError(f"--gpus must be a positive number of GPUs per node; got {gpus}")
    if gpu is not None and gpu_memory is not None:
        raise ValueError("--gpu and --gpu-memory name the same thing; pass one of them")
    if gpu is not None or gpu_memory is not None:
        model = lookup_gpu(gpu) if gpu is not None else custom_gpu(gpu_memory)
        return Hardware(devices=(DeviceBudget.from_catalog(model),) * (gpus or 1), estimate_device=model,
                        host_available_bytes=None)
    local = visible_gpus()
    if not local:
        raise NoDevice(f"no GPU is visible here. {OFF_BOX_HINT}")
    budgets = [DeviceBudget.from_gpu_info(info, cuda_index=i) for i, info in enumerate(local)]
    budgets.sort(key=lambda d: d.free_bytes, reverse=True)
    chosen = tuple(budgets[: gpus or len(budgets)])
    return Hardware(devices=chosen, estimate_device=None, host_available_bytes=host_info().budget_bytes)


def plan_config(
    loaded: LoadedConfig,
    hardware: Hardware,
    *,
    nodes: int = 1,
    global_batch_size: int | None = None,
    precisions: tuple[str, ...] | None = None,
    allow_checkpointing: bool | None = None,
    margin: float | None = None,
) -> Plan:
    """Plan the config on the hardware; flags override the config's `memplan:` section."""
    settings = loaded.settings
    wanted = tuple(precisions or settings.precisions)
    unsearched = [p for p in wanted if p not in SEARCHED_PRECISIONS]
    if unsearched:
        source = "--precision" if precisions else "memplan.precisions"
        raise ValueError(
            f"{source}: the planner searches {', '.join(SEARCHED_PRECISIONS)}; {', '.join(unsearched)} "
            "is not searched (estimate it with `memplan estimate CONFIG --precision ...`); remove it"
        )
    skeleton = fake_model(loaded.build_model, new_fake_mode(), device=torch.device("cpu"), param_dtype=torch.float32)
    has_blocks = bool(find_repeated_blocks(skeleton))
    allow = settings.allow_checkpointing if allow_checkpointing is None else allow_checkpointing
    base = loaded.example_batch(loaded.data_batch_size or 1)
    hints = loaded.loader
    request = PlanRequest(
        global_batch_size=global_batch_size or loaded.global_batch_size,
        devices=hardware.devices,
        nodes=nodes,
        host_available_bytes=hardware.host_available_bytes,
        host_load=HostLoad(
            model_init_bytes=sum(p.numel() * p.element_size() for p in skeleton.parameters()),
            sample_bytes=_sample_bytes(loaded),
            num_workers=hints.num_workers, prefetch_factor=hints.prefetch_factor, pin_memory=hints.pin_memory,
        ),
        precisions=wanted,
        allow_checkpointing=allow and has_blocks,
        margin=settings.margin if margin is None else margin,
        largest_block_bytes=largest_block_bytes(skeleton),
        parameter_count=sum(p.numel() for p in skeleton.parameters()) if has_blocks else None,
        tokens_per_sample=tokens_per_sample(base),
        block_classes=block_classes(skeleton),
    )
    estimator = estimator_for(loaded.build_model, base, optimizer=loaded.optimizer, device=hardware.estimate_device)
    with loaded.config_errors():
        return make_plan(request, estimator)


def _sample_bytes(loaded: LoadedConfig) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(loaded.example_batch(1)))


def render_plan(plan: Plan) -> Group:
    """The plan as a rich table, its reasons, and the alternatives weighed."""
    table = Table(title=f"memplan plan: {plan.gpu_name}", title_justify="left", show_header=False)
    table.add_column("setting")
    table.add_column("value")
    gpus = ", ".join(map(str, plan.gpus)) if plan.gpus else f"{plan.gpus_per_node} per node"
    rows = [
        ("GPUs", f"{plan.world_size} ({gpus}{f', {plan.nodes} nodes' if plan.nodes > 1 else ''})"),
        ("strategy", plan.strategy if plan.strategy != "fsdp" else
         f"fsdp ({plan.sharding_strategy}{', CPU offload' if plan.cpu_offload else ''})"),
        ("precision", plan.precision),
        ("micro-batch per GPU", str(plan.micro_batch_size)),
        ("gradient accumulation", str(plan.accumulate_grad_batches)),
        ("global batch", f"{plan.global_batch_size} = {plan.micro_batch_size} x {plan.world_size} x "
                         f"{plan.accumulate_grad_batches}"),
        ("gradient checkpointing", "on" if plan.gradient_checkpointing else "off"),
        ("predicted per-GPU peak", f"{format_bytes(plan.predicted_peak_bytes)} (NVML, context included)"),
        ("per-GPU budget", f"{format_bytes(plan.device_budget_bytes)} (free memory less the margin)"),
        ("headroom", format_bytes(plan.headroom_bytes)),
        ("host RAM per rank", format_bytes(plan.host_bytes_per_rank)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    parts: list = [table]
    if plan.reasons:
        parts.append(Text("Why: " + " ".join(plan.reasons)))
    if plan.alternatives:
        lines = ["Alternatives weighed (GPUs x micro-batch x accumulation, precision, checkpointing: "
                 "per-GPU peak, speed relative to the plan):"]
        for a in plan.alternatives:
            lines.append(
                f"  {a.world_size} x {a.micro_batch_size} x {a.accumulate_grad_batches}, {a.strategy}, {a.precision}, "
                f"checkpointing {'on' if a.gradient_checkpointing else 'off'}: "
                f"{format_bytes(a.predicted_peak_bytes)}, {a.relative_speed:.2f}x"
                f"{'' if a.fits or a.why_not else ', does not fit'}{f' - {a.why_not}' if a.why_not else ''}"
            )
        parts.append(Text("\n".join(lines)))
    return Group(*parts)
