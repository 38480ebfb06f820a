"""MemoryPlanner scenarios under Lightning's ModelParallelStrategy (FSDP2) on CPU: gloo, 2 processes.

    python fsdp_driver.py <out_root> <scenario>[-<accumulate>] [...]

Each rank runs the scenarios one after another (callback_sim.run_scenarios), each writing under
<out_root>/<scenario>[-<accumulate>] with its output in output_rank<R>.txt there.

The model is callback_sim.ShardedRegression, the float64 MLP whose configure_model applies fully_shard
to each repeated block, then to the module (the root), as Lightning's ModelParallelStrategy examples do. Each rank's
loader yields 8 samples per batch (no batch-size attribute); a step takes `accumulate` batches per rank
(1 unless the scenario's name ends in -<accumulate>).
Scenarios:
  split   MemoryPlanner with a plan of micro-batch 2: each loaded batch of 8 runs as 4 chunks, the first
          three with FSDP2's gradient sync off, the last reduce-scattering.
  plain   the same training without MemoryPlanner: every batch whole (Lightning's own path).
  planned  MemoryPlanner without a plan: rank 0 plans FSDP (in a process of its own) at setup.
  adjust  MemoryPlanner planning no micro-batch below the loader's, with SIMULATED readings showing
          too little headroom at every check on rank 1: all ranks lower 8 -> 4 -> 2 -> 1 together,
          then turn checkpointing on (two steps run with it).
  hf_main  a transformers causal LM held as `self.model` by a LightningModule defined in this script (run as
          __main__, as most training scripts are), configure_model applying fully_shard to `self.model`'s
          decoder layers and to `self.model`; a plain MemoryPlanner() plans it at setup (in a process of its
          own, the class sent by value) by running that configure_model on a fake mesh.
  hf_module  the same with the class from an importable module (callback_sim.CausalLM).
  mesh    ModelParallelStrategy() with default arguments (on one node: data_parallel_size=1,
          tensor_parallel_size=2), ShardedRegression's configure_model sharding over device_mesh["data_parallel"]
          (one rank: nothing sharded); a plain MemoryPlanner plans at setup with a planner whose micro-batch is at
          most 2, so each loaded batch of 8 runs as 4 chunks. Each rank writes samples_rank<R>.json (the
          samples of each training_step call, and of each optimizer step).
  tp      the same mesh, configure_model also applying tensor parallelism (ColwiseParallel over
          device_mesh["tensor_parallel"]) to the first block: MemoryPlanner refuses it at fit start; each rank
          writes the message to refused_rank<R>.txt (the scenario then ends normally, for the next one).
Rank 0 writes weights.pt (full, unsharded); MemoryPlanner writes memplan/rank<R>.jsonl.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from callback_sim import (  # noqa: E402
    CausalLM, ShardedRegression, end_finished_rank, make_plan, run_scenarios, simulated_free,
)
from pytorch_lightning.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from memplan.callback import MemoryPlanner  # noqa: E402
from memplan.callback.framework import MisconfigurationException  # noqa: E402
from memplan.hardware import readings  # noqa: E402

RANK = int(os.environ.get("LOCAL_RANK", "0"))
STEPS = 6


def fsdp_plan(micro: int, accumulate: int):
    """A 2-rank FSDP plan as `memplan suggest` would write it, for a CPU run."""
    return dataclasses.replace(make_plan(micro, accumulate, world_size=2), strategy="fsdp",
                               sharding_strategy="FULL_SHARD", block_classes=("callback_sim.Block",))


def full_weights(module: ShardedRegression) -> dict[str, torch.Tensor]:
    """The unsharded weights (a collective: every rank calls it)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.net.state_dict().items()}


class MainCausalLM(CausalLM):
    """The same model, its class defined in this script (run as __main__, as most training scripts are)."""


class TensorParallelRegression(ShardedRegression):
    """ShardedRegression with its first block's Linear split column-wise over device_mesh["tensor_parallel"]
    (its output replicated again), then fully_shard over device_mesh["data_parallel"]: 2-D parallelism."""

    def configure_model(self) -> None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(self.net["blocks"][0], self.device_mesh["tensor_parallel"],
                           {"linear": ColwiseParallel(output_layouts=Replicate())})
        super().configure_model()


def micro_batch_of_two(request, estimator):
    """memplan's planner, its micro-batch at most 2 (module level: MemoryPlanner sends it to its planning process)."""
    from memplan.planner import make_plan as plan_with_memplan

    return plan_with_memplan(dataclasses.replace(request, max_micro_batch_size=2), estimator)


def run_default_mesh(scenario: str, out: Path, accumulate: int) -> None:
    """The mesh and tp scenarios: ModelParallelStrategy() with default arguments on 2 devices."""
    model = ShardedRegression(with_attr=False) if scenario == "mesh" else TensorParallelRegression(with_attr=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accumulate_grad_batches=accumulate,
        callbacks=[MemoryPlanner(log_dir=out / "memplan", planner=micro_batch_of_two)])
    try:
        trainer.fit(model)
    except MisconfigurationException as err:
        if scenario != "tp":
            raise
        (out / f"refused_rank{trainer.global_rank}.txt").write_text(str(err))
        return
    (out / f"samples_rank{trainer.global_rank}.json").write_text(json.dumps(
        {"seen": model.seen, "steps": model.step_samples}))
    weights = full_weights(model)
    if trainer.global_rank == 0:
        torch.save(weights, out / "weights.pt")


def main(name: str, out: Path) -> None:
    scenario, _, accumulate = name.partition("-")
    run(scenario, out, int(accumulate or 1))


def run(scenario: str, out: Path, accumulate: int) -> None:
    torch.set_num_threads(1)
    if scenario in ("mesh", "tp"):
        run_default_mesh(scenario, out, accumulate)
        return
    if scenario in ("hf_main", "hf_module"):
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[MemoryPlanner(log_dir=out / "memplan")])
        trainer.fit(MainCausalLM() if scenario == "hf_main" else CausalLM())
        return
    model = ShardedRegression(with_attr=False)
    callbacks, trainer_accumulate = [], accumulate
    if scenario == "split":
        plan = fsdp_plan(2, 4 * accumulate)  # global 16 x accumulate: chunks of 2 from the loader's 8
        callbacks.append(MemoryPlanner(plan=plan, log_dir=out / "memplan", every_n_steps=2))
        trainer_accumulate = 1  # MemoryPlanner sets it from the plan
    elif scenario == "planned":
        callbacks.append(MemoryPlanner(log_dir=out / "memplan", global_batch_size=16 * accumulate))
        trainer_accumulate = 1
    elif scenario == "adjust":
        plan = fsdp_plan(8, accumulate)
        callbacks.append(MemoryPlanner(plan=plan, log_dir=out / "memplan", every_n_steps=1, grow=False))
        short = RANK == 1
        readings.read_memory = simulated_free(0.01 if short else 0.5)  # SIMULATED device memory
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accumulate_grad_batches=trainer_accumulate, callbacks=callbacks,
        use_distributed_sampler=True,
    )
    trainer.fit(model)
    weights = full_weights(model)
    if trainer.global_rank == 0:
        torch.save(weights, out / "weights.pt")


if __name__ == "__main__":
    run_scenarios(main, Path(sys.argv[1]), sys.argv[2:])
    end_finished_rank()  # destroys the process group and leaves without interpreter shutdown
