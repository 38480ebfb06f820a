"""The ranks that train different samples: MemoryPlanner's one source of the data-parallel degree.

Lightning's ModelParallelStrategy gives the distributed sampler `num_replicas` = the size of
`device_mesh["data_parallel"]` and `rank` = the rank in it, so the ranks of one tensor-parallel group
train the same batches. `ModelParallelStrategy()` with default arguments on one node has
data_parallel_size = 1 and tensor_parallel_size = devices: every rank trains the same batches, and a
`fully_shard` over `device_mesh["data_parallel"]` shards nothing (each rank keeps whole parameters,
gradients and optimizer state). MemoryPlanner plans that mesh as it is: the global batch is loader
batch x accumulate_grad_batches x data-parallel size, the estimate is FSDP over the data-parallel
ranks, and it says once that the other ranks repeat the work.

Tensor parallelism itself (parallelize_module, DTensor placements over the "tensor_parallel" mesh
dimension) is not modelled: a configured model with a parameter sharded over that dimension is refused
by name, at fit start (configure_model runs after the callback's setup).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from memplan.callback.framework import MODEL_PARALLEL_STRATEGIES, MisconfigurationException

TENSOR_PARALLEL = "tensor_parallel"
"""The name Lightning's ModelParallelStrategy gives its tensor-parallel mesh dimension."""


def data_parallel_size(trainer: Any) -> int:
    """Ranks that train different samples, as the Trainer's distributed sampler counts them: the size of a
    ModelParallelStrategy's device_mesh["data_parallel"] (its sampler's num_replicas), else the world size."""
    strategy = trainer.strategy
    if isinstance(strategy, MODEL_PARALLEL_STRATEGIES):
        return int(strategy.device_mesh["data_parallel"].size())
    return int(trainer.world_size)


def has_tensor_parallel_ranks(trainer: Any) -> bool:
    """Whether the Trainer's ModelParallelStrategy has a tensor-parallel mesh dimension of more than one rank
    (where configure_model may apply tensor parallelism, which only the configured parameters show)."""
    return isinstance(trainer.strategy, MODEL_PARALLEL_STRATEGIES) and data_parallel_size(trainer) < trainer.world_size


def data_parallel_nodes(data_parallel: int, nodes: int) -> int:
    """Nodes the data-parallel ranks spread over, for the planner: Lightning lays the tensor-parallel
    dimension inside a node, so each node holds data_parallel / nodes of them; one where that does not
    divide (tensor parallelism across nodes)."""
    return nodes if data_parallel % nodes == 0 else 1


def repeated_work(trainer: Any) -> str | None:
    """In words, when the Trainer runs more ranks than train different samples (a ModelParallelStrategy
    whose data-parallel mesh is smaller than the world), with the fix; None otherwise."""
    world, data_parallel = int(trainer.world_size), data_parallel_size(trainer)
    if data_parallel >= world:
        return None
    tensor_parallel = world // data_parallel
    default = " (what ModelParallelStrategy() chooses on one node)" if data_parallel == 1 else ""
    shards = ("shards nothing: every rank keeps whole parameters, gradients and optimizer state" if data_parallel == 1
              else f"shards over {data_parallel} ranks, not {world}")
    return (f"this ModelParallelStrategy has data_parallel_size={data_parallel} and tensor_parallel_size="
            f"{tensor_parallel}{default}: the {tensor_parallel} ranks of each tensor-parallel group train the same "
            f"batches, and a fully_shard over device_mesh['data_parallel'] {shards}. MemoryPlanner plans for "
            f"{data_parallel} data-parallel rank(s): global batch = loader batch x accumulate_grad_batches x "
            f"{data_parallel}. To train {world} ranks' batches and shard over them, use "
            f"ModelParallelStrategy(data_parallel_size={world}, tensor_parallel_size=1)")


def check_tensor_parallel(trainer: Any, module: nn.Module) -> None:
    """MisconfigurationException naming the first parameter of the configured `module` that is a DTensor
    sharded (or partial) over a "tensor_parallel" mesh dimension of more than one rank: tensor parallelism,
    which memplan does not model. Call it once configure_model has run (fit start)."""
    strategy = trainer.strategy
    if not isinstance(strategy, MODEL_PARALLEL_STRATEGIES):
        return
    from torch.distributed.tensor import DTensor

    for name, param in module.named_parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        names = mesh.mesh_dim_names or ()
        for dim, placement in enumerate(param.placements):
            if dim < len(names) and names[dim] == TENSOR_PARALLEL and mesh.size(dim) > 1 \
                    and not placement.is_replicate():
                raise MisconfigurationException(
                    f"MemoryPlanner plans, splits batches and counts the global batch for data parallelism (FSDP "
                    f"over device_mesh['data_parallel']), and does not model tensor parallelism: parameter {name!r} "
                    f"is a DTensor placed {placement} over the {mesh.size(dim)} ranks of device_mesh"
                    f"['{TENSOR_PARALLEL}'] (parallelize_module in configure_model). Use ModelParallelStrategy("
                    f"data_parallel_size={trainer.world_size}, tensor_parallel_size=1) with fully_shard only, or "
                    "drop MemoryPlanner")
