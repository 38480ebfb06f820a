"""Micro-batch chunks inside training_step, and OOM retries on a SIMULATED device. The weights after
training must equal plain full-batch SGD, which they do only if every sample of every global batch
was counted exactly once, at the right scale."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from callback_sim import (
    Block, Regression, SimulatedBudget, consecutive_batches, make_plan, read_jsonl, reference_weights, run_net, tracing,
    weights_of,
)

from memplan.callback import MemoryPlanner, NothingFitsError
from memplan.callback.adjust import smaller_micro_batch
from memplan.callback.outputs import JOINED


def assert_trained_like_full_batches(module: Regression, global_batch: int, steps: int, *,
                                     forwarded_twice: bool = False) -> None:
    batches = consecutive_batches(global_batch, steps)
    seen = [sorted(set(s)) if forwarded_twice else s for s in module.step_samples]
    assert seen == batches
    expected = reference_weights(batches)
    for name, value in weights_of(module).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_plan_below_the_loader_batch_runs_as_chunks_and_trains_like_whole_batches(make_trainer, accumulate):
    # no batch_size attribute: the loader's 8 stay and run as chunks of the plan's 2
    module = Regression(batch_size=8, with_attr=False)
    planner = MemoryPlanner(make_plan(2, 4 * accumulate), grow=False)
    trainer = make_trainer([planner], max_steps=3)
    trainer.fit(module)
    assert (planner.layout.loader_batch_size, planner.layout.micro_batch_size) == (8, 2)
    assert trainer.accumulate_grad_batches == accumulate
    assert {len(s) for s in module.seen} == {2}
    assert_trained_like_full_batches(module, 8 * accumulate, steps=3)


@pytest.mark.parametrize(("loader", "accumulate"), [(8, 1), (9, 1), (4, 3)])
def test_lowering_mid_run_keeps_the_global_batch_and_the_math(make_trainer, loader, accumulate):
    # margin=0.99: every check finds too little headroom and lowers: loader -> about half, in even chunks
    # of the loaded batch -> ... -> 1 -> checkpointing (9 -> 3 -> 1: 3 + 3 + 3, not 4 + 4 + 1)
    module = Regression(batch_size=loader)
    planner = MemoryPlanner(make_plan(loader, accumulate), every_n_steps=1, margin=0.99, grow=False)
    trainer = make_trainer([planner], max_steps=6)
    trainer.fit(module)
    sizes = [change["after"]["micro_batch_size"] for change in planner.changes]
    expected = []
    size = loader
    while size > 1:
        size = smaller_micro_batch(size, loader)
        expected.append(size)
    assert sizes == [*expected, 1][: len(sizes)] and planner.changes[-1]["after"]["gradient_checkpointing"]
    assert all(c["after"]["global_batch_size"] == loader * accumulate for c in planner.changes)
    assert all(getattr(b, "_memplan_checkpointed", False) for b in module.net["blocks"])
    assert_trained_like_full_batches(module, loader * accumulate, steps=6)


def test_an_oom_in_forward_is_retried_smaller_on_the_same_samples(make_trainer):
    budget = SimulatedBudget(forward_limit=3)  # SIMULATED: more than 3 samples in a forward "run out of memory"
    module = Regression(batch_size=8, budget=budget)
    planner = MemoryPlanner(make_plan(8, 2), every_n_steps=2, grow=False)
    trainer = make_trainer([planner], max_steps=4)
    trainer.fit(module)
    assert budget.raised == 2  # 8 failed, then 4, then 2 fit and were kept
    assert_trained_like_full_batches(module, 16, steps=4)
    events = read_jsonl(planner.log_path)
    retries = [e for e in events if e["event"] == "oom_retry"]
    assert [(e["failed_micro_batch_size"], e["micro_batch_size"], e["phase"]) for e in retries] == [
        (8, 4, "forward"), (4, 2, "forward")]
    assert retries[0]["step"] == 0 and "SIMULATED" in retries[0]["error"]
    change = next(e for e in events if e["event"] == "change")
    assert (change["cause"], change["step"], change["after"]["micro_batch_size"]) == ("oom", 2, 2)


def test_an_oom_part_way_through_a_backward_gives_each_parameter_each_sample_once(make_trainer):
    # SIMULATED: a backward of more than 3 samples fails after the head's gradient was accumulated
    # and before the blocks'; the retry freezes the head for those samples
    budget = SimulatedBudget(backward_limit=3)
    module = Regression(batch_size=8, budget=budget, with_attr=False)
    planner = MemoryPlanner(make_plan(4, 4), every_n_steps=10, grow=False)  # chunks of 4: the first is inner
    trainer = make_trainer([planner], max_steps=3)
    trainer.fit(module)
    retries = [e for e in read_jsonl(planner.log_path) if e["event"] == "oom_retry"]
    assert [(e["phase"], e["failed_micro_batch_size"]) for e in retries] == [("backward", 4)]
    # the failed chunk's forward ran twice (training_step records forwards), its gradient counts once
    assert module.step_samples[0].count(0) == 2 and module.step_samples[1].count(16) == 1
    assert_trained_like_full_batches(module, 16, steps=3, forwarded_twice=True)


def test_where_nothing_fits_one_error_names_the_rank_the_step_and_the_memory(make_trainer):
    budget = SimulatedBudget(forward_limit=0)  # SIMULATED: not even one sample fits
    module = Regression(batch_size=4, budget=budget)
    planner = MemoryPlanner(make_plan(4, 1), grow=False)
    trainer = make_trainer([planner], max_steps=2)
    with pytest.raises(NothingFitsError) as caught:  # a torch.OutOfMemoryError
        trainer.fit(module)
    message = str(caught.value)
    assert message.startswith("MemoryPlanner: rank 0 ran out of memory at step 0 (batch 0) with micro-batch 1")
    assert "activation checkpointing on" in message and "in use" in message and "SIMULATED" in message
    events = read_jsonl(planner.log_path)
    assert [e["event"] for e in events].count("oom_retry") == 3  # 4 -> 2 -> 1 -> checkpointing
    fatal, end = events[-2:]  # the log closes with how the fit ended
    assert end["event"] == "end" and end["status"].startswith("failed: NothingFitsError")
    assert fatal["event"] == "fatal" and fatal["gradient_checkpointing"] and fatal["device_total_bytes"] > 0
    assert isinstance(module.net["blocks"][0], Block) and module.net["blocks"][0]._memplan_checkpointed


def test_an_oom_is_not_retried_when_adjusting_is_off(make_trainer):
    module = Regression(batch_size=4, budget=SimulatedBudget(forward_limit=2))
    trainer = make_trainer([MemoryPlanner(make_plan(4, 1), adjust=False)], max_steps=1)
    with pytest.raises(torch.OutOfMemoryError, match="SIMULATED"):
        trainer.fit(module)


class OomInOptimizerStep(Regression):
    """SIMULATED: the optimizer step runs out of memory (as Adam's first step can, allocating its state)."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()

        def step(closure=None):
            if closure is not None:
                closure()
            raise torch.OutOfMemoryError("SIMULATED out of memory in the optimizer step")

        optimizer.step = step
        return optimizer


def test_an_oom_in_the_optimizer_step_ends_the_job_and_the_logs_say_where(make_trainer, caplog):
    module = OomInOptimizerStep(batch_size=8)
    planner = MemoryPlanner(make_plan(8, 1), grow=False)
    trainer = make_trainer([planner], max_steps=2)
    with pytest.raises(torch.OutOfMemoryError, match="SIMULATED out of memory in the optimizer step"):
        trainer.fit(module)
    fatal = [e for e in read_jsonl(planner.log_path) if e["event"] == "fatal"][-1]
    assert fatal["step"] == 0 and fatal["where"].startswith("in the optimizer step") and "FSDP" in fatal["fix"]
    assert fatal["device_total_bytes"] > 0
    assert "MemoryPlanner: rank 0 ran out of memory at step 0, in the optimizer step" in caplog.text
    assert "guard='always'" not in caplog.text  # it cannot help there, so it is not suggested
    assert "training_step" not in module.__dict__  # the wrapper is off after the error


class OomInValidation(Regression):
    def validation_step(self, batch, batch_idx):
        raise torch.OutOfMemoryError("SIMULATED out of memory in validation")

    def val_dataloader(self):
        return self.train_dataloader()


def test_an_oom_in_validation_is_named_with_what_can_help(make_trainer, caplog):
    planner = MemoryPlanner(make_plan(8, 1), grow=False)
    trainer = make_trainer([planner], max_steps=2, num_sanity_val_steps=0, val_check_interval=1)
    with pytest.raises(torch.OutOfMemoryError, match="SIMULATED out of memory in validation"):
        trainer.fit(OomInValidation(batch_size=8))
    fatal = [e for e in read_jsonl(planner.log_path) if e["event"] == "fatal"][-1]
    assert fatal["where"].startswith("in validation") and "validation loader's batch size" in fatal["fix"]
    assert "guard='always'" not in caplog.text


class ReturnsOutputs(Regression):
    """training_step returns a dict: the loss, per-sample predictions and a count; on_train_batch_end keeps them."""

    def __init__(self) -> None:
        super().__init__(batch_size=8, with_attr=False)
        self.outputs: list[dict] = []
        self.graphs: list[bool] = []  # whether the predictions reaching on_train_batch_end kept their graph

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        pred = run_net(self.net, x)
        return {"loss": F.mse_loss(pred, y), "pred": pred, "count": torch.tensor(x.shape[0])}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if not tracing(self):
            self.outputs.append({k: v.detach().clone() for k, v in outputs.items() if k != "loss"})
            self.graphs.append(outputs["pred"].grad_fn is not None)


def test_a_dict_training_step_returns_reaches_on_train_batch_end_joined_over_the_chunks(make_trainer, caplog):
    # each loaded batch of 8 runs as 2 chunks of 4: the per-sample predictions on_train_batch_end receives are
    # the batch's 8 (they were the last chunk's 4), detached (no chunk's graph is kept through the next) and named
    # once as joined; the count it cannot join is named in a warning
    plain = ReturnsOutputs()
    make_trainer([], max_steps=3).fit(plain)
    module = ReturnsOutputs()
    with pytest.warns(UserWarning, match=r"returns 'count' beside the loss.*last chunk's value of it"), \
            caplog.at_level(logging.INFO):
        make_trainer([MemoryPlanner(make_plan(4, 2), grow=False)], max_steps=3).fit(module)
    assert [r.getMessage() for r in caplog.records].count(JOINED.format(keys="'pred'")) == 1
    assert module.graphs == [False] * 3  # (Lightning hands a whole batch's on with its graph; a chunk's graph
    assert plain.graphs == [True] * 3  # kept through the next chunk would hold what chunking is there to free)
    assert [o["pred"].shape[0] for o in module.outputs] == [8, 8, 8]
    for got, want in zip(module.outputs, plain.outputs, strict=True):
        torch.testing.assert_close(got["pred"], want["pred"], rtol=0, atol=1e-12)
    assert [int(o["count"]) for o in module.outputs] == [4, 4, 4]  # (the whole batch's would be 8: named above)
