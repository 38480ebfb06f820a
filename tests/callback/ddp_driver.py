"""MemoryPlanner scenarios under Lightning DDP on CPU: gloo, 2 processes, strategy="ddp".

    python ddp_driver.py <out_root> <scenario> [<scenario> ...]

Lightning's "ddp" launcher starts rank 1 by running this script again (LOCAL_RANK=1), as it does a
user's training script; each rank then runs the scenarios one after another (callback_sim.run_scenarios:
later fits find LOCAL_RANK set and the process group up, as a script calling fit twice does), each writing
under <out_root>/<scenario> with its output in output_rank<R>.txt there. Scenarios (SIMULATED devices: see callback_sim):
  adjust  rank 1's memory readings are SIMULATED: too little headroom at the first two checks, then
          plenty; all ranks lower 8 -> 4 -> 2, then grow back to 8.
  oom     no plan given: rank 0 estimates and plans (memplan's planner, host RAM budgets), every rank
          applies that plan. Rank 1's SIMULATED memory fails forwards of more than 5 samples and
          backwards of more than 3; rank 1 retries on its own, then all ranks agree on its micro-batch.
  fatal   rank 1's SIMULATED memory fits no sample at all: the job must end with one clear error.
  accumulate  no batch_size attribute: the loader's 8 run as chunks of 2, 2 batches a step (the
          inner chunks' gradients kept across Lightning's zero_grad), DDP finding unused parameters;
          rank 1's SIMULATED memory fails backwards of more than 1 sample.
  final   the loader's 8 run as one chunk; rank 1's SIMULATED memory fails backwards of more than 5
          samples, so its only chunk's backward fails and is retried as 4 + 4 while rank 0 runs 8
          whole; training_step logs with sync_dist=True (a rank logging twice in a batch would hang).
  buckets  tiny DDP buckets (a parameter or two each); step 0 is guarded (no reading yet), so the
          gradients of DDP's first synchronised backward, which DDP rebuilds its buckets from, come
          through MemoryPlanner's carrier. Rank 0 writes DDP's rebuilt assignment to buckets.json.
  buckets_plain  the same run without MemoryPlanner: the assignment a plain backward gives.
  lightning  `final` under lightning.pytorch (the unified `lightning` package) instead of
          pytorch_lightning: rank 1's only chunk's backward fails and is retried there.
  tokens  a class-weighted token-mean LM loss with padding (loss_sim.TokenLM, dict batches): each rank's
          loader batch of 8 runs as chunks of 2 with mean_over = the rank's weighted real tokens.
          Rank 0 writes weights.pt.
  tokens_plain  the same without MemoryPlanner: each rank's batch whole, DDP averaging the ranks' token means.
  spawn   `oom` under strategy="ddp_spawn" with a plain MemoryPlanner() (Lightning pickles the Trainer, its
          callbacks included, into each worker); the workers write the files below (SaveFromWorker).
  converge  loader batch 16 per rank, no plan given (a plain MemoryPlanner() plans 16 whole), rank 1's
          SIMULATED memory fails forwards of more than 8 samples; growth on. Both ranks must settle at
          8 x 2 with at most 2 OOM retries in the whole run (before: 16 -> 8 -> grown to 15, OOM -> 7,
          ending 7 + 7 + 2).
  sigterm  a run that does not end by itself (a sample logged every step); the test sends SIGTERM to rank 1:
          MemoryPlanner alone (no launch script) must end the whole job, every rank's log whole.
  mixed   SIMULATED readings with plenty of room on both ranks (unguarded from the check at step 2);
          from step 3 rank 1's SIMULATED memory fails forwards of more than 5 samples, so in step 3
          rank 1 retries its batch guarded (4 + 4, through the carrier) while rank 0 leaves its whole
          batch's backward to Lightning.
Each rank writes samples_rank<R>.json (the samples of each optimizer step) and log_calls_rank<R>.json;
rank 0 writes weights.pt (and, in `final`, rank 1 weights_rank1.pt);
the RecordingLogger writes metrics.json; MemoryPlanner writes memplan/rank<R>.jsonl.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.strategies import DDPStrategy  # noqa: E402
import torch  # noqa: E402
from callback_sim import (  # noqa: E402
    RecordingLogger, Regression, SimulatedBudget, TightenAt, end_finished_rank, make_plan, run_net, run_scenarios,
    simulated_free, tracing, weights_of,
)
from pytorch_lightning.callbacks import Callback  # noqa: E402

from memplan.hardware import readings  # noqa: E402
from memplan.callback import MemoryPlanner  # noqa: E402
from memplan.units import GiB  # noqa: E402

RANK = int(os.environ.get("LOCAL_RANK", "0"))


class SyncLogged(Regression):
    """Logs its loss with sync_dist=True (a collective) and counts its `log` calls."""

    log_calls = 0

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        loss = torch.nn.functional.mse_loss(run_net(self.net, x), y)
        if not tracing(self):
            self.seen.append(index.tolist())
            self._pending.extend(index.tolist())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def log(self, *args, **kwargs) -> None:
        self.log_calls += 1
        super().log(*args, **kwargs)


class RecordBuckets(Callback):
    """Rank 0 writes DDP's rebuilt bucket assignment (parameter indices per bucket) to buckets.json."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            data = trainer.strategy.model._get_ddp_logging_data()
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "buckets.json").write_text(json.dumps(data["rebuilt_per_bucket_param_indices"]))


class SaveFromWorker(Callback):
    """Under ddp_spawn the fit runs in worker processes: each writes its samples (and rank 0 the weights)
    there, at the end of training."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"samples_rank{trainer.global_rank}.json").write_text(json.dumps(pl_module.step_samples))
        if trainer.is_global_zero:
            torch.save(weights_of(pl_module), self.out / "weights.pt")


def simulated_readings(tight_checks: int):
    """SIMULATED rank-1 readings: 1% of a 16 GiB device free for `tight_checks` checks, then 60%."""
    calls = {"n": 0}

    def read(device: torch.device, *, new_interval: bool = True) -> readings.MemoryReading:
        if new_interval:
            calls["n"] += 1
        free = 0.01 if calls["n"] <= tight_checks else 0.60
        total = 16 * GiB
        return readings.MemoryReading(process_bytes=2 * GiB, device_used_bytes=int(total * (1 - free)),
                                     device_total_bytes=total, peak_bytes=2 * GiB, headroom_bytes=int(total * free))

    return read


def main_lightning_pytorch(out: Path) -> None:
    """The `lightning` scenario: lightning.pytorch's Trainer, strategy and LightningModule."""
    import lightning.pytorch as L
    from callback_sim import RegressionSteps

    class LRegression(RegressionSteps, L.LightningModule):
        pass

    module = LRegression(batch_size=8, budget=SimulatedBudget(backward_limit=5, ranks=(1,)))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False,
                        callbacks=[MemoryPlanner(make_plan(8, 1, world_size=2), every_n_steps=2, grow=False,
                                                 log_dir=out / "memplan")],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=out)
    trainer.fit(module)
    (out / f"samples_rank{trainer.global_rank}.json").write_text(json.dumps(module.step_samples))
    if trainer.is_global_zero:
        torch.save(weights_of(module), out / "weights.pt")


def main_tokens(out: Path, split: bool) -> None:
    """The `tokens` and `tokens_plain` scenarios."""
    from loss_sim import TokenLM, weighted_tokens
    from loss_sim import weights_of as lm_weights

    module = TokenLM(batch_size=8)
    planner = MemoryPlanner(make_plan(2, 4, world_size=2), adjust=False, mean_over=weighted_tokens,
                            log_dir=out / "memplan")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False,
                         callbacks=[planner] if split else [], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out)
    trainer.fit(module)
    if trainer.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(lm_weights(module), out / "weights.pt")


def main(scenario: str, out: Path) -> None:
    if scenario == "lightning":
        return main_lightning_pytorch(out)
    if scenario in ("tokens", "tokens_plain"):
        return main_tokens(out, split=scenario == "tokens")
    budget = None
    options = dict(every_n_steps=1, grow=False)
    steps = 6
    if scenario == "adjust":
        options = dict(every_n_steps=1, grow=True, grow_patience=2)
        steps = 8
        if RANK == 1:
            readings.read_memory = simulated_readings(tight_checks=2)
    elif scenario in ("oom", "spawn"):
        options = dict(every_n_steps=2, grow=False)
        steps = 4
        budget = SimulatedBudget(forward_limit=5, backward_limit=3, ranks=(1,))
    elif scenario == "fatal":
        budget = SimulatedBudget(forward_limit=0, ranks=(1,))
    plan = make_plan(8, 1, world_size=2)  # global batch 16
    strategy = "ddp"
    with_attr = True
    if scenario == "accumulate":
        plan = make_plan(2, 8, world_size=2)  # global batch 32: the loader's 8 x 2 ranks x 2 batches
        budget = SimulatedBudget(backward_limit=1, ranks=(1,))
        strategy, with_attr, steps = DDPStrategy(find_unused_parameters=True), False, 4
        options = dict(every_n_steps=2, grow=False)
    module_class = Regression
    extra: list[Callback] = []
    if scenario == "final":
        budget, module_class = SimulatedBudget(backward_limit=5, ranks=(1,)), SyncLogged
        options = dict(every_n_steps=2, grow=False)
    elif scenario in ("buckets", "buckets_plain"):
        strategy, steps, options = DDPStrategy(bucket_cap_mb=0.001), 3, dict(every_n_steps=10, grow=False)
        extra = [RecordBuckets(out)]
    elif scenario == "converge":
        budget, steps = SimulatedBudget(forward_limit=8, ranks=(1,)), 12
        options = dict(every_n_steps=1, grow=True, grow_patience=2)
        readings.read_memory = simulated_free(0.60)  # SIMULATED: plenty of headroom, so growth is tried
    elif scenario == "sigterm":
        steps, options = 10**6, dict(every_n_steps=1, grow=False)
    elif scenario == "spawn":
        strategy, extra, options = "ddp_spawn", [SaveFromWorker(out)], {}
    elif scenario == "mixed":
        readings.read_memory = simulated_free(0.60)
        budget = SimulatedBudget(ranks=(1,))
        extra = [TightenAt(budget, step=3, limit=5, phase="forward")]
        options = dict(every_n_steps=2, grow=False)
    module = module_class(batch_size=16 if scenario == "converge" else 8, budget=budget, with_attr=with_attr)
    planner = [] if scenario == "buckets_plain" else [
        MemoryPlanner(None if scenario in ("oom", "spawn", "converge") else plan, **options)]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=RecordingLogger(out),
        log_every_n_steps=1 if scenario == "adjust" else 50,
        callbacks=[*planner, *extra], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out,
    )
    trainer.fit(module)
    if scenario == "spawn":
        return  # (the workers wrote their files)
    (out / f"samples_rank{trainer.global_rank}.json").write_text(json.dumps(module.step_samples))
    (out / f"log_calls_rank{trainer.global_rank}.json").write_text(json.dumps(getattr(module, "log_calls", None)))
    if trainer.is_global_zero:
        torch.save(weights_of(module), out / "weights.pt")
    elif scenario == "final":
        torch.save(weights_of(module), out / f"weights_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    run_scenarios(main, Path(sys.argv[1]), sys.argv[2:])
    end_finished_rank()  # destroys the process group and leaves without interpreter shutdown
