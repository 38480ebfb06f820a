"""MemoryPlanner under Lightning's ModelParallelStrategy (FSDP2, fully_shard in configure_model) on CPU:
gloo, 2 processes, every scenario in one watched launch (the fsdp_runs fixture), each test reading its own
scenario's folder and output: a hang (no CPU progress) fails the tests and kills every rank (scenarios in
fsdp_driver.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from callback_sim import check_scenario_ran, ddp_batches, read_jsonl, reference_weights, scenario_output
from subprocess_run import run_watched

DRIVER = Path(__file__).with_name("fsdp_driver.py")
STEPS = 6  # fsdp_driver.STEPS
#: every scenario of fsdp_driver.py (split-2: split with 2 loader batches a step; tp, refused, last)
SCENARIOS = ("split", "split-2", "adjust", "planned", "hf_main", "hf_module", "mesh-2", "tp")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """SCENARIOS, run once in one watched 2-rank launch (a hang fails every test reading it): (the folder
    holding one folder per scenario, the launch's result). tests/conftest.py keeps this module on one xdist
    worker."""
    root = tmp_path_factory.mktemp("fsdp")
    return root, run_watched([sys.executable, str(DRIVER), str(root), *SCENARIOS], cwd=root)


def run_logs(fsdp_runs: tuple[Path, subprocess.CompletedProcess], scenario: str) -> list[list[dict]]:
    """A scenario of the shared launch, which must have succeeded; each rank's MemoryPlanner log."""
    root, result = fsdp_runs
    output = check_scenario_ran(root / scenario, result)
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in output
    assert "the plan is for" not in output  # an FSDP plan, on the world size it was made for
    return [read_jsonl(root / scenario / "memplan" / f"rank{r}.jsonl") for r in (0, 1)]


def check_trained_unsplit(out: Path, accumulate: int, data_parallel: int = 2) -> None:
    """The weights (unsharded) are those of plain SGD on each global batch whole (`data_parallel` ranks
    training different samples, each through a DistributedSampler of that many replicas)."""
    weights = torch.load(out / "weights.pt")
    expected = reference_weights(ddp_batches(per_rank_batch=8 * accumulate, world_size=data_parallel, steps=STEPS))
    assert weights.keys() == expected.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_chunks_with_gradient_sync_off_train_as_whole_batches(fsdp_runs, accumulate):
    scenario = "split" if accumulate == 1 else f"split-{accumulate}"
    logs = run_logs(fsdp_runs, scenario)
    check_trained_unsplit(fsdp_runs[0] / scenario, accumulate)
    for rank, log in enumerate(logs):
        applied = next(e for e in log if e["event"] == "apply")["layout"]
        assert (applied["loader_batch_size"], applied["micro_batch_size"]) == (8, 2), rank
        assert applied["accumulate_grad_batches"] == accumulate
        assert [e["step"] for e in log if e["event"] == "sample"][-1] == STEPS
        assert log[-1]["event"] == "end" and log[-1]["status"] == "finished"


def test_all_ranks_lower_together_and_turn_checkpointing_on(fsdp_runs):
    logs = run_logs(fsdp_runs, "adjust")
    check_trained_unsplit(fsdp_runs[0] / "adjust", 1)
    decided = [[(e["step"], e["after"]["micro_batch_size"], e["after"]["gradient_checkpointing"])
                for e in log if e["event"] == "change"] for log in logs]
    assert decided[0] == decided[1] == [(1, 4, False), (2, 2, False), (3, 1, False), (4, 1, True)]
    assert not any(e["event"] == "oom_retry" for log in logs for e in log)


def test_without_a_plan_rank_0_plans_fsdp_before_configure_model_and_every_rank_applies_it(fsdp_runs):
    logs = run_logs(fsdp_runs, "planned")
    plans = [next(e for e in log if e["event"] == "apply") for log in logs]
    assert plans[0]["plan"] == plans[1]["plan"] and plans[0]["source"] == "planned from an estimate"
    plan = plans[0]["plan"]
    assert (plan["strategy"], plan["sharding_strategy"], plan["world_size"], plan["global_batch_size"]) == (
        "fsdp", "FULL_SHARD", 2, 16)
    assert plan["block_classes"] == ["callback_sim.Block"]


@pytest.mark.parametrize("scenario", ["hf_main", "hf_module"])
def test_a_causal_lm_held_as_self_model_is_planned_as_its_configure_model_shards_it(fsdp_runs, scenario):
    # the usual FSDP2 script: fully_shard on self.model's layers and self.model, the LightningModule defined
    # in the script run as __main__ (hf_main) or imported from a module (hf_module)
    logs = run_logs(fsdp_runs, scenario)
    plans = [next(e for e in log if e["event"] == "apply") for log in logs]
    assert plans[0]["plan"] == plans[1]["plan"] and plans[0]["source"] == "planned from an estimate"
    assert (plans[0]["plan"]["strategy"], plans[0]["plan"]["world_size"]) == ("fsdp", 2)
    assert plans[0]["plan"]["predicted_peak_bytes"] > 0
    assert all(log[-1]["event"] == "end" and log[-1]["status"] == "finished" for log in logs)


MESH_NOTE = ("this ModelParallelStrategy has data_parallel_size=1 and tensor_parallel_size=2 (what "
             "ModelParallelStrategy() chooses on one node): the 2 ranks of each tensor-parallel group train the same "
             "batches, and a fully_shard over device_mesh['data_parallel'] shards nothing")
MESH_FIX = "use ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)"


def test_lightnings_default_mesh_is_planned_as_one_data_parallel_rank_and_said_once(fsdp_runs):
    # ModelParallelStrategy() on 2 devices: data_parallel_size=1, so both ranks train the same batches, and a
    # fully_shard over device_mesh["data_parallel"] keeps every parameter whole; planned at setup, micro-batch 2,
    # Trainer(accumulate_grad_batches=2), loader batch 8
    logs = run_logs(fsdp_runs, "mesh-2")
    out = fsdp_runs[0] / "mesh-2"
    applies = [next(e for e in log if e["event"] == "apply") for log in logs]
    assert applies[0]["plan"] == applies[1]["plan"] and applies[0]["source"] == "planned from an estimate"
    plan = applies[0]["plan"]
    assert (plan["world_size"], plan["global_batch_size"], plan["micro_batch_size"]) == (1, 16, 2)  # 8 x 2 x 1 rank
    for apply in applies:
        assert apply["ranks"] == 2
        assert {k: apply["layout"][k] for k in ("loader_batch_size", "micro_batch_size", "accumulate_grad_batches",
                                                 "world_size", "global_batch_size")} == {
            "loader_batch_size": 8, "micro_batch_size": 2, "accumulate_grad_batches": 2, "world_size": 1,
            "global_batch_size": 16}
    # every chunk trained: each rank ran the same 4 chunks of 2 of each loaded batch, each step the 16 samples
    # of one data-parallel rank's DistributedSampler, and the weights are plain SGD's on those batches whole
    samples = [json.loads((out / f"samples_rank{r}.json").read_text()) for r in (0, 1)]
    assert samples[0] == samples[1]
    assert [len(chunk) for chunk in samples[0]["seen"]] == [2] * (STEPS * 2 * 4)
    expected = ddp_batches(per_rank_batch=16, world_size=1, steps=STEPS)
    assert samples[0]["steps"] == expected
    assert sorted(i for chunk in samples[0]["seen"] for i in chunk) == sorted(i for step in expected for i in step)
    check_trained_unsplit(out, 2, data_parallel=1)
    # said once as a warning, and again in the end-of-fit summary, with the fix
    output = scenario_output(out)
    assert output.count(f"UserWarning: MemoryPlanner: {MESH_NOTE}") == 1
    summary = output[output.index("MemoryPlanner summary:"):]
    assert MESH_NOTE in summary and MESH_FIX in summary
    assert "2 ranks, 1 of them data-parallel: the others train the same batches" in output


def test_tensor_parallelism_in_configure_model_is_refused_by_name_at_fit_start(fsdp_runs):
    # the same default mesh, configure_model also applying ColwiseParallel over device_mesh["tensor_parallel"]
    root, result = fsdp_runs
    check_scenario_ran(root / "tp", result)
    for rank in (0, 1):
        message = (root / "tp" / f"refused_rank{rank}.txt").read_text()
        assert "does not model tensor parallelism: parameter 'net.blocks.0.linear.weight' is a DTensor placed S(0) " \
               "over the 2 ranks of device_mesh['tensor_parallel']" in message
        assert "Use ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)" in message
