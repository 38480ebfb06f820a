"""Watch: per-rank JSON-lines logs, metrics to the Trainer's logger, the end-of-fit summary, and the
state a resumed run continues from."""
from __future__ import annotations

import logging

import pytest
import torch
from callback_sim import RecordingLogger, Regression, make_plan, read_jsonl
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from memplan.callback import MemoryPlanner


class LineCounter(Callback):
    """Runs after MemoryPlanner: counts the sample lines its log holds at that moment."""

    def __init__(self, planner: MemoryPlanner) -> None:
        self.planner, self.counts = planner, []

    def on_train_batch_end(self, trainer, *args) -> None:
        text = self.planner.log_path.read_text() if self.planner.log_path.exists() else ""
        self.counts.append((trainer.global_step, text.count('"event": "sample"')))


def test_each_rank_writes_json_lines_every_n_steps_flushed_as_written(make_trainer, tmp_path):
    planner = MemoryPlanner(make_plan(4, 2), every_n_steps=2)
    counter = LineCounter(planner)
    trainer = make_trainer([planner, counter], max_steps=6)
    trainer.fit(Regression(batch_size=8))
    assert planner.log_path == tmp_path / "memplan" / "rank0.jsonl"
    events = read_jsonl(planner.log_path)
    assert [e["event"] for e in events] == ["apply", "sample", "sample", "sample", "sample", "summary", "end"]
    samples = [e for e in events if e["event"] == "sample"]
    assert [s["step"] for s in samples] == [1, 2, 4, 6]  # the first step, then every 2 (6 is also the last)
    assert dict(counter.counts)[2] == 2 and dict(counter.counts)[4] == 3  # on disk before fit ended
    assert len({e["run"] for e in events}) == 1 and events[-1]["status"] == "finished"
    first = samples[0]
    assert first["rank"] == 0 and isinstance(first["process_bytes"], int) and first["process_bytes"] > 0
    assert 0 < first["headroom_bytes"] <= first["device_total_bytes"]
    assert first["peak_bytes"] >= first["process_bytes"] // 2 and first["allocated_bytes"] is None  # CPU
    assert (first["micro_batch_size"], first["accumulate_grad_batches"], first["global_batch_size"]) == (4, 2, 8)
    assert first["gradient_checkpointing"] is False and first["oom_retries"] == 0


def test_the_default_interval_is_the_trainers_log_every_n_steps(make_trainer):
    planner = MemoryPlanner(make_plan(4, 1))
    make_trainer([planner], max_steps=7, log_every_n_steps=3).fit(Regression())
    assert [e["step"] for e in read_jsonl(planner.log_path) if e["event"] == "sample"] == [1, 3, 6, 7]


def test_log_every_n_steps_0_turns_lightnings_logging_off_not_the_readings(make_trainer):
    # Lightning accepts log_every_n_steps=0 (no logging); readings then come at Lightning's default interval
    planner = MemoryPlanner(make_plan(4, 1))
    make_trainer([planner], max_steps=51, log_every_n_steps=0).fit(Regression())
    assert [e["step"] for e in read_jsonl(planner.log_path) if e["event"] == "sample"] == [1, 50, 51]


def test_the_trainers_logger_receives_every_ranks_readings_in_lightnings_own_rows(make_trainer, tmp_path):
    logger = RecordingLogger(tmp_path)
    make_trainer([MemoryPlanner(make_plan(4, 1), every_n_steps=2)], max_steps=4, logger=logger,
                 log_every_n_steps=2).fit(Regression())
    rows = [m for m in logger.metrics if "train_loss" in m]
    assert [m["step"] for m in rows] == [1, 3]  # Lightning's rows (log_every_n_steps=2), at its own step index
    assert all("memplan/micro_batch_size" in m for m in rows)
    assert not [m for m in logger.metrics if "memplan/micro_batch_size" in m and "train_loss" not in m]
    for name in ("process_gib", "peak_gib", "headroom_gib", "device_used_gib", "oom_retries"):
        assert f"memplan/rank0/{name}" in rows[0]
    assert 0 < rows[0]["memplan/rank0/process_gib"] < 64 and rows[0]["memplan/micro_batch_size"] == 4
    # the plan's prediction, in GiB; on CPU named as tensor bytes, apart from the process's resident memory
    assert rows[0]["memplan/predicted_tensor_peak_gib"] == (1 << 20) / (1 << 30)
    assert "memplan/predicted_peak_gib" not in rows[0]


def test_a_short_summary_per_rank_ends_the_fit(make_trainer, caplog):
    with caplog.at_level(logging.INFO):
        make_trainer([MemoryPlanner(make_plan(4, 1), every_n_steps=1)], max_steps=2).fit(Regression())
    summary = next(r.getMessage() for r in caplog.records if "MemoryPlanner summary" in r.getMessage())
    assert "rank 0: peak " in summary and "least headroom" in summary and "micro-batch 4 x 1 per step" in summary


@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*", "ignore:.*not resumable.*")
def test_a_resumed_run_continues_with_the_adjusted_layout(make_trainer, tmp_path):
    # first run: every check lowers (margin=0.99): micro-batch 8 -> 4 -> 2, and the checkpoint keeps it
    first = MemoryPlanner(make_plan(8, 1), every_n_steps=1, margin=0.99, grow=False)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    make_trainer([first, checkpoints], max_steps=2, enable_checkpointing=True).fit(Regression(batch_size=8))
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]["MemoryPlanner"]
    assert state["micro_batch_size"] == 2 and state["loader_batch_size"] == 8
    assert all(isinstance(v, (int, bool, float, str)) for v in state.values())  # plain scalars
    assert first.state_dict() == state

    # second run, an ordinary margin: the plan says 8, the checkpoint says 2 -- the checkpoint wins
    second = MemoryPlanner(make_plan(8, 1), every_n_steps=1, grow=False)
    module = Regression(batch_size=8)
    trainer = make_trainer([second], max_steps=4)
    trainer.fit(module, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert second.layout.micro_batch_size == 2 and {len(s) for s in module.seen} == {2}
    apply = [e for e in read_jsonl(second.log_path) if e["event"] == "apply"][-1]
    assert apply["source"] == "restored from the checkpoint" and apply["layout"]["micro_batch_size"] == 2
    assert apply["step"] == 2  # the step training resumed from, not 0


def test_a_checkpoint_from_another_world_size_is_not_resumed(make_trainer, tmp_path):
    planner = MemoryPlanner(make_plan(8, 1))
    planner.load_state_dict({"loader_batch_size": 8, "micro_batch_size": 2, "accumulate_grad_batches": 1,
                             "world_size": 4, "gradient_checkpointing": False})
    with pytest.warns(UserWarning, match="layout is for 4 ranks, this run has 1"):
        make_trainer([planner], max_steps=1).fit(Regression(batch_size=8))
    assert planner.layout.micro_batch_size == 8
