"""MemoryPlanner's FSDP wiring in one process: which switch turns gradient sync off for which chunk,
and the refusals. FSDPStrategy (FSDP1) needs a GPU in Lightning, so its tests are SIMULATED: the
strategy and its FullyShardedDataParallel are stand-ins (a real FSDP1 run on a GPU is owed)."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from callback_sim import Regression
from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import FullyShardedDataParallel

from memplan.callback import fsdp_plan, sharded
from memplan.callback.chunk_job import RunnerOptions
from memplan.callback.chunking import MicroBatchRunner
from memplan.callback.framework import MisconfigurationException
from memplan.callback.layout import Layout


class SimulatedFSDP(FullyShardedDataParallel):
    """SIMULATED FSDP1 wrapper: only its no_sync(), which records whether it is on."""

    def __init__(self) -> None:  # (no process group, no sharding)
        torch.nn.Module.__init__(self)
        self.sync_off = False
        self.entered = 0

    def no_sync(self):
        wrapper = self

        class _Off:
            def __enter__(self):
                wrapper.sync_off, wrapper.entered = True, wrapper.entered + 1

            def __exit__(self, *exc):
                wrapper.sync_off = False

        return _Off()


def simulated_fsdp1_strategy(model: torch.nn.Module | None = None, **settings) -> FSDPStrategy:
    """A SIMULATED FSDPStrategy: its settings as FSDPStrategy(...) keeps them, its model the stand-in."""
    strategy = FSDPStrategy(**settings)
    strategy.model = model if model is not None else SimulatedFSDP()
    return strategy


def simulated_trainer(strategy, accumulate: int = 1):
    """SIMULATED: what MicroBatchRunner reads of a Trainer."""
    epoch_loop = types.SimpleNamespace(batch_idx=0, automatic_optimization=types.SimpleNamespace(_skip_backward=False))
    return types.SimpleNamespace(strategy=types.SimpleNamespace(
        root_device=torch.device("cpu"), model=strategy.model, block_backward_sync=None),
        precision_plugin=None, accumulate_grad_batches=accumulate,
        fit_loop=types.SimpleNamespace(epoch_loop=epoch_loop))


def test_simulated_fsdp1_chunks_but_the_last_run_under_no_sync_and_the_gradient_is_the_batch_s():
    module = Regression(batch_size=8, with_attr=False)
    wrapper = SimulatedFSDP()
    strategy = simulated_fsdp1_strategy(wrapper)
    synced_backwards = []
    for param in module.parameters():  # each backward records whether FSDP would have reduce-scattered
        param.register_hook(lambda g: synced_backwards.append(not wrapper.sync_off) or g)
    layout = Layout(loader_batch_size=8, micro_batch_size=2, accumulate_grad_batches=1, world_size=1,
                    gradient_checkpointing=False)
    runner = MicroBatchRunner(simulated_trainer(strategy), module, RunnerOptions(
        shared_layout=lambda: layout, can_checkpoint=False, retry=False, can_guard=False,
        enable_checkpointing=lambda: None, on_retry=lambda r: None, out_of_memory=lambda m, s: None,
        sharded_sync_off=sharded.gradient_sync_off(strategy, module)))
    runner.install()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    loss = module.training_step((x, y, torch.arange(8)), 0)
    in_step = list(synced_backwards)
    loss.backward()  # Lightning's backward of what training_step returned: the sharded gradients handed over
    got = {n: p.grad.clone() for n, p in module.named_parameters()}
    runner.remove()

    assert wrapper.entered == 3  # chunks 1-3 of 4 under no_sync
    per_param = len(list(module.parameters()))
    assert in_step == [False] * 3 * per_param + [True] * per_param  # only the last chunk's backward syncs
    module.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(module.net["out"](module.net["blocks"](module.net["inp"](x))), y).backward()
    for name, param in module.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=0, atol=1e-12, msg=name)


def test_simulated_fsdp1_strategy_without_an_fsdp_model_is_refused_by_name():
    strategy = simulated_fsdp1_strategy(torch.nn.Linear(2, 2))
    with pytest.raises(MisconfigurationException, match="FSDPStrategy's model is a Linear, not FullyShardedDataParallel"):
        sharded.gradient_sync_off(strategy, torch.nn.Linear(2, 2))


def test_model_parallel_without_fully_shard_is_refused_by_name():
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    with pytest.raises(MisconfigurationException, match="no module fully_shard was applied to"):
        sharded.gradient_sync_off(strategy, Regression())


@pytest.mark.parametrize("strategy", [simulated_fsdp1_strategy(), ModelParallelStrategy()], ids=["FSDP1", "FSDP2"])
def test_guard_always_is_refused_under_fsdp(strategy):
    sharded.refuse_guard_always(strategy, "auto")
    with pytest.raises(MisconfigurationException, match=r"guard='always'.*use guard='auto'"):
        sharded.refuse_guard_always(strategy, "always")


def test_simulated_fsdp1_settings_are_read_for_planning():
    from torch.distributed.fsdp import MixedPrecision

    strategy = simulated_fsdp1_strategy(sharding_strategy="SHARD_GRAD_OP", cpu_offload=True,
                                        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                                       reduce_dtype=torch.float32))
    settings, assumed = fsdp_plan.planning_settings(strategy, Regression())
    assert (settings.sharding_strategy, settings.cpu_offload, settings.param_dtype, settings.reduce_dtype) == (
        "SHARD_GRAD_OP", True, "bfloat16", "float32")
    assert assumed == []


def test_simulated_fsdp1_bf16_mixed_plans_bf16_all_gathers():
    from pytorch_lightning.plugins.precision import FSDPPrecision

    strategy = simulated_fsdp1_strategy(precision_plugin=FSDPPrecision("bf16-mixed"))
    settings, _ = fsdp_plan.planning_settings(strategy, Regression())
    assert (settings.sharding_strategy, settings.param_dtype, settings.cpu_offload) == ("FULL_SHARD", "bfloat16", False)


def test_torch_s_checkpoint_wrapper_counts_as_checkpointing_on():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from memplan.callback.rewrites import checkpointing_is_on

    module = Regression()
    assert not checkpointing_is_on(module)
    module.net["blocks"][0] = checkpoint_wrapper(module.net["blocks"][0])
    assert checkpointing_is_on(module)  # so MemoryPlanner does not wrap FSDPStrategy's checkpointed blocks again


def test_a_model_built_in_configure_model_cannot_be_planned_at_setup():
    class Empty(Regression):
        def __init__(self):
            super().__init__()
            del self.net

    with pytest.raises(MisconfigurationException, match="has none before configure_model"):
        fsdp_plan.planning_settings(simulated_fsdp1_strategy(), Empty())


def test_every_candidate_is_traced_with_the_strategy_s_settings():
    seen = []
    settings = fsdp_plan.FsdpSettings(sharding_strategy="SHARD_GRAD_OP")
    estimate = fsdp_plan.with_settings(lambda **kw: seen.append(kw.get("fsdp")), settings)
    estimate(micro_batch_size=1, fsdp=fsdp_plan.FsdpSettings(sharding_strategy="FULL_SHARD", cpu_offload=True))
    # a one-rank candidate (a data-parallel mesh of one rank): fully_shard still runs over it
    estimate(micro_batch_size=1, world_size=1)
    assert seen == [settings, settings]



def test_a_ddp_plan_under_fsdp_and_an_fsdp_plan_under_ddp_are_named():
    from callback_sim import make_plan

    from memplan.callback.apply import plan_mismatches

    ddp = make_plan(2, 4, world_size=2)
    fsdp = dataclasses.replace(ddp, strategy="fsdp", sharding_strategy="FULL_SHARD")
    assert plan_mismatches(ddp, precision="32-true", world_size=2, nodes=1, fsdp=False) == []
    assert plan_mismatches(fsdp, precision="32-true", world_size=2, nodes=1, fsdp=True) == []
    [found] = plan_mismatches(ddp, precision="32-true", world_size=2, nodes=1, fsdp=True)
    assert "the plan is for DDP, the Trainer runs an FSDP strategy" in found
    [found] = plan_mismatches(fsdp, precision="32-true", world_size=2, nodes=1, fsdp=False)
    assert "the plan is for FSDP FULL_SHARD, the Trainer runs DDP" in found
