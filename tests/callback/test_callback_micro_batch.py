"""The micro-batch has one owner per scope: the shared layout (MemoryPlanner.layout) for every rank, this
rank's runner for the chunks it runs; every other reader reads through them. So an OOM retried on one rank
and the shared decisions after it leave no reader behind."""
from __future__ import annotations

import logging

import pytorch_lightning as pl
from callback_sim import RecordingLogger, Regression, SimulatedBudget, TightenAt, make_plan, read_jsonl, simulated_free

from memplan.callback import MemoryPlanner
from memplan.hardware import readings


class Batches(pl.Callback):
    """Per loaded batch: the shared micro-batch when it started, and the chunk sizes it ran (forwards that
    succeeded: training_step records its samples after the forward)."""

    def __init__(self, planner: MemoryPlanner) -> None:
        self.planner, self.ran = planner, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.ran.append((self.planner.layout.micro_batch_size, len(pl_module.seen)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        shared, before = self.ran[-1]
        self.ran[-1] = (shared, sorted({len(chunk) for chunk in pl_module.seen[before:]}))


def test_after_an_oom_retry_and_a_growth_every_reader_reports_the_same_micro_batch(make_trainer, monkeypatch,
                                                                                     tmp_path, caplog):
    monkeypatch.setattr(readings, "read_memory", simulated_free(0.5))  # SIMULATED: room to grow at every check
    budget = SimulatedBudget()
    module = Regression(batch_size=12, budget=budget)
    planner = MemoryPlanner(make_plan(12, 1), every_n_steps=1, grow_patience=1)
    batches = Batches(planner)
    logger = RecordingLogger(tmp_path / "rows")
    # SIMULATED: forwards of more than 3 samples run out of memory in steps 1 and 2, none after
    callbacks = [planner, TightenAt(budget, 1, 3, phase="forward"), TightenAt(budget, 3, None, phase="forward"), batches]
    with caplog.at_level(logging.INFO):
        make_trainer(callbacks, max_steps=6, logger=logger).fit(module)

    # step 1: 12 and 6 ran out of memory, this rank went on in chunks of 3 (its own size, the shared one
    # still 12); every rank then took 3 (an OOM decision), and grew to 4 (below the 6 that failed)
    assert [(c["step"], c["cause"], c["after"]["micro_batch_size"]) for c in planner.changes] == [
        (2, "oom", 3), (3, "grow", 4)]
    assert batches.ran == [(12, [12]), (12, [3]), (3, [3]), (4, [4]), (4, [4]), (4, [4])]
    # every reader of the micro-batch now: the shared layout, the checkpoint, the rank's last reading (its
    # runner's size), the end-of-fit summary (gathered from the runners), the logger rows (the layout)
    assert planner.layout.micro_batch_size == 4
    assert planner.state_dict()["micro_batch_size"] == 4
    events = read_jsonl(planner.log_path)
    last_sample = [e for e in events if e["event"] == "sample"][-1]
    assert (last_sample["step"], last_sample["micro_batch_size"], last_sample["oom_retries"]) == (6, 4, 2)
    assert [e["layout"]["micro_batch_size"] for e in events if e["event"] == "summary"] == [4]
    summary = next(r.getMessage() for r in caplog.records if "MemoryPlanner summary" in r.getMessage())
    assert "micro-batch 4 x 3 per step" in summary and "2 OOM retries" in summary
    rows = [m for m in logger.metrics if "memplan/micro_batch_size" in m]
    assert [m["memplan/micro_batch_size"] for m in rows][-3:] == [4.0, 4.0, 4.0]


def test_a_loader_that_yields_fewer_samples_is_what_the_retries_and_the_chunks_follow(make_trainer):
    """The first batch shows the loader yields 96 (the dataset's all), not the plan's 128: the shared layout
    takes 96, and the runner reads it there, so an OOM retries in even chunks of 96 (48), not of 128 (43)."""
    budget = SimulatedBudget()
    module = Regression(batch_size=128, budget=budget)
    planner = MemoryPlanner(make_plan(128, 1), every_n_steps=1, grow=False)
    batches = Batches(planner)
    # SIMULATED: forwards of more than 50 samples run out of memory from step 1 on
    make_trainer([planner, TightenAt(budget, 1, 50, phase="forward"), batches], max_steps=3).fit(module)
    assert (planner.layout.loader_batch_size, planner.layout.micro_batch_size) == (96, 48)
    assert batches.ran == [(96, [96]), (96, [48]), (48, [48])]
    assert [(c["cause"], c["after"]["micro_batch_size"]) for c in planner.changes] == [("oom", 48)]
