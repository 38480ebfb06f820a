"""MemoryPlanner under Lightning DDP on CPU (gloo, 2 processes, strategy="ddp"), in watched subprocesses, so
a hang (no CPU progress) fails the test and kills every rank instead of blocking the suite. The scenarios
that end by themselves with success, then `fatal`, run in one launch (the ddp_runs fixture in
tests/callback/conftest.py, which other modules' scenarios share), each test reading its own scenario's folder and
output; the others have a launch each. The scenarios and their SIMULATED devices are in ddp_driver.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from callback_sim import check_scenario_ran, ddp_batches, read_jsonl, reference_weights, scenario_output
from subprocess_run import Watched, run_watched

DRIVER = Path(__file__).with_name("ddp_driver.py")

pytestmark = pytest.mark.slow


def run_scenario(scenario: str, root: Path) -> subprocess.CompletedProcess:
    """A launch of its own for `scenario`, writing under root/<scenario>."""
    return run_watched([sys.executable, str(DRIVER), str(root), scenario], cwd=root)


def shared_scenario(ddp_runs: tuple[Path, subprocess.CompletedProcess], scenario: str) -> tuple[Path, str]:
    """A scenario of the shared launch, which every rank must have finished: its folder and its output."""
    root, result = ddp_runs
    out = root / scenario
    return out, check_scenario_ran(out, result)


def shared_logs(ddp_runs: tuple[Path, subprocess.CompletedProcess], scenario: str) -> tuple[Path, list[list[dict]]]:
    """A scenario of the shared launch, which must have succeeded: its folder and each rank's MemoryPlanner log."""
    out, _ = shared_scenario(ddp_runs, scenario)
    return out, rank_logs(out)


def rank_logs(out: Path) -> list[list[dict]]:
    return [read_jsonl(out / "memplan" / f"rank{r}.jsonl") for r in (0, 1)]


def retries(log: list[dict]) -> list[tuple]:
    """A rank's OOM retries: (step, phase, failed micro-batch, micro-batch retried with)."""
    return [(e["step"], e["phase"], e["failed_micro_batch_size"], e["micro_batch_size"])
            for e in log if e["event"] == "oom_retry"]


def changes(events: list[dict]) -> list[dict]:
    """The shared decisions, without what differs by rank (its number, the clock)."""
    return [{k: v for k, v in e.items() if k not in ("rank", "time")} for e in events if e["event"] == "change"]


def check_trained_like_one_process(out: Path, steps: int, per_rank_batch: int = 8) -> None:
    """Every global batch seen whole (each rank's samples per step together), weights as plain SGD."""
    per_rank = [json.loads((out / f"samples_rank{r}.json").read_text()) for r in (0, 1)]
    batches = ddp_batches(per_rank_batch=per_rank_batch, world_size=2, steps=steps)
    assert [sorted(set(a) | set(b)) for a, b in zip(*per_rank)] == batches
    weights, expected = torch.load(out / "weights.pt"), reference_weights(batches)
    for name, value in weights.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-12, msg=name)


@pytest.mark.ddp_scenarios("adjust")
def test_both_ranks_lower_together_when_one_rank_is_short_and_grow_back(ddp_runs):
    out, output = shared_scenario(ddp_runs, "adjust")
    logs = rank_logs(out)
    assert changes(logs[0]) == changes(logs[1])
    assert len({e["run"] for log in logs for e in log}) == 1  # one run id, from rank 0, on every record
    assert [(c["step"], c["cause"], c["ranks"], c["after"]["micro_batch_size"]) for c in changes(logs[0])] == [
        (1, "headroom", [1], 4), (2, "headroom", [1], 2), (4, "grow", [0, 1], 4), (6, "grow", [0, 1], 8)]
    assert {c["after"]["global_batch_size"] for c in changes(logs[0])} == {16}
    check_trained_like_one_process(out, steps=8)
    # the logger (rank 0 only) received both ranks' readings, gathered, in each of Lightning's rows
    metrics = json.loads((out / "metrics.json").read_text())
    memplan_steps = [m for m in metrics if "memplan/rank1/headroom_gib" in m]
    assert [m["step"] for m in memplan_steps] == list(range(8))  # Lightning's step index
    assert memplan_steps[0]["memplan/rank1/headroom_gib"] < 0.05 * 16  # rank 1's SIMULATED reading
    assert memplan_steps[0]["memplan/rank0/process_gib"] > 0
    assert [m["memplan/micro_batch_size"] for m in memplan_steps][:3] == [8, 4, 2]
    assert "rank 1: peak 2.00 GiB in this process, least headroom 163.84 MiB" in output


@pytest.mark.ddp_scenarios("oom")
def test_an_oom_on_one_rank_is_retried_there_without_a_hang_and_then_shared(ddp_runs):
    out, logs = shared_logs(ddp_runs, "oom")
    # no plan was given: rank 0 planned, every rank applied the same plan (global batch 16 kept)
    applied = [log[0] for log in logs]
    assert all(a["source"] == "planned from an estimate" for a in applied)
    assert applied[0]["plan"] == applied[1]["plan"] and applied[0]["layout"] == applied[1]["layout"]
    assert applied[0]["plan"]["world_size"] == 2 and applied[0]["layout"]["global_batch_size"] == 16
    assert applied[0]["layout"]["micro_batch_size"] == 8  # a tiny model: the whole per-rank batch fits
    assert retries(logs[1]) == [(0, "forward", 8, 4), (0, "backward", 4, 2)] and not retries(logs[0])
    assert changes(logs[0]) == changes(logs[1])
    assert [(c["step"], c["cause"], c["ranks"], c["after"]["micro_batch_size"]) for c in changes(logs[0])] == [
        (2, "oom", [1], 2)]
    check_trained_like_one_process(out, steps=4)


def test_a_plain_memory_planner_runs_under_ddp_spawn_and_retries_an_oom_there(tmp_path):
    # ddp_spawn pickles the Trainer, callbacks included, into its workers: everything MemoryPlanner holds
    # must pickle (a lambda in __init__ once stopped it at setup)
    out = tmp_path / "spawn"
    result = run_scenario("spawn", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    check_scenario_ran(out, result, ranks=1)  # (the workers are not the driver's ranks)
    logs = rank_logs(out)
    applied = [log[0] for log in logs]
    assert all(a["source"] == "planned from an estimate" for a in applied)
    assert applied[0]["layout"] == applied[1]["layout"] and applied[0]["layout"]["global_batch_size"] == 16
    assert retries(logs[1]) == [(0, "forward", 8, 4), (0, "backward", 4, 2)] and not retries(logs[0])
    assert all(log[-1]["event"] == "end" and log[-1]["status"] == "finished" for log in logs)
    check_trained_like_one_process(out, steps=4)


@pytest.mark.ddp_scenarios("converge")
def test_after_an_oom_both_ranks_settle_at_the_fewest_even_chunks_and_never_retry_a_failed_size(ddp_runs):
    # the held-out job of issue 20: loader 16 per rank, rank 1 out of memory above 8 samples
    out, logs = shared_logs(ddp_runs, "converge")
    assert sum(len(retries(log)) for log in logs) <= 2
    assert retries(logs[1])[0][2:] == (16, 8)  # 16 failed, back to 8 (not 7, not 15)
    finals = [[e for e in log if e["event"] == "sample"][-1] for log in logs]
    assert [(f["micro_batch_size"], f["accumulate_grad_batches"]) for f in finals] == [(8, 2), (8, 2)]
    assert not [c for c in changes(logs[0]) if c["cause"] == "grow"]  # nothing between 8 and 16 halves the chunks
    check_trained_like_one_process(out, steps=12, per_rank_batch=16)


@pytest.mark.ddp_scenarios("fatal")
def test_when_nothing_fits_the_job_ends_with_one_error_naming_the_rank(ddp_runs):
    root, result = ddp_runs  # `fatal` is the shared launch's last scenario
    out = root / "fatal"
    assert result.returncode != 0
    # the job's whole output: each scenario's, and the launch's stderr (a rank's traceback after its scenario goes
    # to the rank's own stderr: rank 1's is the file its first scenario's rank 0 wrote when Lightning started it)
    printed = result.stderr + "".join(scenario_output(folder) for folder in sorted(root.iterdir()) if folder.is_dir())
    assert ("NothingFitsError: MemoryPlanner: rank 1 ran out of memory at step 0 (batch 0) with "
            "micro-batch 1 and activation checkpointing on, and nothing smaller fits. device:") in printed
    fatal = [e for e in read_jsonl(out / "memplan" / "rank1.jsonl") if e["event"] == "fatal"][-1]
    assert fatal["device_total_bytes"] > 0 and fatal["process_bytes"] > 0


@pytest.mark.ddp_scenarios("accumulate")
def test_chunks_with_accumulation_under_ddp_keep_every_gradient(ddp_runs):
    out, logs = shared_logs(ddp_runs, "accumulate")
    apply = logs[0][0]
    assert (apply["layout"]["loader_batch_size"], apply["layout"]["micro_batch_size"],
            apply["layout"]["accumulate_grad_batches"]) == (8, 2, 2)
    retries = [(e["phase"], e["failed_micro_batch_size"]) for e in logs[1] if e["event"] == "oom_retry"]
    assert retries == [("backward", 2)]
    assert changes(logs[0]) == changes(logs[1]) and changes(logs[0])[0]["after"]["micro_batch_size"] == 1
    check_trained_like_one_process(out, steps=4, per_rank_batch=16)


@pytest.mark.ddp_scenarios("buckets", "buckets_plain")
def test_ddp_rebuilds_its_buckets_in_the_order_a_plain_backward_gives(ddp_runs):
    # DDP launches bucket i's all-reduce only after buckets 0..i-1: a bucket order scrambled by the
    # gradient handoff would hold back every all-reduce for the rest of the run
    buckets = {}
    for scenario in ("buckets", "buckets_plain"):
        out, _ = shared_scenario(ddp_runs, scenario)
        buckets[scenario] = json.loads((out / "buckets.json").read_text())
    assert buckets["buckets"] == buckets["buckets_plain"]
    assert buckets["buckets"].count(",") >= 3, buckets  # several buckets, so the order shows
    check_trained_like_one_process(ddp_runs[0] / "buckets", steps=3)


@pytest.mark.ddp_scenarios("mixed")
def test_ranks_on_different_paths_in_one_step_pair_their_backwards(ddp_runs):
    out, logs = shared_logs(ddp_runs, "mixed")
    assert retries(logs[1]) == [(3, "forward", 8, 4)] and not retries(logs[0])
    # unguarded from the first step's reading; rank 1 guarded again by its OOM in step 3
    guarded = [[(e["step"], e["guarded"]) for e in log if e["event"] == "sample"][:3] for log in logs]
    assert guarded == [[(1, True), (2, False), (4, False)], [(1, True), (2, False), (4, True)]]
    assert changes(logs[0]) == changes(logs[1])
    assert [(c["step"], c["cause"], c["after"]["micro_batch_size"]) for c in changes(logs[0])] == [(4, "oom", 4)]
    check_trained_like_one_process(out, steps=6)


@pytest.mark.ddp_scenarios("tokens", "tokens_plain")
def test_a_token_mean_loss_split_on_each_rank_trains_as_ddp_does_whole(ddp_runs):
    # DDP averages the ranks' gradients, each rank's loss being the mean over its own tokens: that is
    # what a split batch reproduces (README: "Loss semantics"), not a mean over all ranks' tokens
    weights = {}
    for scenario in ("tokens", "tokens_plain"):
        out, _ = shared_scenario(ddp_runs, scenario)
        weights[scenario] = torch.load(out / "weights.pt")
    assert read_jsonl(ddp_runs[0] / "tokens" / "memplan" / "rank1.jsonl")[0]["layout"]["micro_batch_size"] == 2
    for name, value in weights["tokens"].items():
        torch.testing.assert_close(value, weights["tokens_plain"][name], rtol=0, atol=1e-12, msg=name)


def test_sigterm_to_one_rank_of_a_users_own_script_ends_the_job_with_every_ranks_log_whole(tmp_path):
    # Lightning's "ddp" launcher, the user's own script, MemoryPlanner alone (no memplan launch script):
    # Lightning's own SIGTERM handler would wait in a broadcast that the other rank never joins
    # (it would hang with no CPU progress, which the watched child's wait fails on)
    import signal

    out = tmp_path / "sigterm"
    log1 = out / "memplan" / "rank1.jsonl"
    with Watched([sys.executable, str(DRIVER), str(tmp_path), "sigterm"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL) as job:
        job.wait_until(lambda: log1.exists() and '"event": "sample"' in log1.read_text(), "rank 1 logged a step")
        rank1 = next(p for p in job.processes() if _local_rank(p) == "1")
        rank1.send_signal(signal.SIGTERM)
        assert job.wait() != 0  # the whole job ends, with a failure
    for rank in (0, 1):  # every rank's log whole: each line a record, the last one the end of the run
        log = read_jsonl(out / "memplan" / f"rank{rank}.jsonl")
        assert log[-1]["event"] == "end" and log[-1]["status"].startswith("failed"), log[-1]
    assert read_jsonl(log1)[-1]["signal"] == "SIGTERM"  # recorded as a field, for memplan report to name


def _local_rank(process) -> str | None:
    import psutil

    try:
        return process.environ().get("LOCAL_RANK")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
