"""The GPU campaign starts, survives failures, and its results become the committed files.

The end-to-end tests read one dry run of all four parts (CPU, tiny sizes) and the results converter on what they
wrote; the converter's GPU path is checked on parts written in the campaign's layout in test_gpu_campaign_results.py,
since no GPU is available.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from subprocess_run import run_watched

from benchmarks import gpu_campaign
from benchmarks.accuracy_gpu import EXTRA_PRECISIONS, extra_cases
from benchmarks.plan_vs_bisect_gpu import search_largest
from benchmarks.zoo import CASES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("truth", [0, 1, 2, 7, 37, 100, 999, 5000, 20000])
@pytest.mark.parametrize("start", [1, 8, 40, 1024])
def test_search_largest_brackets_the_largest_that_fits(truth, start):
    tried = []

    def fits(m):
        tried.append(m)
        return m <= truth

    cap = 1 << 14
    largest, first_failing, probes = search_largest(fits, start, rel=0.02, cap=cap)
    assert largest <= min(truth, cap)
    if truth >= cap:
        assert (largest, first_failing) == (cap, None)
    else:  # the largest that fits and the smallest that does not, within 2 % (exact below 50)
        assert first_failing > truth and first_failing - largest <= max(1, int(0.02 * largest))
    assert [m for m, _ in probes] == tried and len(tried) == len(set(tried))  # no size probed twice


def test_extra_cases_add_only_settings_the_zoo_lacks():
    extra = extra_cases()
    zoo_settings = {(c.family, c.batch_size, c.precision, c.checkpointing, c.optimizer) for c in CASES.values()}
    settings = [(c.family, c.batch_size, c.precision, c.checkpointing, c.optimizer) for c in extra.values()]
    assert not set(settings) & zoo_settings and len(set(settings)) == len(settings)
    assert not set(extra) & set(CASES)
    # every family named gets every precision, with and without checkpointing (the MLP: without only)
    gpt2 = {(c.precision, c.checkpointing) for c in [*extra.values(), *CASES.values()]
            if c.family == "gpt2" and c.batch_size == 4 and c.optimizer == "adamw"}
    assert gpt2 == {(p, ckpt) for p in EXTRA_PRECISIONS for ckpt in (False, True)}
    assert next(iter(extra.values())).precision == "16-mixed"  # the least covered first


def _settings(tmp_path, budget_s=60.0, part=1):
    return gpu_campaign.Settings(part=part, out=tmp_path, budget_s=budget_s, dry_run=True, jobs=1, measure_jobs=1)


def test_a_failed_section_is_recorded_and_the_next_still_runs(tmp_path):
    rec = gpu_campaign.Recorder(_settings(tmp_path))
    with rec.section("first") as entry:
        entry["partial"] = 1
        raise ValueError("the probe broke")
    with rec.section("second") as entry:
        entry["value"] = 2
    saved = json.loads((tmp_path / "part1.json").read_text())["sections"]
    assert saved["first"]["status"] == "error" and "the probe broke" in saved["first"]["error"]
    assert saved["first"]["partial"] == 1  # what it measured before failing is kept
    assert saved["second"] == {**saved["second"], "status": "done", "value": 2}
    assert "first: error" in (tmp_path / "part1.log").read_text()


def test_nothing_starts_once_the_budget_is_spent(tmp_path):
    rec = gpu_campaign.Recorder(_settings(tmp_path, budget_s=1.0))
    with rec.section("late") as entry:
        assert entry is None
    assert json.loads((tmp_path / "part1.json").read_text())["sections"]["late"]["status"] == "skipped: out of time"


def test_a_dry_case_runs_its_three_children_in_one_process_and_keeps_each_failure(monkeypatch):
    """The dry run measures and estimates a case in the campaign's process: the emulated estimate sees
    MEMPLAN_TRACE_ON_CPU=1 and the native one 0 (as their children's environments would give them), the truth
    neither, and a failure is
    that child's {"error"} while the others still run, as a failed child's would be."""
    from benchmarks import accuracy_gpu

    monkeypatch.delenv("MEMPLAN_TRACE_ON_CPU", raising=False)
    seen = []

    def measure(name, cpu=False):
        seen.append(("measure", name, cpu, os.environ.get("MEMPLAN_TRACE_ON_CPU")))
        return {"max_allocated": 1}

    def estimate(name, cpu=False):
        seen.append(("estimate", name, cpu, os.environ.get("MEMPLAN_TRACE_ON_CPU")))
        if os.environ.get("MEMPLAN_TRACE_ON_CPU") == "1":
            raise RuntimeError("emulation broke")
        return {"peak_allocated": 2}

    monkeypatch.setattr(accuracy_gpu, "_measure", measure)
    monkeypatch.setattr(accuracy_gpu, "_estimate", estimate)
    got = accuracy_gpu.dry_case("mlp-b64")
    assert got == {"truth": {"max_allocated": 1}, "native": {"peak_allocated": 2},
                   "emulated": {"error": "RuntimeError: emulation broke"}}
    assert seen == [("measure", "mlp-b64", True, None), ("estimate", "mlp-b64", True, "0"),
                    ("estimate", "mlp-b64", True, "1")]
    assert "MEMPLAN_TRACE_ON_CPU" not in os.environ  # put back as it was



# --- the dry run, end to end ---------------------------------------------------------------------
def _child_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                OMP_NUM_THREADS="1")


#: the campaign's `parts` one after another, then the results converter, in ONE child process (argv: raw folder,
#: results folder, parts): each part's exit status is checked as its own process's would be (10 + the part when it
#: is not 0), the converter's is the child's. On CPU a fresh process per part only imports torch, Lightning and
#: transformers again (~5 CPU-s each); on a GPU the campaign starts each part alone (test_the_one_call_script...
#: runs them so, as `python -m benchmarks.gpu_campaign`).
DRY_PARTS_THEN_CONVERTER = """import sys
from benchmarks import gpu_campaign, gpu_results
raw, out, *parts = sys.argv[1:]
for part in parts:
    status = gpu_campaign.main(["--part", part, "--out", raw, "--dry-run", "--jobs", "1", "--measure-jobs", "1",
                                "--budget-s", "86400"])
    if status != 0:
        sys.exit(f"part {part} exited {status}")
sys.exit(gpu_results.main([raw, "--results", out]))
"""


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, Path]:
    """All four parts on CPU into raw/ (each asserted to exit 0), then the converter into md/ (asserted to exit 0),
    in one child process: (raw, md). Two tests read it (tests/conftest.py keeps this module on one xdist worker); one
    child instead of one per pair of parts saves a start-up of torch, Lightning and transformers and a second
    converter run. The campaign's own time budget (a GPU lease's wall clock) is set far out: on a loaded machine the
    dry run is slow, not hung (run_watched tells the two apart)."""
    root = tmp_path_factory.mktemp("dry-run")
    raw, out = root / "raw", root / "md"
    done = run_watched([sys.executable, "-c", DRY_PARTS_THEN_CONVERTER, str(raw), str(out), "1", "2", "3", "4"],
                       cwd=ROOT, env=_child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return raw, out


@pytest.mark.slow
def test_dry_run_of_parts_1_and_2_then_the_converter(dry_run):
    """Parts 1 and 2 on CPU (a few minutes on 2 cores), then their results rendered."""
    raw, out = dry_run
    assert sorted(p.name for p in raw.iterdir()) == [f"part{n}.{ext}" for n in (1, 2, 3, 4) for ext in ("json", "log")]
    part1 = json.loads((raw / "part1.json").read_text())["sections"]
    part2 = json.loads((raw / "part2.json").read_text())["sections"]
    assert all(s["status"] == "done" for s in [*part1.values(), *part2.values()])
    (row,) = part1["accuracy_zoo"]["rows"]
    assert row["case"] == "linear-b64-sgd" and row["truth"]["max_allocated"] == 8_776_520  # the hand-checked peak
    assert abs(row["native_err_allocated"]) < 0.01
    assert part1["validate"]["mlp-first"]["json"]["within_goal"] is True
    assert part2["oom_retry"]["finished"] is True and part2["oom_retry"]["rank_log"]["events"]["sample"] >= 1
    assert part2["oom_retry"]["rank_log"]["events"]["oom_retry"] >= 1  # the SIMULATED OOM was retried smaller
    assert part2["oom_retry"]["loss_reduction"].startswith("cross_entropy: a mean over the targets")
    pvb = part2["plan_vs_bisect_mlp"]
    assert pvb["truth_max_micro_batch"] >= 1 and pvb["probes"] and pvb["planned_runs"] in (True, False)
    assert pvb["batch_size_finder_seconds"] > 0 and part2["callback_overhead"]["own_us_per_step"] > 0
    for name in ("accuracy_gpu", "cuda_overheads_gpu", "validate_gpu", "plan_vs_bisect_gpu", "callback_gpu"):
        text = (out / f"{name}.md").read_text()
        assert "DRY RUN on CPU" in text and "Device: no GPU" in text


def test_a_child_out_of_time_is_killed_with_its_own_children(tmp_path):
    from benchmarks.processes import run_group

    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_group(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout=2)
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; init reaps the orphan shortly after
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the grandchild {grandchild} outlived its killed parent")


@pytest.mark.slow
def test_dry_run_of_parts_3_and_4_then_the_converter(dry_run):
    """Parts 3 and 4 on CPU with tiny sizes (their cases in the campaign's process, FSDP2's in a child), then
    rendered: every gap case and every timed setting is there, and every timed setting gets a prediction."""
    from benchmarks.gpu_extra import DRY_GAPS, TIME_MODELS, time_settings

    raw, out = dry_run
    part3 = json.loads((raw / "part3.json").read_text())["sections"]
    part4 = json.loads((raw / "part4.json").read_text())["sections"]
    assert all(s["status"] == "done" for s in [*part3.values(), *part4.values()])
    gaps = part3["memory_gaps"]["rows"]
    assert set(gaps) == set(DRY_GAPS)
    for name in DRY_GAPS:
        assert gaps[name]["truth"]["device"] == "cpu", gaps[name]
        assert "error" not in gaps[name]["native"], gaps[name]
    assert gaps["autocast-cache-lstm-b32"]["native"]["peak_allocated"] > 0
    for model in TIME_MODELS:
        timed = part4[f"step_time_{model}"]["rows"]
        assert [(r["precision"], r["micro_batch"], r["checkpointing"]) for r in timed] == time_settings(model, True)
        assert all(r["step_seconds_median"] > 0 for r in timed)
    rendered = json.loads((out / "step_time_gpu.json").read_text())["rows"]
    assert len(rendered) == sum(len(time_settings(m, True)) for m in TIME_MODELS)
    assert all(r["predicted"]["step_seconds"] > 0 for r in rendered)
    for name in ("memory_gaps_gpu", "step_time_gpu"):
        assert "DRY RUN on CPU" in (out / f"{name}.md").read_text()


@pytest.mark.slow
def test_the_one_call_script_runs_the_parts_in_order_and_ends_on_its_own(tmp_path):
    """benchmarks/gpu_campaign.sh with budgets too short for any section: it still writes all four parts, parts 1
    and 3 both end before part 2 starts (part 3 runs in the background and is waited for), part 4 runs last, and it
    exits by itself. Whether parts 1 and 3 overlap in time is not asserted: on a loaded machine the quick dry-run
    part 3 can finish before part 1 has written its start (seen in CI: 07:45:31 against 07:45:32)."""
    env = dict(_child_env(), PYTHON=sys.executable, PART1_S="3", PART2_S="3", PART3_S="3", PART4_S="3")
    raw = tmp_path / "raw"
    done = run_watched(["bash", str(ROOT / "benchmarks" / "gpu_campaign.sh"), str(raw), "--dry-run"], cwd=ROOT, env=env)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]  # every section skipped: not all done
    parts = {n: json.loads((raw / f"part{n}.json").read_text()) for n in (1, 2, 3, 4)}
    assert all(p["dry_run"] and p["budget_s"] == 3 for p in parts.values())
    assert parts[1]["finished"] <= parts[2]["started"]
    assert parts[3]["finished"] <= parts[2]["started"]
    assert parts[2]["finished"] <= parts[4]["started"]
    assert all(s["status"] == "skipped: out of time" for s in parts[2]["sections"].values())
