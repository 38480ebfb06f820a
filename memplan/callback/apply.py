"""Apply: turn a plan (given, or made now from an estimate) into the running Trainer's layout.

The batch size is set the way Lightning's BatchSizeFinder sets it (`lightning_setattr` on the
model, its hparams or the datamodule), so the train loader the fit loop builds next has it; where
the model has no such attribute the loader's batch is kept and split into micro-batches instead.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from pytorch_lightning.utilities.parsing import lightning_getattr, lightning_setattr
from torch import nn

from memplan import compat
from memplan.callback.framework import COMBINED_LOADERS, MisconfigurationException
from memplan.callback.layout import Layout, loaded_batch_size
from memplan.callback.mesh import data_parallel_nodes
from memplan.callback.plan_file import find_plan_file
from memplan.callback.rewrites import checkpointing_is_on
from memplan.checkpoint_setting import Checkpointing
from memplan.estimator.checkpointing import apply_checkpointing, find_repeated_blocks
from memplan.hardware import gpu_for_cuda_index, host_info, match_nvml_name
from memplan.hardware.nvml import answers as nvml_answers
from memplan.hardware.readings import cuda_device_facts, cuda_free_bytes
from memplan.plan import Plan, model_class_name, model_fingerprint
from memplan.planner import DeviceBudget, PlanRequest
from memplan.planner.assemble import Asked, HostSide, request_for
from memplan.planner.request import SEARCHED_PRECISIONS

CPU_CAPABILITY = (8, 0)
"""DeviceBudget needs a compute capability; a CPU has none. (8, 0) admits every precision a CPU runs
(bf16 autocast included); with the precision fixed to the Trainer's it changes no ranking."""


def check_planned_precision(precision: str) -> None:
    """A Trainer precision the planner searches, else MisconfigurationException with the way out."""
    if precision not in SEARCHED_PRECISIONS:
        raise MisconfigurationException(
            f"MemoryPlanner plans for precision {', '.join(SEARCHED_PRECISIONS)}; the Trainer runs {precision!r}: "
            "estimate it with `memplan estimate` and pass plan=, or use one of those precisions")


def planning_request(module: nn.Module, batch: Any, budgets: Sequence[DeviceBudget], *, nodes: int, asked: Asked,
                     host: HostSide | None, data_parallel: int | None = None) -> PlanRequest:
    """The memplan.planner request for this Trainer (memplan.planner.request_for, as `memplan suggest`'s): `asked`
    holds its precision only, its global batch, and DDP (or one device) unless the strategy is FSDP; the devices
    of one node, each the tightest of its local index over the nodes (`budgets`: every rank's, in rank order).

    `data_parallel`: the ranks that train different samples (memplan.callback.mesh), where fewer than the
    ranks: the planner sees that many ranks (on `mesh.data_parallel_nodes` nodes), each the tightest of all,
    since every rank of a data-parallel rank's group holds what it holds; and each the host RAM of its group."""
    check_planned_precision(asked.precisions[0])
    if data_parallel is not None and data_parallel < len(budgets):
        tightest = min(budgets, key=lambda b: b.free_bytes)
        ranks_per_node, planned_nodes = len(budgets) // nodes, data_parallel_nodes(data_parallel, nodes)
        per_node = data_parallel // planned_nodes
        if host is not None and host.available_bytes is not None:  # the node's RAM, shared by all its ranks
            host = dataclasses.replace(host, available_bytes=host.available_bytes * per_node // ranks_per_node)
        return request_for(module, batch, asked=asked, devices=(tightest,) * per_node, nodes=planned_nodes, host=host)
    per_node = len(budgets) // nodes
    devices = tuple(
        DeviceBudget(name=b.name, cuda_index=b.cuda_index, total_bytes=b.total_bytes,
                     free_bytes=min(o.free_bytes for o in budgets[i::per_node]), compute_capability=b.compute_capability)
        for i, b in enumerate(budgets[:per_node])
    )
    return request_for(module, batch, asked=asked, devices=devices, nodes=nodes, host=host)


def host_side(loader: Any, sample_bytes: int) -> HostSide:
    """This host for the planner: the RAM its ranks may use, and what the train `loader` costs each rank."""
    return HostSide(available_bytes=host_info().budget_bytes, sample_bytes=sample_bytes,
                    num_workers=getattr(loader, "num_workers", 0) or 0,
                    prefetch_factor=getattr(loader, "prefetch_factor", None) or 2,
                    pin_memory=bool(getattr(loader, "pin_memory", False)))


def device_budget(device: torch.device, local_world_size: int) -> DeviceBudget:
    """This rank's DeviceBudget: its GPU through NVML (through CUDA where NVML is unavailable), or on
    CPU the host's RAM (within the container's limit), the available part shared by the node's ranks."""
    if device.type != "cuda":
        host = host_info()
        total = host.total_bytes if host.cgroup_limit_bytes is None else min(host.total_bytes, host.cgroup_limit_bytes)
        return DeviceBudget(name="cpu", cuda_index=None, total_bytes=total,
                            free_bytes=min(total, host.budget_bytes // max(1, local_world_size)),
                            compute_capability=CPU_CAPABILITY)
    facts = cuda_device_facts(device)
    gpu = gpu_for_cuda_index(facts.index)
    if gpu is not None and nvml_answers(gpu):  # (NVML's 0-byte total or a missing figure: CUDA's instead)
        return DeviceBudget.from_gpu_info(gpu, cuda_index=facts.index)
    free, total = cuda_free_bytes(device)
    return DeviceBudget(name=facts.name, cuda_index=facts.index, total_bytes=total, free_bytes=free,
                        compute_capability=facts.compute_capability)


def load_plan(plan: Plan | str | os.PathLike) -> Plan:
    """A Plan object as is, or a plan JSON file (`memplan suggest --output planned.yaml` writes
    planned.plan.json beside it): a relative path is looked for beside the config given on the
    command line first, then in the working directory."""
    if isinstance(plan, Plan):
        return plan
    from memplan.files import PLAN_MAX_BYTES, FileTooLarge, NotAFile, read_bounded

    name = f"MemoryPlanner(plan={str(plan)!r}):"
    path, looked = find_plan_file(plan)  # a relative path: beside the config first (memplan.callback.plan_file)
    try:  # a regular file of a plan's size at most: a FIFO or /dev/zero is refused, not read forever
        data = json.loads(read_bounded(path, limit_bytes=PLAN_MAX_BYTES, name=name).decode("utf-8"))
    except FileNotFoundError:
        where = f" (looked for {' and '.join(str(p.absolute()) for p in looked)})" if len(looked) > 1 else ""
        raise MisconfigurationException(f"{name} no such file{where}; a planned config names its plan relative to "
                                        "its own folder: keep the two together, or write a plan with "
                                        "`memplan suggest ... --output planned.yaml`") from None
    except (NotAFile, FileTooLarge) as err:
        raise MisconfigurationException(str(err)) from None
    except json.JSONDecodeError as err:
        raise MisconfigurationException(f"MemoryPlanner(plan={str(plan)!r}) is not JSON ({err}); pass the file "
                                        "`memplan suggest` wrote") from None
    except (OSError, UnicodeDecodeError) as err:
        raise MisconfigurationException(f"{name} cannot read it ({err})") from None
    try:
        return Plan.from_dict(data)
    except (TypeError, ValueError) as err:
        raise MisconfigurationException(f"MemoryPlanner(plan={str(plan)!r}): {err}") from None


def plan_model_mismatch(plan: Plan, module: nn.Module) -> str | None:
    """Why `plan` was made for another model (its recorded parameter names and shapes differ), in words;
    None when it matches or the plan recorded no model. Checked before any layout is applied."""
    if plan.model_fingerprint is None or plan.model_fingerprint == model_fingerprint(module):
        return None
    made_for = plan.model_class or "another model"
    count = sum(p.numel() for p in module.parameters())
    return (f"the plan was made for {made_for} (fingerprint {plan.model_fingerprint}), not this "
            f"{model_class_name(module)} ({count:,} parameters, fingerprint {model_fingerprint(module)}): its "
            "micro-batch and memory figures do not apply. Re-plan with `memplan suggest CONFIG --output ...`")


def plan_device_mismatch(plan: Plan, device: torch.device) -> str | None:
    """Why the device differs from the one `plan` was made for, in words (a warning: the figures may
    still hold on a similar board); None when it is the same GPU model."""
    if device.type != "cuda":
        if plan.gpu_name.lower() == "cpu":
            return None
        return f"the plan is for {plan.gpu_name}, this run is on {device.type}: its memory figures are for the GPU"
    here = device_budget(device, 1)
    catalogued = match_nvml_name(here.name)
    if plan.gpu_name in (here.name, catalogued.name if catalogued else None):
        return None
    if plan.gpu_total_bytes is not None and abs(here.total_bytes - plan.gpu_total_bytes) <= plan.gpu_total_bytes // 100:
        return None  # a custom GPU (--gpu-memory) of this board's memory
    return (f"the plan is for {plan.gpu_name}, this run is on {here.name}: its memory figures may not hold; "
            "re-plan on this machine with `memplan suggest CONFIG`")


def plan_mismatches(plan: Plan, *, precision: str, world_size: int, nodes: int, fsdp: bool | None = None
                    ) -> list[str]:
    """How the running Trainer differs from what the plan was made for, in words (empty: it matches).
    `fsdp`: whether the Trainer runs an FSDP strategy (None: not compared)."""
    found = []
    if fsdp is not None and world_size > 1 and plan.world_size > 1 and (plan.strategy == "fsdp") != fsdp:
        planned = f"FSDP {plan.sharding_strategy}" if plan.strategy == "fsdp" else "DDP"
        found.append(f"the plan is for {planned}, the Trainer runs {'an FSDP strategy' if fsdp else 'DDP'}; its "
                     "memory figures do not hold. Use the trainer.strategy of the config `memplan suggest` wrote")
    if plan.precision != precision:
        found.append(f"the plan is for precision={plan.precision!r}, the Trainer runs {precision!r}; its memory "
                     f"figures do not hold. Use Trainer(precision={plan.precision!r})")
    if plan.world_size != world_size or plan.nodes != nodes:
        found.append(f"the plan is for {plan.nodes} node(s) x {plan.gpus_per_node} device(s) = {plan.world_size} "
                     f"ranks, the Trainer runs {world_size} rank(s) on {nodes} node(s); the accumulation is "
                     f"recomputed to keep the global batch of {plan.global_batch_size}. Use "
                     f"Trainer(num_nodes={plan.nodes}, devices={plan.gpus_per_node})")
    return found


def layout_from_plan(plan: Plan, *, world_size: int, loader_batch_size: int, settable: bool,
                     keep_accumulation: int | None = None) -> Layout:
    """The plan on this Trainer: loader batch = micro-batch when the batch size can be set, else the
    loader's batch split into micro-batches; accumulation fills the plan's global batch.

    `keep_accumulation`: the Trainer's accumulate_grad_batches, given for a loss that is not a per-sample
    mean (a sum, a token mean). Lightning's accumulation weighs every loaded batch 1/accumulate_grad_batches,
    which only a per-sample mean over equal batches makes exact; so where the plan keeps the global batch
    the Trainer runs now, the loader keeps its batch and accumulation, and the batch is split into
    micro-batch chunks that MemoryPlanner weighs by the loss's reduction."""
    keep = (keep_accumulation is not None
            and plan.global_batch_size == loader_batch_size * world_size * keep_accumulation)
    loader = plan.micro_batch_size if settable and not keep else loader_batch_size
    per_step = loader * world_size
    if plan.global_batch_size % per_step:
        fix = (f"set a `batch_size` attribute the train loader reads, so MemoryPlanner can set it to "
               f"{plan.micro_batch_size}" if not settable else "run it on the world size it was planned for")
        raise MisconfigurationException(
            f"MemoryPlanner: the plan's global batch of {plan.global_batch_size} is not a multiple of the loader "
            f"batch {loader} x {world_size} rank(s) = {per_step}, so no accumulation keeps it: {fix}"
        )
    setting = plan.checkpointing
    return Layout(loader_batch_size=loader, micro_batch_size=min(plan.micro_batch_size, loader),
                  accumulate_grad_batches=plan.global_batch_size // per_step, world_size=world_size,
                  gradient_checkpointing=plan.gradient_checkpointing,
                  checkpointing=None if setting.mode in ("none", "full") else str(setting))


def current_loader_batch_size(trainer: Any, module: Any, batch_arg_name: str | None) -> int:
    """The per-rank batch the train loader yields now: the batch-size attribute (when given), else
    the loader's own."""
    if batch_arg_name is not None:
        return int(lightning_getattr(module, batch_arg_name))
    from memplan.shapes import rng_preserved

    loader = train_loader(trainer)
    size = getattr(loader, "batch_size", None)
    if size:
        return int(size)
    loader = read_ahead_safe(loader)
    with rng_preserved(loader):
        return loaded_batch_size(next(iter(loader))) or 1


def loader_ignores(trainer: Any, module: Any, batch_arg_name: str) -> str | None:
    """Why the train loader's batch is not the attribute `batch_arg_name` itself, in words (a batch sampler of its
    own, a size of its own, the attribute scaled); None where it is, or where the loader shows no batch size to
    tell by (an iterable dataset batching itself, a sampler without `batch_size`: set as before). The loader is
    built with the attribute as it is and doubled; the attribute and the random generators the builds advance (a
    `random_split` without a generator) are restored."""
    from memplan.shapes import rng_preserved

    size = int(lightning_getattr(module, batch_arg_name))
    with rng_preserved():
        before = _batch_size(train_loader(trainer))
        if before is None:
            return None
        lightning_setattr(module, batch_arg_name, 2 * size)
        try:
            after = _batch_size(train_loader(trainer))
        finally:
            lightning_setattr(module, batch_arg_name, size)
    if (before, after) == (size, 2 * size):
        return None
    if after == before:
        return f"it yields batches of {before} whatever `{batch_arg_name}` is"
    return f"it yields {before} for `{batch_arg_name}`={size} and {after} for {2 * size}, not the attribute itself"


def _batch_size(loader: Any) -> int | None:
    """A DataLoader's batch size (its batch sampler's where it has none); None where neither shows one."""
    own = getattr(loader, "batch_size", None)
    if own is None:
        own = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return own if isinstance(own, int) else None


def train_loader(trainer: Any) -> Any:
    """The fit's one train DataLoader, as the model or datamodule builds it now; the random generators its build
    advances (a train_dataloader() drawing a random split) are restored, so the fit's own build draws as without
    memplan."""
    from memplan.shapes import rng_preserved

    with rng_preserved():
        return _first_loader(compat.train_data_source(trainer).dataloader())


def read_ahead_safe(loader: Any) -> Any:
    """`loader` to read batches from ahead of training (only: its other settings, num_workers say, are the copy's),
    or where its dataset is an IterableDataset, a loader of the same batches over a deep copy of it:
    reading an IterableDataset ahead of training consumes a stream (training then ran epochs of no batch, for ever)
    or moves its position (a shard cursor advanced in `__iter__`: training saw other samples); its copy keeps its
    own. A dataset that cannot be copied (a generator, an open socket) is refused, naming the way around."""
    import copy

    from torch.utils.data import DataLoader, IterableDataset

    dataset = getattr(loader, "dataset", None)
    if not isinstance(dataset, IterableDataset) or not isinstance(loader, DataLoader):
        return loader
    try:
        copied = copy.deepcopy(dataset)
    except Exception as err:  # noqa: BLE001 - any object a dataset holds may refuse
        raise MisconfigurationException(
            f"MemoryPlanner reads batches of the train loader before training to plan, and its IterableDataset "
            f"({type(dataset).__name__}) cannot be copied to read them without consuming it or moving its position "
            f"({type(err).__name__}: {err}). Make the dataset copyable (copy.deepcopy), or pass "
            "MemoryPlanner(plan=...) made by `memplan suggest`, which reads no batch unless a batch must be split"
        ) from None
    return DataLoader(copied, batch_size=loader.batch_size, drop_last=loader.drop_last, collate_fn=loader.collate_fn,
                      num_workers=0)


def samples_per_rank(loader: Any, world_size: int) -> int | None:
    """Samples each rank's loader goes through in an epoch (a DistributedSampler's share of the dataset,
    padded); None where the dataset has no length."""
    try:
        samples = len(loader.dataset)
    except TypeError:
        return None
    return -(-samples // world_size)


def first_train_batch(trainer: Any) -> Any:
    """One batch of the train loader, exactly as training_step will receive it (before device transfer);
    the random generators it advances are restored (memplan.shapes.rng_preserved)."""
    from memplan.shapes import rng_preserved

    with rng_preserved():
        loader = read_ahead_safe(_first_loader(compat.train_data_source(trainer).dataloader()))
    with rng_preserved(loader):
        return next(iter(loader))


def _first_loader(loaders: Any) -> Any:
    if isinstance(loaders, COMBINED_LOADERS):
        loaders = loaders.flattened
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if isinstance(loaders, Sequence):
        if len(loaders) != 1:
            raise MisconfigurationException("MemoryPlanner plans for one train dataloader; this fit has "
                                            f"{len(loaders)}. Combine them into one")
        return loaders[0]
    return loaders


def apply_layout(trainer: Any, module: Any, layout: Layout, batch_arg_name: str | None) -> None:
    """Set the loader batch (through `batch_arg_name`, where the model has one), the accumulation and
    checkpointing."""
    if batch_arg_name is not None:
        lightning_setattr(module, batch_arg_name, layout.loader_batch_size)
    trainer.accumulate_grad_batches = layout.accumulate_grad_batches
    if layout.gradient_checkpointing and not checkpointing_is_on(module):
        if layout.checkpointing:
            apply_setting(module, Checkpointing.parse(layout.checkpointing, name="the plan's checkpointing"))
        else:
            enable_checkpointing(module)


def apply_setting(module: nn.Module, setting: Checkpointing) -> list[str]:
    """Apply a partial or per-op setting by wrapping the repeated blocks it names (memplan's wrapper:
    no model's own switch checkpoints part of its blocks or per op). A transformers model's KV cache is
    turned off first (`config.use_cache = False`), as its own gradient_checkpointing_enable does in
    training: a cache filled again by the recompute changes what the recompute runs."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
    try:
        return apply_checkpointing(module, setting)
    except ValueError as err:
        raise MisconfigurationException(f"MemoryPlanner cannot apply checkpointing {str(setting)!r}: {err}") from None


def can_checkpoint(module: nn.Module) -> bool:
    """Whether the model has a checkpointing switch of its own or repeated blocks memplan can wrap."""
    return bool(_own_switches(module)) or bool(find_repeated_blocks(module))


_SWITCHES = (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),  # transformers >= 5
             ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"))


def enable_checkpointing(module: nn.Module) -> list[str]:
    """Turn activation checkpointing on: through the model's own switch where it has one (transformers'
    `activation_checkpointing_enable` / `gradient_checkpointing_enable`), else by wrapping its repeated
    blocks. Returns the names of what was switched."""
    switches = _own_switches(module)
    for _, switch in switches:
        kwargs_name = next(kw for name, kw in _SWITCHES if switch.__name__ == name)
        if kwargs_name in inspect.signature(switch).parameters:
            switch(**{kwargs_name: {"use_reentrant": False}})  # non-reentrant: what DDP's no_sync expects
        else:
            switch()
    if switches:
        return [name or type(module).__name__ for name, _ in switches]
    try:
        return apply_checkpointing(module, True)
    except ValueError as err:
        raise MisconfigurationException(f"MemoryPlanner cannot turn checkpointing on: {err}") from None


def _own_switches(module: nn.Module) -> list[tuple[str, Callable[..., Any]]]:
    """The checkpointing switches of the outermost submodules that have one (the newer name first)."""
    found: list[tuple[str, Callable[..., Any]]] = []
    for name, sub in module.named_modules():
        if any(name.startswith(f"{outer}.") or not outer for outer, _ in found):
            continue  # inside a model already switched
        switch = next((getattr(sub, attr) for attr, _ in _SWITCHES if callable(getattr(sub, attr, None))), None)
        if switch is not None:
            found.append((name, switch))
    return found
