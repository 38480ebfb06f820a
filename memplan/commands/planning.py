"""What `memplan suggest` plans with: from a config and the machine (or a named GPU) to a plan.

The glue between the config layer, the hardware readings and the pure planner: it decides which GPUs
and how much host RAM the plan may use, checks every input against them before anything is traced,
binds the estimator to the config's model and batch, and renders the result. No planning logic lives here.
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memplan.commands.device_table import OFF_BOX_HINT
from memplan.commands.progress import Progress
from memplan.compat.versions import check_installed_once
from memplan.config import LoadedConfig
from memplan.estimator.fake import fake_model, new_fake_mode
from memplan.batching import tensor_bytes
from memplan.hardware import GpuModel, host_info, nvml_unavailable_reason, visible_gpus
from memplan.hardware.nvml import answers, why_silent
from memplan.hardware.visible import visibility_problem
from memplan.plan import MAX_BATCH_SIZE, MAX_GPUS_PER_NODE, Plan, model_class_name, model_fingerprint
from memplan.planner import DeviceBudget, PlanRequest, estimator_for, make_plan
from memplan.planner.assemble import Asked, HostSide, request_for
from memplan.planner.reasons import Words
from memplan.planner.background import BackgroundEstimator, can_fork
from memplan.planner.request import SEARCHED_PRECISIONS
from memplan.units import GiB, TiB, format_bytes

MIN_GPU_BYTES = 1 * GiB
"""--gpu-memory below this is taken for a unit slip (24MB for 24GB): no GPU trains with less."""
MAX_GPU_BYTES = 2 * TiB
"""--gpu-memory above this is taken for a unit slip too."""
TYPICAL_TRACES = "usually 3-8"
"""How many traces a search takes (memplan.planner.search): progress says 'trace n (usually 3-8)'."""


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
    notes: tuple[str, ...] = ()
    """What the user should know about the GPUs (one that does not answer NVML, left out), in words."""


def resolve_hardware(*, gpus: int | None, gpu: GpuModel | str | None, gpu_memory: int | str | None) -> Hardware:
    """Named GPUs (`--gpu H100-80GB` or `--gpu-memory 24GiB`, `--gpus` of them) or the local ones
    through NVML (the `--gpus` with the most free memory). `--gpus` beyond what NVML sees is refused
    with both numbers."""
    from memplan.hardware import custom_gpu, lookup_gpu
    from memplan.units import parse_size

    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS_PER_NODE):
        raise ValueError(f"--gpus must be a number of GPUs per node from 1 to {MAX_GPUS_PER_NODE}; got {gpus!r}")
    if gpu is not None and gpu_memory is not None:
        raise ValueError("--gpu and --gpu-memory name the same thing; pass one of them")
    if gpu is not None or gpu_memory is not None:
        if gpu is not None:
            model = gpu if isinstance(gpu, GpuModel) else lookup_gpu(gpu)
        else:
            size = gpu_memory if isinstance(gpu_memory, int) else parse_size(gpu_memory)
            if not MIN_GPU_BYTES <= size <= MAX_GPU_BYTES:
                raise ValueError(f"--gpu-memory {format_bytes(size)} is outside what a GPU has "
                                 f"({format_bytes(MIN_GPU_BYTES)} to {format_bytes(MAX_GPU_BYTES)}); check the unit, "
                                 "e.g. 24GiB")
            model = custom_gpu(size)
        return Hardware(devices=(DeviceBudget.from_catalog(model),) * (gpus or 1), estimate_device=model,
                        host_available_bytes=None)
    local = visible_gpus()
    if not local:
        why = visibility_problem() or nvml_unavailable_reason() or "NVML works but lists no GPU"
        raise NoDevice(f"no GPU is visible here: {why}. {OFF_BOX_HINT}")
    silent = [(i, g) for i, g in enumerate(local) if not answers(g)]
    named = "; ".join(f"cuda:{i} (NVML index {g.index}, {g.name}): {why_silent(g)}" for i, g in silent)
    answering = [(i, g) for i, g in enumerate(local) if answers(g)]
    if not answering:
        raise NoDevice(f"no visible GPU answers NVML: {named}. Check `nvidia-smi`. {OFF_BOX_HINT}")
    if gpus is not None and gpus > len(answering):
        left_out = f", and {len(silent)} more that do not answer ({named})" if silent else ""
        raise ValueError(f"--gpus {gpus}: this node has {len(answering)} GPU(s) visible to NVML{left_out} (see "
                         f"`memplan devices`); pass --gpus {len(answering)} or fewer, or plan for other machines with "
                         f"--gpu NAME --gpus {gpus}")
    budgets = []
    for i, info in answering:
        try:
            budgets.append(DeviceBudget.from_gpu_info(info, cuda_index=i))
        except ValueError as err:  # no compute capability and a board memplan does not know
            silent.append((i, info))
            named = "; ".join(f"cuda:{j} (NVML index {g.index}, {g.name}): {why_silent(g) if not answers(g) else err}"
                              for j, g in silent)
    if not budgets:
        raise NoDevice(f"no visible GPU can be planned for: {named}. {OFF_BOX_HINT}")
    budgets.sort(key=lambda d: d.free_bytes, reverse=True)
    chosen = tuple(budgets[: gpus or len(budgets)])
    notes = (f"left out of the plan: {named}; planning on the {len(budgets)} GPU(s) that answer",) if silent else ()
    return Hardware(devices=chosen, estimate_device=None, host_available_bytes=host_info().budget_bytes, notes=notes)


@dataclass(frozen=True, kw_only=True)
class Wanted:
    """What the user asks of the plan, each with the name it came from (a flag or a YAML key)."""

    global_batch_size: int
    """Samples per optimizer step over all ranks."""
    global_batch_source: str
    """Where it came from: '--global-batch-size', the global_batch_size setting's key or the trainer keys."""
    precisions: tuple[str, ...]
    """Precisions the planner may choose."""
    precisions_source: str
    """'--precision' or the precisions setting's key."""
    allow_checkpointing: bool
    """Whether checkpointing may be turned on (before asking whether the model has blocks to checkpoint)."""
    checkpointing_source: str
    """'--no-checkpointing' or the allow_checkpointing setting's key."""
    margin: float
    """Fraction of each GPU's free memory kept unused."""


def check_request(loaded: LoadedConfig, hardware: Hardware, *, nodes: int = 1, global_batch_size: int | None = None,
                  precisions: tuple[str, ...] | None = None, allow_checkpointing: bool | None = None,
                  margin: float | None = None) -> Wanted:
    """Every check that needs no trace: flags over the config's memplan settings, the global batch against
    the GPUs and nodes. Raises ValueError naming the flag or YAML key."""
    settings = loaded.settings
    wanted = Wanted(
        global_batch_size=global_batch_size or loaded.global_batch_size,
        global_batch_source=("--global-batch-size" if global_batch_size else settings.key("global_batch_size")
                             if settings.global_batch_size is not None else "the config's own global batch "
                             "(batch size x trainer.devices x trainer.num_nodes x trainer.accumulate_grad_batches)"),
        precisions=tuple(precisions or settings.precisions),
        precisions_source="--precision" if precisions else settings.key("precisions"),
        allow_checkpointing=settings.allow_checkpointing if allow_checkpointing is None else allow_checkpointing,
        checkpointing_source=("--no-checkpointing" if allow_checkpointing is False
                              else settings.key("allow_checkpointing")),
        margin=settings.margin if margin is None else margin,
    )
    unsearched = [p for p in wanted.precisions if p not in SEARCHED_PRECISIONS]
    if unsearched:
        raise ValueError(
            f"{wanted.precisions_source}: the planner searches {', '.join(SEARCHED_PRECISIONS)}; "
            f"{', '.join(unsearched)} is not searched (estimate it with `memplan estimate CONFIG --precision ...`); "
            "remove it")
    if wanted.precisions == ("bf16-mixed",) and not any(d.bf16_supported for d in hardware.devices):
        raise ValueError(f"{wanted.precisions_source}: bf16-mixed needs compute capability 8.0+, which "
                         f"{hardware.devices[0].name} lacks; allow 16-mixed too")
    gbs, per_node = wanted.global_batch_size, len(hardware.devices)
    if gbs > MAX_BATCH_SIZE:
        raise ValueError(f"{wanted.global_batch_source}: a global batch of {gbs:,} samples is more than the "
                         f"{MAX_BATCH_SIZE:,} memplan plans for; check it")
    loaded.loader  # noqa: B018  (its ranges, before any trace)
    if per_node * nodes > gbs:
        raise ValueError(f"--gpus {per_node} x --nodes {nodes} = {per_node * nodes} ranks, more than the global batch "
                         f"of {gbs} ({wanted.global_batch_source}): each rank needs at least one sample. Use at most "
                         f"{gbs} ranks, or a larger global batch")
    if gbs % nodes:
        raise ValueError(f"{wanted.global_batch_source} ({gbs}) must be divisible by --nodes {nodes} (every node "
                         f"runs the same number of ranks); use a multiple of {nodes}")
    return wanted


def with_deterministic(loaded: LoadedConfig, deterministic: bool | str | None) -> LoadedConfig:
    """`loaded` with trainer.deterministic set to `deterministic` (--deterministic), unchanged for None."""
    if deterministic is None:
        return loaded
    trainer = {**loaded.trainer, "deterministic": deterministic}  # the planned config (--output) writes it too
    raw = {**loaded.raw, "trainer": {**(loaded.raw.get("trainer") or {}), "deterministic": deterministic}}
    return dataclasses.replace(loaded, trainer=trainer, raw=raw)


def plan_config(
    loaded: LoadedConfig,
    hardware: Hardware,
    *,
    nodes: int = 1,
    global_batch_size: int | None = None,
    precisions: tuple[str, ...] | None = None,
    allow_checkpointing: bool | None = None,
    margin: float | None = None,
    progress: Progress | None = None,
) -> Plan:
    """Plan the config on the hardware; flags override the config's memplan settings. Everything that
    needs no trace is checked first (check_request). Deterministic algorithms: the config's trainer.deterministic
    (`with_deterministic` puts --deterministic there)."""
    progress = progress or Progress(enabled=False)
    for outside in check_installed_once("memplan"):  # said once, here, not by each estimate
        progress.clear()
        print(f"memplan: warning: {outside}", file=sys.stderr)
    wanted = check_request(loaded, hardware, nodes=nodes, global_batch_size=global_batch_size,
                           precisions=precisions, allow_checkpointing=allow_checkpointing, margin=margin)
    model_name = loaded.model.cls.__name__
    progress.say(f"building {model_name} on fake tensors (no weight allocated)")
    with loaded.config_errors():  # a model that cannot be built is model.init_args' fault, named as such
        skeleton = fake_model(loaded.build_model, new_fake_mode(), device=torch.device("cpu"),
                              param_dtype=torch.float32)
    progress.say("reading batches" + (f" from {loaded.settings.key('batch_spec')}" if loaded.settings.batch_spec is not None
                                        else f" from {loaded.data.cls.__name__}" if loaded.data is not None else ""))
    base = loaded.example_batch(loaded.data_batch_size or 1)
    request = request_of(loaded, hardware, wanted, skeleton, nodes=nodes)
    estimator = estimator_for(loaded.build_model, base, optimizer=loaded.optimizer, device=hardware.estimate_device,
                              deterministic=loaded.trainer_deterministic)
    if isinstance(hardware.estimate_device, GpuModel) and can_fork():  # fake tensors only: safe to fork
        estimator = BackgroundEstimator(estimator)
    try:  # (the plan's account and NoFit speak of the flags and keys: the request's words)
        with loaded.config_errors():
            plan = make_plan(request, _announced(estimator, model_name, progress))
    finally:
        progress.clear()
    reasons = plan.reasons
    if loaded.planned_for is not None:  # which batch of the loader the figures are for (memplan.shapes)
        reasons = (*reasons, f"{_upper_first(loaded.planned_for)}.")
    return dataclasses.replace(plan, reasons=reasons, gpu_total_bytes=hardware.devices[0].total_bytes,
                               model_class=model_class_name(skeleton), model_fingerprint=model_fingerprint(skeleton))


def request_of(loaded: LoadedConfig, hardware: Hardware, wanted: Wanted, skeleton: Any, *, nodes: int = 1) -> PlanRequest:
    """The planner's request for this config (memplan.planner.request_for, as MemoryPlanner's): `skeleton`, the
    config's model built on fake tensors; a batch of one sample from the config; the host's loader settings."""
    hints = loaded.loader
    asked = Asked(global_batch_size=wanted.global_batch_size, precisions=wanted.precisions,
                  allow_checkpointing=wanted.allow_checkpointing, margin=wanted.margin, words=words_of(wanted))
    one = loaded.example_batch(1)
    host = HostSide(available_bytes=hardware.host_available_bytes, num_workers=hints.num_workers,
                    sample_bytes=tensor_bytes(one),
                    prefetch_factor=hints.prefetch_factor, pin_memory=hints.pin_memory)
    return request_for(skeleton, one, asked=asked, devices=hardware.devices, nodes=nodes,
                       host=host, optimizer=loaded.optimizer)


def _setting(checkpointing) -> str:
    """'off', 'on' (full) or a setting's text form ('op', 'blocks:4')."""
    return {False: "off", True: "on"}.get(checkpointing, str(checkpointing)) if isinstance(checkpointing, bool) \
        else str(checkpointing)


def _announced(estimator: Callable[..., Any], model_name: str, progress: Progress) -> Callable[..., Any]:
    """The estimator, saying on the progress line what each trace is (its `prefetch` and `cancel`,
    where it has them, passed through: planner/background.py)."""
    count = 0

    def estimate_at(*, micro_batch_size: int, precision: str, checkpointing, world_size: int, fsdp=None):
        nonlocal count
        count += 1
        kind = "DDP" if fsdp is None else f"FSDP {fsdp.sharding_strategy}"
        ranks = "1 rank" if world_size == 1 else f"{kind}, {world_size} ranks"
        progress.say(f"tracing {model_name}: trace {count} ({TYPICAL_TRACES}), micro-batch {micro_batch_size}, "
                     f"{precision}, checkpointing {_setting(checkpointing)}, {ranks}")
        return estimator(micro_batch_size=micro_batch_size, precision=precision, checkpointing=checkpointing,
                         world_size=world_size, fsdp=fsdp)

    for name in ("prefetch", "cancel"):
        if hasattr(estimator, name):
            setattr(estimate_at, name, getattr(estimator, name))
    return estimate_at


def words_of(wanted: Wanted) -> Words:
    """The flags and YAML keys the user gave, as the plan's account and NoFit name them."""
    flag = wanted.checkpointing_source == "--no-checkpointing"
    return Words(
        allow_amp=f"allowing bf16-mixed or 16-mixed ({wanted.precisions_source})",
        allow_checkpointing="allowing activation checkpointing (drop --no-checkpointing)" if flag
        else f"allowing activation checkpointing ({wanted.checkpointing_source}: true)",
        checkpointing_refused="--no-checkpointing was given" if flag else f"{wanted.checkpointing_source} is false")


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]

