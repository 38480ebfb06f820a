"""Ground truth for FSDP on CPU: Lightning's ModelParallelStrategy (FSDP2) with gloo, each rank profiled.

    python -m benchmarks.fsdp_truth CASE WORLD_SIZE OUT_DIR    # writes OUT_DIR/rank{r}.json

CASE is a benchmarks.zoo case (model, batch size per rank, optimizer, precision, checkpointing). The
run is what a user of ModelParallelStrategy writes: `configure_model` builds the model, applies
checkpointing to each repeated block, then `fully_shard` on each repeated block and on the root over
the strategy's data-parallel mesh; `Trainer(strategy=ModelParallelStrategy(...), devices=WORLD_SIZE,
accelerator="cpu", precision=...)` trains 2 steps. Lightning starts the other ranks by re-running this
command. Each rank profiles its whole run (build + 2 steps) and reads its peak "Total Allocated" as
benchmarks.cpu_truth does (build and steps are marked with the same `record_function` names), with
the allocator counting every thread's frees (memplan.truth.allocator_counts_every_thread):
gloo's worker threads free collective buffers the profiler would otherwise count forever.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.cpu_truth import _MARK, STEPS, analyze_trace
from benchmarks.zoo import CASES, SEED, Case, make_optimizer
from memplan.estimator.checkpointing import apply_checkpointing, find_repeated_blocks
from memplan.truth import allocator_counts_every_thread


def lightning_module(case: Case):
    import lightning.pytorch as pl

    class FsdpCase(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None
            self._step_mark = None

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            if self.model is not None:
                return
            with record_function(_MARK + "build"):
                model = case.build()
                if case.checkpointing:
                    apply_checkpointing(model, True)
                mesh = self.device_mesh["data_parallel"]
                for _, block in find_repeated_blocks(model):
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
                self.model = model

        def training_step(self, batch, batch_idx):
            return case.loss(self.model, batch)

        def configure_optimizers(self):
            return make_optimizer(case.optimizer, self.model.parameters())

        def on_train_batch_start(self, batch, batch_idx) -> None:
            self._step_mark = record_function(f"{_MARK}step{batch_idx + 1}")
            self._step_mark.__enter__()

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self._step_mark.__exit__(None, None, None)

    return FsdpCase()


def run(case: Case, world_size: int) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    # gloo's worker threads free collective buffers: counted only with the allocator counting them.
    with allocator_counts_every_thread() as every_thread, profile(
        activities=[ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        # The batch is made inside the profile, as the estimate counts it. One batch per step per
        # rank; Lightning's DistributedSampler hands each rank its own (the same tensors, no copy).
        batch = case.make_batch(case.batch_size)
        loader = DataLoader([batch] * (STEPS * world_size), batch_size=None)
        trainer = pl.Trainer(
            accelerator="cpu", devices=world_size, precision=case.precision, max_steps=STEPS,
            strategy=ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1),
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        module = lightning_module(case)
        trainer.fit(module, loader)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return {
        "case": case.name,
        "world_size": world_size,
        "rank": trainer.global_rank,
        "num_parameters_per_rank": sum(p.to_local().numel() for p in module.model.parameters()),
        **analyze_trace(trace),
        "allocator_counts_every_thread": every_thread,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] not in CASES:
        print(__doc__, file=sys.stderr)
        return 2
    result = run(CASES[args[0]], int(args[1]))
    os.makedirs(args[2], exist_ok=True)
    with open(os.path.join(args[2], f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
