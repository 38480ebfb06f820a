"""memplan.callback.mesh: the data-parallel degree MemoryPlanner counts by, the note on ranks that repeat each
other's batches, the refusal of tensor parallelism, and the planning request over the data-parallel ranks. (The
end-to-end runs on Lightning's default mesh are in test_callback_fsdp.py.)"""
from __future__ import annotations

import types

import pytest
import torch
from callback_sim import Regression
from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn

from memplan.callback import mesh
from memplan.callback.apply import planning_request
from memplan.callback.framework import MisconfigurationException
from memplan.planner import DeviceBudget
from memplan.planner.assemble import Asked, HostSide


def model_parallel_trainer(data_parallel: int, tensor_parallel: int):
    """SIMULATED: a Trainer with a ModelParallelStrategy whose device mesh has these sizes (what its
    setup_environment makes; here a dict of stand-in sub-meshes)."""
    strategy = ModelParallelStrategy()
    strategy._device_mesh = {"data_parallel": types.SimpleNamespace(size=lambda: data_parallel),
                             "tensor_parallel": types.SimpleNamespace(size=lambda: tensor_parallel)}
    return types.SimpleNamespace(strategy=strategy, world_size=data_parallel * tensor_parallel)


def test_the_data_parallel_size_is_the_mesh_s_under_model_parallel_and_the_world_s_otherwise():
    assert mesh.data_parallel_size(model_parallel_trainer(1, 4)) == 1
    assert mesh.data_parallel_size(model_parallel_trainer(2, 2)) == 2
    assert mesh.data_parallel_size(types.SimpleNamespace(strategy=DDPStrategy(), world_size=4)) == 4
    assert mesh.has_tensor_parallel_ranks(model_parallel_trainer(1, 2))
    assert not mesh.has_tensor_parallel_ranks(model_parallel_trainer(2, 1))


def test_ranks_repeating_each_other_s_batches_are_named_with_the_fix():
    note = mesh.repeated_work(model_parallel_trainer(1, 4))
    assert "data_parallel_size=1 and tensor_parallel_size=4 (what ModelParallelStrategy() chooses on one node)" in note
    assert "the 4 ranks of each tensor-parallel group train the same batches" in note
    assert "fully_shard over device_mesh['data_parallel'] shards nothing" in note
    assert note.endswith("use ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)")
    note = mesh.repeated_work(model_parallel_trainer(2, 2))
    assert "shards over 2 ranks, not 4" in note and "ModelParallelStrategy()" not in note
    assert mesh.repeated_work(model_parallel_trainer(4, 1)) is None
    assert mesh.repeated_work(types.SimpleNamespace(strategy=DDPStrategy(), world_size=4)) is None


@pytest.fixture
def fake_mesh():
    """A ("data_parallel", "tensor_parallel") = (1, 2) device mesh on a fake process group of 2 ranks (this
    process rank 0): DTensors are made from local tensors, no collective runs."""
    from torch.distributed.device_mesh import init_device_mesh

    from memplan.estimator.fsdp import fake_process_group

    with fake_process_group(2):
        yield init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))


def placed(module: nn.Module, device_mesh, placements) -> nn.Module:
    """`module` with its Linear's weight a DTensor of these placements (rank 0's local part)."""
    from torch.distributed.tensor import DTensor

    local = module.net["out"].weight.detach()
    module.net["out"].weight = nn.Parameter(DTensor.from_local(local, device_mesh, placements, run_check=False))
    return module


def test_a_parameter_sharded_over_the_tensor_parallel_dimension_is_refused_by_name(fake_mesh):
    from torch.distributed.tensor import Replicate, Shard

    trainer = model_parallel_trainer(1, 2)
    with pytest.raises(MisconfigurationException, match=r"does not model tensor parallelism: parameter "
                                                        r"'net.out.weight' is a DTensor placed S\(1\) over the 2 "
                                                        r"ranks of device_mesh\['tensor_parallel'\].*"
                                                        r"ModelParallelStrategy\(data_parallel_size=2, "
                                                        r"tensor_parallel_size=1\)"):
        mesh.check_tensor_parallel(trainer, placed(Regression(), fake_mesh["tensor_parallel"], [Shard(1)]))
    with pytest.raises(MisconfigurationException, match="'net.out.weight' is a DTensor placed S\\(1\\)"):  # FSDP + TP
        mesh.check_tensor_parallel(trainer, placed(Regression(), fake_mesh, [Shard(0), Shard(1)]))
    # fully_shard's placement over the data-parallel dimension, and one replicated over the tensor-parallel ranks
    mesh.check_tensor_parallel(trainer, placed(Regression(), fake_mesh["data_parallel"], [Shard(0)]))
    mesh.check_tensor_parallel(trainer, placed(Regression(), fake_mesh["tensor_parallel"], [Replicate()]))
    mesh.check_tensor_parallel(trainer, Regression())


def test_the_planner_sees_the_data_parallel_ranks_each_as_tight_as_the_tightest():
    budgets = [DeviceBudget(name="cpu", cuda_index=None, total_bytes=8 << 30, free_bytes=free << 30,
                            compute_capability=(8, 0)) for free in (6, 4, 5, 7)]
    module, batch = Regression(), (torch.zeros(8, 6, dtype=torch.float64), torch.zeros(8, 1, dtype=torch.float64))
    asked = Asked(global_batch_size=16, precisions=("32-true",), all_devices=True, strategies=("fsdp",))
    host = HostSide(available_bytes=32 << 30, sample_bytes=56)
    request = planning_request(module, batch, budgets, nodes=1, asked=asked, host=host, data_parallel=1)
    assert (request.nodes, [d.free_bytes for d in request.devices]) == (1, [4 << 30])
    assert request.host_available_bytes == 8 << 30  # the node's RAM is shared by its 4 ranks, not planned for 1
    request = planning_request(module, batch, budgets, nodes=2, asked=asked, host=None, data_parallel=2)
    assert (request.nodes, [d.free_bytes for d in request.devices]) == (2, [4 << 30])  # one per node
    request = planning_request(module, batch, budgets, nodes=1, asked=asked, host=None, data_parallel=4)
    assert (request.nodes, [d.free_bytes >> 30 for d in request.devices]) == (1, [6, 4, 5, 7])
