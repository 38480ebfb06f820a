"""The GPU campaign starts, survives failures, and its results become the committed files.

The end-to-end test runs both parts' dry run (CPU, tiny sizes) and the results converter on what they wrote;
the converter's GPU path is checked on parts written here in the campaign's layout, since no GPU is available.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from subprocess_run import run_watched

from benchmarks import gpu_campaign, gpu_extra_results, gpu_results
from benchmarks.accuracy_gpu import EXTRA_PRECISIONS, extra_cases, make_row
from benchmarks.plan_vs_bisect_gpu import search_largest
from benchmarks.zoo import CASES
from memplan.estimator.cuda import overheads as cuda
from memplan.estimator.calibration import CalibrationKey, load_calibrations
from memplan.units import MiB

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


# --- the converter on GPU-shaped parts -----------------------------------------------------------
ENV = {"status": "done", "python": "3.12.3", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "cudnn": 91300,
       "driver": "580.159.04", "cuda_driver": "13.0", "packages": {"pytorch-lightning": "2.6.6", "transformers": "5.17.0"},
       "gpu": {"name": "NVIDIA H100 80GB HBM3", "total_bytes": 85520809984, "compute_capability": [9, 0]},
       "memplan_commit": "0123456789abcdef"}


def _truth(allocated, reserved, nvml):
    return {"device": "cuda", "max_allocated": allocated, "max_reserved": reserved, "nvml_process_peak": nvml}


def _estimate(allocated, reserved, total):
    return {"peak_allocated": allocated, "peak_reserved": reserved, "device_total": total}


def _parts(tmp_path: Path) -> Path:
    """A part 1 and a part 2 in the campaign's layout, as a GPU run would write them (figures chosen here)."""
    rows = [make_row("mlp-b64", _truth(100 * MiB, 120 * MiB, 620 * MiB), _estimate(101 * MiB, 122 * MiB, 900 * MiB),
                     _estimate(101 * MiB, 122 * MiB, 900 * MiB)),
            make_row("gpt2-b4", _truth(1000 * MiB, 1100 * MiB, 1650 * MiB), _estimate(950 * MiB, 1100 * MiB, 1900 * MiB),
                     {"error": "EstimateError: boom"})]
    lazy = {"context": {"outside_allocator": 500 * MiB},
            "snapshots": [{"label": "nccl: before init", "outside_allocator": 530 * MiB}],
            "cublas": {"main_thread_workspace": 32 * MiB, "autograd_thread_workspace": 32 * MiB,
                       "cublaslt_extra_workspace": 0},
            "allocator": {"rows": [{"op": "malloc 512", "allocated": 512, "model_allocated": 512,
                                    "reserved": 2 * MiB, "model_reserved": 2 * MiB}], "mismatches": 0},
            "errors": {"nccl_one_rank": "RuntimeError: no NCCL"}}
    part1 = {"format": 1, "part": 1, "dry_run": False, "started": "2026-12-01T00:00:00+00:00", "sections": {
        "environment": ENV,
        "cuda_overheads": {"status": "done", "lazy": lazy, "eager": {"context": {"outside_allocator": 1200 * MiB}}},
        "accuracy_zoo": {"status": "out of time", "seconds": 400.0, "error": "TimeoutExpired: measure", "rows": rows},
    }}
    part2 = {"format": 1, "part": 2, "dry_run": False, "started": "2026-12-01T00:20:00+00:00", "sections": {
        "environment": ENV,
        "plan_vs_bisect_gpt2-small": {"status": "done", "config": "gpt2-small", "precision": "bf16-mixed",
                                      "checkpointing": False, "planned_micro_batch": 40, "planned_runs": True,
                                      "memplan_max_micro_batch": 46, "memplan_max_runs": True,
                                      "truth_max_micro_batch": 48, "truth_first_oom": 49, "ratio": 46 / 48,
                                      "suggest_seconds": 6.0, "batch_size_finder_seconds": 90.0,
                                      "batch_size_finder_batch": 32, "suggest_over_batch_size_finder": 6 / 90},
    }}
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "part1.json").write_text(json.dumps(part1))
    (folder / "part2.json").write_text(json.dumps(part2))
    return folder


def test_results_name_the_device_and_give_constants_that_replace_the_sourced_ones(tmp_path):
    out = tmp_path / "results"
    written = gpu_results.convert(_parts(tmp_path), out)
    assert {"accuracy_gpu.md", "cuda_overheads_gpu.md", "plan_vs_bisect_gpu.md", "calibration_gpu.json"} <= set(written)
    for md in out.glob("*.md"):
        text = md.read_text()
        assert "NVIDIA H100 80GB HBM3" in text and "driver 580.159.04" in text and "torch 2.11.0+cu130 (CUDA 13.0" in text
        assert "DRY RUN" not in text
    constants = json.loads((out / "cuda_overheads_gpu.json").read_text())
    lazy = constants["replaces"]["_CONTEXT_LAZY_BYTES[9]"]
    # the largest NVML peak - reserved over the cases: gpt2 550 MiB, mlp 500 MiB
    assert lazy["measured"] == 550 * MiB and lazy["now"] == cuda.cuda_overheads((9, 0), env={}).context_bytes
    assert constants["replaces"]["_CUBLAS_BIG_BYTES"]["measured"] == 32 * MiB
    assert constants["replaces"]["CudaOverheads.cublas_workspaces"]["measured"] == 2
    assert constants["replaces"]["_CONTEXT_EAGER_BYTES"]["measured"] == 1200 * MiB
    # the calibration file is one memplan reads, keyed by this GPU, driver, torch and CUDA
    (cal,) = load_calibrations(out / "calibration_gpu.json").values()
    assert cal.key == CalibrationKey(gpu_name="NVIDIA H100 80GB HBM3", driver_version="580.159.04",
                                     torch_version="2.11.0+cu130", cuda_version="13.0")
    assert cal.context_bytes == 550 * MiB and cal.compute_capability == (9, 0)
    accuracy = (out / "accuracy_gpu.md").read_text()
    assert "`accuracy_zoo`: **out of time**" in accuracy  # a cut-off section says so
    assert "| native_err_allocated | 3.00% | 5.00% | -5.00% | 2 | NOT met |" in accuracy  # mlp +1 %, gpt2 -5 %
    assert "gpt2-b4 (emulated): EstimateError: boom" in accuracy
    overheads = (out / "cuda_overheads_gpu.md").read_text()
    assert "nccl_one_rank: RuntimeError: no NCCL" in overheads
    assert "| gpt2-small | bf16-mixed | False | 40 (runs) | 46 (runs) | 48 (49) | 96% |" in (out / "plan_vs_bisect_gpu.md").read_text()


def test_results_refuse_a_dry_run_for_the_committed_folder(tmp_path):
    folder = _parts(tmp_path)
    data = json.loads((folder / "part1.json").read_text())
    (folder / "part1.json").write_text(json.dumps(dict(data, dry_run=True)))
    assert gpu_results.main([str(folder)]) == 2
    assert gpu_results.main([str(folder), "--results", str(tmp_path / "elsewhere")]) == 0
    assert "DRY RUN on CPU" in (tmp_path / "elsewhere" / "accuracy_gpu.md").read_text()


def test_results_name_the_folder_when_it_holds_no_part(tmp_path, capsys):
    assert gpu_results.main([str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err


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


def _dry_run(raw: Path, out: Path, parts: tuple[int, ...]) -> None:
    """The campaign's `parts` on CPU into `raw`, each asserted to exit 0, then the converter into `out`, asserted
    to exit 0. The campaign's own time budget (a GPU lease's wall clock) is set far out: on a loaded machine the dry
    run is slow, not hung (run_watched tells the two apart)."""
    done = run_watched([sys.executable, "-c", DRY_PARTS_THEN_CONVERTER, str(raw), str(out), *map(str, parts)],
                       cwd=ROOT, env=_child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_dry_run_of_both_parts_then_the_converter(tmp_path):
    """Both parts on CPU (a few minutes on 2 cores), then their results rendered. The campaign's own time
    budget (a GPU lease's wall clock) is set far out: on a loaded machine the dry run is slow, not hung
    (run_watched tells the two apart)."""
    raw, out = tmp_path / "raw", tmp_path / "md"
    _dry_run(raw, out, (1, 2))
    assert sorted(p.name for p in raw.iterdir()) == ["part1.json", "part1.log", "part2.json", "part2.log"]
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


def test_without_nvml_per_process_the_context_comes_from_the_probe(tmp_path):
    folder = _parts(tmp_path)
    data = json.loads((folder / "part1.json").read_text())
    for row in data["sections"]["accuracy_zoo"]["rows"]:  # a PID namespace hides this process from NVML
        row["truth"]["nvml_process_peak"] = None
    (folder / "part1.json").write_text(json.dumps(data))
    gpu_results.convert(folder, tmp_path / "results")
    lazy = json.loads((tmp_path / "results" / "cuda_overheads_gpu.json").read_text())["replaces"]["_CONTEXT_LAZY_BYTES[9]"]
    assert lazy["measured"] == 530 * MiB and "NVML saw no zoo process" in lazy["how"]


def test_cases_cut_off_by_the_budget_are_named(tmp_path):
    folder = _parts(tmp_path)
    data = json.loads((folder / "part1.json").read_text())
    data["sections"]["accuracy_zoo"].update(status="done", out_of_time=["gpt2-b4"])
    (folder / "part1.json").write_text(json.dumps(data))
    gpu_results.convert(folder, tmp_path / "results")
    assert ("`accuracy_zoo`: 1 cases not measured, cut off by the time budget: gpt2-b4."
            in (tmp_path / "results" / "accuracy_gpu.md").read_text())



def test_sections_that_did_not_run_or_were_cut_short_read_not_measured(tmp_path):
    """A skipped section, a failed probe and a search cut short say so; no cell reads None or a bare dash."""
    folder = _parts(tmp_path)
    part2 = json.loads((folder / "part2.json").read_text())
    part2["sections"].update({
        "oom_retry": {"status": "error", "seconds": 24.0, "error": "RuntimeError: gpu_probes oom-retry exited 1: boom",
                      "stderr_tail": "boom"},
        "plan_vs_bisect_gpt2-small": {"status": "out of time", "seconds": 91.0, "config": "gpt2-small",
                                      "precision": "bf16-mixed", "checkpointing": False, "planned_micro_batch": 64,
                                      "planned_runs": True, "memplan_max_micro_batch": 124, "suggest_seconds": 18.6,
                                      "probes": [{"micro_batch": 64, "fits": True, "max_reserved": 70 * MiB,
                                                  "nvml_process_peak": 80 * MiB, "seconds": 15.0},
                                                 {"micro_batch": 130, "fits": True, "max_reserved": 140 * MiB,
                                                  "nvml_process_peak": 150 * MiB, "seconds": 14.8}],
                                      "error": "TimeoutExpired: probe gpt2-small 142"},
        "callback_overhead": {"status": "skipped: out of time"},
        "plan_vs_bisect_cnn": {"status": "skipped: out of time"}})
    (folder / "part2.json").write_text(json.dumps(part2))
    out = tmp_path / "results"
    gpu_results.convert(folder, out)
    pvb, cb = (out / "plan_vs_bisect_gpu.md").read_text(), (out / "callback_gpu.md").read_text()
    assert ("| gpt2-small | bf16-mixed | False | 64 (runs) | 124 (not measured) | not measured (search cut short; "
            "130 ran) | not measured | 18.6 | not measured (not measured) | not measured | not measured |") in pvb
    assert "| gpt2-small | 130 | runs | 140.00 MiB | 150.00 MiB | 14.8 |" in pvb
    assert "`plan_vs_bisect_cnn`: not measured (skipped: out of time" in pvb and "| None |" not in pvb
    assert "`callback_overhead`: not measured (skipped: out of time" in cb
    assert "`oom_retry`: **error** after 24 s: RuntimeError: gpu_probes oom-retry exited 1: boom" in cb
    for md in out.glob("*.md"):
        text = md.read_text()
        assert not re.search(r"\bNone\b|\| - \|", text), (md.name, text)


TRACEBACK = """Traceback (most recent call last):
[rank0]:   File "/work/main/benchmarks/gpu_extra.py", line 272, in estimate_gap
[rank0]:     est = estimate(case.build, ...)
[rank0]:     raise AssertionError(
[rank0]: AssertionError: Expects the parameter to already be moved to device cpu
[rank0]: but got cuda:0
"""


def _gap_truth(allocated, reserved):
    return {"device": "cuda", "max_allocated": allocated, "max_reserved": reserved,
            "steady_max_allocated": allocated, "steady_max_reserved": reserved}


def test_memory_gaps_give_signed_errors_and_each_failure_in_one_line(tmp_path):
    """Part 3 in the campaign's layout (figures chosen here): truth vs native and emulated, allocated and
    reserved; a failed estimate's traceback tail becomes its exception's line; a case the part never reached
    reads "not measured"."""
    rows = {"vit-l16-fp32-b16": {"truth": _gap_truth(1000 * MiB, 1100 * MiB),
                                 "native": _estimate(990 * MiB, 1100 * MiB, 1900 * MiB),
                                 "emulated": _estimate(1010 * MiB, 1067 * MiB, 1900 * MiB)},
            "fsdp2-1gpu-fp32": {"truth": _gap_truth(2000 * MiB, 2200 * MiB), "native": {"error": TRACEBACK},
                                "emulated": _estimate(2040 * MiB, 2200 * MiB, 3000 * MiB)}}
    part3 = {"format": 1, "part": 3, "dry_run": False, "started": "2026-12-01T00:05:00+00:00", "sections": {
        "environment": ENV, "memory_gaps": {"status": "done", "cases": [*rows, "autocast-cache-bert-b8"], "rows": rows}}}
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "part3.json").write_text(json.dumps(part3))
    out = tmp_path / "results"
    assert gpu_results.convert(folder, out) == ["memory_gaps_gpu.json", "memory_gaps_gpu.md"]
    text = (out / "memory_gaps_gpu.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in text and "driver 580.159.04" in text and "(campaign part 3)" in text
    assert ("| vit-l16-fp32-b16 | 1000.00 MiB | 990.00 MiB | -1.00% | 1010.00 MiB | +1.00% | 1.07 GiB | 1.07 GiB | "
            "+0.00% | 1.04 GiB | -3.00% |") in text
    assert "| fsdp2-1gpu-fp32 | 1.95 GiB | estimate failed | failed | 1.99 GiB | +2.00% |" in text
    assert ("- fsdp2-1gpu-fp32 (native): AssertionError: Expects the parameter to already be moved to device cpu "
            "but got cuda:0\n") in text and "Traceback" not in text and "[rank0]" not in text
    assert "| autocast-cache-bert-b8 | not measured (no result" in text
    summary = json.loads((out / "memory_gaps_gpu.json").read_text())["summary"]
    assert summary["native_err_allocated"] == {"n": 1, "median_abs": pytest.approx(0.01), "worst": pytest.approx(-0.01)}
    assert summary["emulated_err_reserved"]["worst"] == pytest.approx(-0.03)


def test_measured_step_times_meet_the_planners_prediction(tmp_path):
    """Part 4 in the campaign's layout, as a dry run writes it (gpu_extra's tiny models, so the predictions'
    traces take seconds): each row gets predict_step's figure for its setting and the signed error; a failed
    setting and a section that never started read "not measured"."""
    def row(precision, micro, ckpt, seconds):
        return {"model": "gpt2-small", "precision": precision, "micro_batch": micro, "checkpointing": ckpt,
                "step_seconds_median": seconds, "step_seconds": [seconds], "parameters": 1, "tf32_matmul": False}

    rows = [row("bf16-mixed", 1, False, 0.002), row("bf16-mixed", 2, False, 0.003), row("bf16-mixed", 2, True, 0.004),
            row("32-true", 2, False, 0.005),
            {**row("32-true", 2, True, 0.0), "error": "OutOfMemoryError: CUDA out of memory."}]
    for r in rows[-1:]:
        del r["step_seconds_median"]
    part4 = {"format": 1, "part": 4, "dry_run": True, "started": "2026-12-01T00:10:00+00:00", "sections": {
        "environment": {**ENV, "gpu": None},
        "step_time_gpt2-small": {"status": "done", "rows": rows, "exit": 0},
        "step_time_vit-l16": {"status": "skipped: out of time"}}}
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "part4.json").write_text(json.dumps(part4))
    out = tmp_path / "results"
    gpu_results.convert(folder, out)
    got = json.loads((out / "step_time_gpu.json").read_text())
    assert got["gpu"] == gpu_extra_results.DRY_RUN_GPU
    timed = [r for r in got["rows"] if "predicted" in r]
    assert len(timed) == 4
    for r in timed:
        assert r["error"] == pytest.approx(r["predicted"]["step_seconds"] / r["step_seconds_median"] - 1)
        assert r["predicted"]["step_seconds"] == pytest.approx(
            r["predicted"]["micro_step_seconds"] + r["predicted"]["optimizer_seconds"])
    by = {(r["precision"], r["micro_batch"], r["checkpointing"]): r["predicted"]["step_seconds"] for r in timed}
    assert by["bf16-mixed", 2, True] > by["bf16-mixed", 2, False]  # the blocks' forward runs again
    errors = [r["error"] for r in timed]
    assert got["summary"]["worst"] == max(errors, key=abs) and got["summary"]["n"] == 4
    text = (out / "step_time_gpu.md").read_text()
    assert "DRY RUN on CPU" in text and "The traces ran on CPU" in text
    assert f"| gpt2-small | bf16-mixed | 2 | full | 0.0040 | {by['bf16-mixed', 2, True]:.4f} | " in text
    assert "| gpt2-small | 32-true | 2 | full | not measured | not measured | not measured |" in text
    assert "- gpt2-small 32-true micro-batch 2: OutOfMemoryError: CUDA out of memory." in text
    assert "`step_time_vit-l16`: not measured (skipped: out of time" in text


def test_step_times_are_predicted_for_the_measured_gpu_named_by_nvml():
    assert gpu_extra_results.catalog_gpu({"gpu": {"name": "NVIDIA H200"}}) == "H200"
    with pytest.raises(ValueError, match="'NVIDIA Imaginary 1'.*catalog"):
        gpu_extra_results.catalog_gpu({"gpu": {"name": "NVIDIA Imaginary 1"}})


@pytest.mark.slow
def test_dry_run_of_parts_3_and_4_then_the_converter(tmp_path):
    """Parts 3 and 4 on CPU with tiny sizes (their cases in the campaign's process, FSDP2's in a child), then
    rendered: every gap case and every timed setting is there, and every timed setting gets a prediction."""
    from benchmarks.gpu_extra import DRY_GAPS, TIME_MODELS, time_settings

    raw, out = tmp_path / "raw", tmp_path / "md"
    _dry_run(raw, out, (3, 4))
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
    """benchmarks/gpu_campaign.sh with budgets too short for any section: it still writes all four parts, part 3
    ends before part 2 starts (it ran beside part 1 and was waited for), part 4 runs last, and it exits by itself."""
    env = dict(_child_env(), PYTHON=sys.executable, PART1_S="3", PART2_S="3", PART3_S="3", PART4_S="3")
    raw = tmp_path / "raw"
    done = run_watched(["bash", str(ROOT / "benchmarks" / "gpu_campaign.sh"), str(raw), "--dry-run"], cwd=ROOT, env=env)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]  # every section skipped: not all done
    parts = {n: json.loads((raw / f"part{n}.json").read_text()) for n in (1, 2, 3, 4)}
    assert all(p["dry_run"] and p["budget_s"] == 3 for p in parts.values())
    assert parts[1]["started"] <= parts[3]["finished"] <= parts[2]["started"]
    assert parts[2]["finished"] <= parts[4]["started"]
    assert all(s["status"] == "skipped: out of time" for s in parts[2]["sections"].values())
