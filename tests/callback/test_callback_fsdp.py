"""MemoryPlanner under Lightning's ModelParallelStrategy (FSDP2, fully_shard in configure_model) on CPU:
gloo, 2 processes, each scenario in its own watched subprocess: a hang (no CPU progress) fails the test and
kills every rank (scenarios in fsdp_driver.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from callback_sim import ddp_batches, read_jsonl, reference_weights
from subprocess_run import run_watched

DRIVER = Path(__file__).with_name("fsdp_driver.py")
STEPS = 6  # fsdp_driver.STEPS

pytestmark = pytest.mark.slow


def run_logs(scenario: str, out: Path, accumulate: int = 1) -> list[list[dict]]:
    """Run a scenario that must succeed; each rank's MemoryPlanner log."""
    result = run_watched([sys.executable, str(DRIVER), scenario, str(out), str(accumulate)], cwd=out.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in result.stdout + result.stderr
    assert "the plan is for" not in result.stderr  # an FSDP plan, on the world size it was made for
    return [read_jsonl(out / "memplan" / f"rank{r}.jsonl") for r in (0, 1)]


def check_trained_unsplit(out: Path, accumulate: int) -> None:
    """The weights (unsharded) are those of plain SGD on each global batch whole."""
    weights = torch.load(out / "weights.pt")
    expected = reference_weights(ddp_batches(per_rank_batch=8 * accumulate, world_size=2, steps=STEPS))
    assert weights.keys() == expected.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_chunks_with_gradient_sync_off_train_as_whole_batches(tmp_path, accumulate):
    logs = run_logs("split", tmp_path / "split", accumulate)
    check_trained_unsplit(tmp_path / "split", accumulate)
    for rank, log in enumerate(logs):
        applied = next(e for e in log if e["event"] == "apply")["layout"]
        assert (applied["loader_batch_size"], applied["micro_batch_size"]) == (8, 2), rank
        assert applied["accumulate_grad_batches"] == accumulate
        assert [e["step"] for e in log if e["event"] == "sample"][-1] == STEPS
        assert log[-1]["event"] == "end" and log[-1]["status"] == "finished"


def test_all_ranks_lower_together_and_turn_checkpointing_on(tmp_path):
    logs = run_logs("adjust", tmp_path / "adjust")
    check_trained_unsplit(tmp_path / "adjust", 1)
    decided = [[(e["step"], e["after"]["micro_batch_size"], e["after"]["gradient_checkpointing"])
                for e in log if e["event"] == "change"] for log in logs]
    assert decided[0] == decided[1] == [(1, 4, False), (2, 2, False), (3, 1, False), (4, 1, True)]
    assert not any(e["event"] == "oom_retry" for log in logs for e in log)


def test_without_a_plan_rank_0_plans_fsdp_before_configure_model_and_every_rank_applies_it(tmp_path):
    logs = run_logs("planned", tmp_path / "planned")
    plans = [next(e for e in log if e["event"] == "apply") for log in logs]
    assert plans[0]["plan"] == plans[1]["plan"] and plans[0]["source"] == "planned from an estimate"
    plan = plans[0]["plan"]
    assert (plan["strategy"], plan["sharding_strategy"], plan["world_size"], plan["global_batch_size"]) == (
        "fsdp", "FULL_SHARD", 2, 16)
    assert plan["block_classes"] == ["callback_sim.Block"]


@pytest.mark.parametrize("scenario", ["hf_main", "hf_module"])
def test_a_causal_lm_held_as_self_model_is_planned_as_its_configure_model_shards_it(tmp_path, scenario):
    # the usual FSDP2 script: fully_shard on self.model's layers and self.model, the LightningModule defined
    # in the script run as __main__ (hf_main) or imported from a module (hf_module)
    logs = run_logs(scenario, tmp_path / scenario)
    plans = [next(e for e in log if e["event"] == "apply") for log in logs]
    assert plans[0]["plan"] == plans[1]["plan"] and plans[0]["source"] == "planned from an estimate"
    assert (plans[0]["plan"]["strategy"], plans[0]["plan"]["world_size"]) == ("fsdp", 2)
    assert plans[0]["plan"]["predicted_peak_bytes"] > 0
    assert all(log[-1]["event"] == "end" and log[-1]["status"] == "finished" for log in logs)
