"""launch/torchrun.sh and launch/slurm.sbatch, run from a temporary directory (the scripts find the
repository from their own path): the CPU path end to end under torchrun with 2 gloo processes; the GPU
path on a simulated 4-GPU node (a stub Python answering `memplan devices`/`suggest` and recording the
torchrun call); the Slurm template with a stub `srun` on PATH and fake SLURM_* variables."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_run import run_watched
import yaml

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_SH = ROOT / "launch" / "torchrun.sh"
SLURM_SBATCH = ROOT / "launch" / "slurm.sbatch"
MLP = ROOT / "configs" / "mlp.yaml"


def _write_executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("script", [TORCHRUN_SH, SLURM_SBATCH], ids=lambda p: p.name)
def test_script_parses(script):
    run = run_watched(["bash", "-n", str(script)])
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("script", [TORCHRUN_SH, SLURM_SBATCH], ids=lambda p: p.name)
def test_script_without_config_is_a_usage_error(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CONFIG"}
    run = run_watched(["bash", str(script)], cwd=tmp_path, env=env)
    assert run.returncode == 2 and "usage:" in run.stderr


def test_torchrun_sh_trains_on_cpu_with_the_planner_planning_at_fit_start(tmp_path, capsys):
    env = dict(os.environ, OMP_NUM_THREADS="1", MEMPLAN_PYTHON=sys.executable, MEMPLAN_CPU="1")
    run = run_watched(
        [str(TORCHRUN_SH), str(MLP), "--", "--trainer.max_steps=3", "--trainer.log_every_n_steps=1"],
        cwd=tmp_path, env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert not list(tmp_path.glob("*.planned.yaml")), "the CPU path does not plan ahead"
    logs = sorted(tmp_path.glob("lightning_logs/*/memplan/rank*.jsonl"))
    assert [p.name for p in logs] == ["rank0.jsonl", "rank1.jsonl"]
    layouts = []
    for log in logs:
        events = [json.loads(line) for line in log.read_text().splitlines()]
        applied = [e for e in events if e.get("event") == "apply"]
        assert applied[0]["source"] == "planned from an estimate"
        layouts.append(applied[0]["layout"])
    assert layouts[0] == layouts[1], "every rank applies the same plan"
    # the config's memplan.global_batch_size reaches the callback, over 2 ranks
    assert layouts[0]["world_size"] == 2 and layouts[0]["global_batch_size"] == 1024
    # and memplan report turns the run's logs into the picture and the summary (the command's own code, in this
    # process: a child would only import torch again)
    from memplan.commands.cli import main

    run_dir = logs[0].parent.parent
    code = main(["report", str(run_dir)])
    report = capsys.readouterr()
    assert code == 0, report.err[-2000:]
    png = run_dir / "memplan_report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "rank" in report.out and "peak" in report.out


TINY_FSDP_GPT = {
    "seed_everything": 0,
    "trainer": {"strategy": "fsdp", "max_steps": 3, "log_every_n_steps": 1, "logger": {
        "class_path": "CSVLogger", "init_args": {"save_dir": "."}}, "enable_checkpointing": False},
    "model": {"class_path": "memplan.demos.GPTLM", "init_args": {
        "vocab_size": 64, "context": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "dropout": 0.0}},
    "data": {"class_path": "memplan.demos.RandomTokens", "init_args": {
        "batch_size": 4, "vocab_size": 64, "context": 16, "num_samples": 64}},
    "memplan": {"global_batch_size": 16},
}


def test_torchrun_sh_trains_an_fsdp_config_on_cpu_under_model_parallel_strategy(tmp_path):
    """A tiny GPT whose config names FSDP: 2 gloo processes under ModelParallelStrategy (FSDP2, the
    model's configure_model applying fully_shard), MemoryPlanner planning FSDP at setup on rank 0."""
    config = tmp_path / "tiny-fsdp.yaml"
    config.write_text(yaml.safe_dump(TINY_FSDP_GPT, sort_keys=False))
    env = dict(os.environ, OMP_NUM_THREADS="1", MEMPLAN_PYTHON=sys.executable, MEMPLAN_CPU="1")
    run = run_watched([str(TORCHRUN_SH), str(config)], cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in run.stdout + run.stderr
    logs = sorted(tmp_path.glob("lightning_logs/*/memplan/rank*.jsonl"))
    assert [p.name for p in logs] == ["rank0.jsonl", "rank1.jsonl"]
    for log in logs:
        events = [json.loads(line) for line in log.read_text().splitlines()]
        applied = next(e for e in events if e["event"] == "apply")
        assert applied["plan"]["strategy"] == "fsdp" and applied["plan"]["sharding_strategy"] == "FULL_SHARD"
        assert applied["layout"]["world_size"] == 2 and applied["layout"]["global_batch_size"] == 16
        assert events[-1]["event"] == "end" and events[-1]["status"] == "finished"
        assert [e["step"] for e in events if e["event"] == "sample"][-1] == 3


def test_torchrun_sh_narrows_cuda_visible_devices_to_the_planned_gpus(tmp_path):
    """A simulated GPU node: the stub Python says 4 GPUs are visible, 'plans' GPUs 1 and 3, and records
    the torchrun call instead of running it; CUDA_VISIBLE_DEVICES=4,5,6,7 was already set."""
    record = tmp_path / "torchrun.json"
    stub = _write_executable(tmp_path / "python-stub", f"""#!/usr/bin/env bash
set -euo pipefail
if [[ "$1 ${{2:-}} ${{3:-}}" == "-m memplan devices" ]]; then
    echo '{{"gpus": [{{"index": 0}}, {{"index": 1}}, {{"index": 2}}, {{"index": 3}}]}}'
elif [[ "$1 ${{2:-}} ${{3:-}}" == "-m memplan suggest" ]]; then
    out="${{@: -2:1}}"   # suggest CONFIG --output PATH --json
    echo 'trainer: {{devices: [1, 3]}}' > "$out"
    echo '{{"nodes": 1, "world_size": 2, "gpus": [1, 3]}}' > "${{out%.yaml}}.plan.json"
    echo '{{"world_size": 2}}'
elif [[ "$1 ${{2:-}}" == "-m torch.distributed.run" ]]; then
    shift 2
    {sys.executable} -c 'import json, os, sys
json.dump({{"argv": sys.argv[1:], "cuda_visible_devices": os.environ["CUDA_VISIBLE_DEVICES"]}}, open("{record}", "w"))' "$@"
    exit 3
else
    exec {sys.executable} "$@"
fi
""")
    env = dict(os.environ, MEMPLAN_PYTHON=str(stub), CUDA_VISIBLE_DEVICES="4,5,6,7")
    for key in ("MEMPLAN_CPU", "MEMPLAN_GPUS", "MEMPLAN_OUTPUT_DIR"):
        env.pop(key, None)
    run = run_watched([str(TORCHRUN_SH), str(MLP), "--", "--trainer.max_steps=3"],
                      cwd=tmp_path, env=env)
    assert run.returncode == 3, run.stderr  # torchrun's exit status is the script's
    called = json.loads(record.read_text())
    assert called["cuda_visible_devices"] == "5,7"
    assert called["argv"] == ["--nproc-per-node=2", "--standalone", "-m", "memplan.train", "fit",
                              "--config", str(tmp_path / "mlp.planned.yaml"), "--trainer.devices=2",
                              "--trainer.max_steps=3"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_slurm_template_plans_once_and_sruns_the_planned_config(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "python-calls.txt"
    srun_calls = tmp_path / "srun.jsonl"
    # counts every Python invocation of the batch script, then runs the real one
    python = _write_executable(bin_dir / "python-counting", f"""#!/usr/bin/env bash
echo "$*" >> {calls}
exec {sys.executable} "$@"
""")
    _write_executable(bin_dir / "srun", f"""#!{sys.executable}
import json, os, sys
env = {{k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "MASTER_"))}}
with open("{srun_calls}", "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "env": env, "cwd": os.getcwd()}}) + "\\n")
""")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", MEMPLAN_PYTHON=str(python),
               MEMPLAN_GPU="A100-80GB", SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="4",
               SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_NODELIST="node[01-02]")
    for key in ("CONFIG", "NODES", "GPUS_PER_NODE", "OUTPUT_DIR", "MASTER_PORT", "MEMPLAN_REPO"):
        env.pop(key, None)
    run = run_watched(["bash", str(SLURM_SBATCH), "configs/mlp.yaml", "--", "--trainer.max_steps=5"],
                      cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    suggests = [line for line in calls.read_text().splitlines() if line.startswith("-m memplan suggest")]
    out_dir = tmp_path / "memplan-4242"
    planned = out_dir / "planned.yaml"
    assert suggests == [f"-m memplan suggest {MLP} --nodes 2 --gpus 4 --output {planned} --gpu A100-80GB"]
    plan = json.loads((out_dir / "planned.plan.json").read_text())
    assert plan["nodes"] == 2
    per_node = plan["world_size"] // 2
    trainer = yaml.safe_load(planned.read_text())["trainer"]
    assert trainer["num_nodes"] == 2 and trainer["devices"] == per_node

    sruns = [json.loads(line) for line in srun_calls.read_text().splitlines()]
    assert len(sruns) == 1
    assert sruns[0]["argv"] == [
        "--nodes=2", f"--ntasks-per-node={per_node}", f"--ntasks={2 * per_node}", "--kill-on-bad-exit=1",
        str(python), "-m", "memplan.train", "fit", "--config", str(planned), "--trainer.max_steps=5",
    ]
    assert "torchrun" not in " ".join(sruns[0]["argv"])
    assert sruns[0]["env"]["MASTER_PORT"] == "29500" and sruns[0]["env"]["SLURM_NNODES"] == "2"
    assert sruns[0]["cwd"] == str(tmp_path)


# --- which Python: the project's .venv from any directory, MEMPLAN_PYTHON first, python3 last -------
def _clone(tmp_path: Path, *, venv: bool) -> Path:
    """A checkout's launch/ folder in tmp_path/clone, with a simulated .venv whose python records each
    call and runs the real one, except torchrun, which it records and answers with status 7."""
    clone = tmp_path / "clone"
    (clone / "launch").mkdir(parents=True)
    for name in ("torchrun.sh", "python.sh", "train.py"):
        shutil.copy2(ROOT / "launch" / name, clone / "launch" / name)
    if venv:
        (clone / ".venv" / "bin").mkdir(parents=True)
        _recording_python(clone / ".venv" / "bin" / "python", tmp_path / "venv-calls.txt")
    return clone


def _recording_python(path: Path, calls: Path) -> Path:
    return _write_executable(path, f"""#!/usr/bin/env bash
echo "$*" >> {calls}
[[ "$1 ${{2:-}}" != "-m torch.distributed.run" ]] || exit 7
exec {sys.executable} "$@"
""")


def _python3_without_torch(bin_dir: Path) -> Path:
    """A simulated python3 on PATH that has no torch (as on a fresh machine)."""
    bin_dir.mkdir(exist_ok=True)
    return _write_executable(bin_dir / "python3", """#!/usr/bin/env bash
echo "Traceback (most recent call last):" >&2
echo "ModuleNotFoundError: No module named 'torch'" >&2
exit 1
""")


def _script_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", MEMPLAN_CPU="1", **extra)
    if "MEMPLAN_PYTHON" not in extra:
        env.pop("MEMPLAN_PYTHON", None)
    return env


def test_torchrun_sh_runs_the_projects_venv_from_another_directory_without_activation(tmp_path):
    clone = _clone(tmp_path, venv=True)
    _python3_without_torch(tmp_path / "bin")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = run_watched([str(clone / "launch" / "torchrun.sh"), str(MLP)], cwd=elsewhere,
                      env=_script_env(tmp_path))
    assert run.returncode == 7, run.stderr  # the simulated torchrun's status, through the venv's python
    torchrun = [c for c in (tmp_path / "venv-calls.txt").read_text().splitlines()
                if c.startswith("-m torch.distributed.run")]
    assert len(torchrun) == 1 and f" -m memplan.train fit --config {MLP} " in torchrun[0]


def test_memplan_python_wins_over_the_venv(tmp_path):
    clone = _clone(tmp_path, venv=True)
    chosen = _recording_python(tmp_path / "chosen-python", tmp_path / "chosen-calls.txt")
    run = run_watched([str(clone / "launch" / "torchrun.sh"), str(MLP)], cwd=tmp_path,
                      env=_script_env(tmp_path, MEMPLAN_PYTHON=str(chosen)))
    assert run.returncode == 7, run.stderr
    assert "-m torch.distributed.run" in (tmp_path / "chosen-calls.txt").read_text()
    assert not (tmp_path / "venv-calls.txt").exists()


@pytest.mark.parametrize("script", ["torchrun.sh", "slurm.sbatch"])
def test_a_python_without_torch_is_named_with_the_fix_before_any_step(tmp_path, script):
    clone = _clone(tmp_path, venv=False)
    shutil.copy2(ROOT / "launch" / "slurm.sbatch", clone / "launch" / "slurm.sbatch")
    _python3_without_torch(tmp_path / "bin")
    env = _script_env(tmp_path, SLURM_NNODES="1", SLURM_NTASKS_PER_NODE="2", SLURM_SUBMIT_DIR=str(tmp_path))
    run = run_watched(["bash", str(clone / "launch" / script), str(MLP)], cwd=tmp_path, env=env)
    assert run.returncode == 3, run.stderr
    first = run.stderr.splitlines()[0]
    assert "python3 on PATH" in first and f"no {clone}/.venv" in first and "No module named 'torch'" in first
    assert "MEMPLAN_PYTHON" in run.stderr and "scripts/install.py" in run.stderr
    assert "Traceback" not in run.stderr and "JSONDecodeError" not in run.stderr


def test_a_failing_step_ends_the_script_with_its_own_status_and_name(tmp_path):
    """memplan devices fails (simulated: status 5): the script ends there, not in the JSON reading after it."""
    stub = _write_executable(tmp_path / "python-stub", f"""#!/usr/bin/env bash
if [[ "$1 ${{2:-}} ${{3:-}}" == "-m memplan devices" ]]; then
    echo "memplan: error: NVML says no" >&2
    exit 5
fi
exec {sys.executable} "$@"
""")
    env = _script_env(tmp_path, MEMPLAN_PYTHON=str(stub))
    env.pop("MEMPLAN_CPU")
    run = run_watched([str(TORCHRUN_SH), str(MLP)], cwd=tmp_path, env=env)
    assert run.returncode == 5, run.stderr
    assert run.stderr.splitlines()[-1].endswith("memplan devices failed (exit 5)")
    assert "NVML says no" in run.stderr and "Traceback" not in run.stderr


#: a simulated `memplan suggest ... --output PATH ...`: writes a 1-node, 2-GPU plan pair where the real one would,
#: for runs that check only what the script hands it
SUGGEST_STUB = """if [[ "${1:-} ${2:-} ${3:-}" == "-m memplan suggest" ]]; then
    while [[ $# -gt 0 && "$1" != "--output" ]]; do shift; done
    [[ $# -ge 2 ]] || { echo "simulated memplan suggest: no --output PATH" >&2; exit 97; }
    out="$2"
    echo 'trainer: {devices: 2}' > "$out"
    echo '{"nodes": 1, "world_size": 2}' > "${out%.yaml}.plan.json"
    exit 0
fi
"""


def test_slurm_template_runs_the_projects_venv_and_hands_it_to_srun(tmp_path):
    """The .venv's python (simulated: it answers `memplan suggest` with a 1-node, 2-task plan) plans and
    is the one srun starts on every node, from a submit directory outside the checkout."""
    clone = _clone(tmp_path, venv=False)
    shutil.copy2(ROOT / "launch" / "slurm.sbatch", clone / "launch" / "slurm.sbatch")
    (clone / ".venv" / "bin").mkdir(parents=True)
    venv_python = _write_executable(clone / ".venv" / "bin" / "python", (
        f'#!/usr/bin/env bash\necho "$*" >> {tmp_path / "venv-calls.txt"}\n' + SUGGEST_STUB
        + f'exec {sys.executable} "$@"\n'))
    (tmp_path / "bin").mkdir()
    srun_calls = tmp_path / "srun.json"
    _write_executable(tmp_path / "bin" / "srun", f"""#!{sys.executable}
import json, sys
json.dump(sys.argv[1:], open("{srun_calls}", "w"))
""")
    submit = tmp_path / "submit"
    submit.mkdir()
    env = _script_env(tmp_path, SLURM_JOB_ID="7", SLURM_NNODES="1", SLURM_NTASKS_PER_NODE="2",
                      SLURM_SUBMIT_DIR=str(submit))
    for key in ("CONFIG", "NODES", "GPUS_PER_NODE", "OUTPUT_DIR", "MEMPLAN_REPO", "MEMPLAN_GPU", "MEMPLAN_GPU_MEMORY"):
        env.pop(key, None)
    run = run_watched(["bash", str(clone / "launch" / "slurm.sbatch"), str(MLP)], cwd=submit, env=env)
    assert run.returncode == 0, run.stderr
    assert "-m memplan suggest" in (tmp_path / "venv-calls.txt").read_text()
    argv = json.loads(srun_calls.read_text())
    assert argv[-6:] == [str(venv_python), "-m", "memplan.train", "fit", "--config",
                         str(submit / "memplan-7" / "planned.yaml")]


def _slurm_run(tmp_path: Path, config: Path, *args: str, simulated_suggest: bool = False,
               **env_extra: str) -> tuple[subprocess.CompletedProcess, list]:
    """launch/slurm.sbatch with a counting Python and a recording srun (job 4242, 1 node x 2 tasks): the run, and
    the memplan suggest calls it made (run for real, or by SUGGEST_STUB where simulated_suggest)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "python-calls.txt"
    calls.write_text("")
    python = _write_executable(bin_dir / "python-counting", f"""#!/usr/bin/env bash
echo "$*" >> {calls}
{SUGGEST_STUB if simulated_suggest else ""}exec {sys.executable} "$@"
""")
    _write_executable(bin_dir / "srun", "#!/usr/bin/env bash\nexit 0\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", MEMPLAN_PYTHON=str(python),
               MEMPLAN_GPU="A100-80GB", SLURM_JOB_ID="4242", SLURM_NNODES="1", SLURM_NTASKS_PER_NODE="2",
               SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_NODELIST="node01")
    for key in ("CONFIG", "NODES", "GPUS_PER_NODE", "OUTPUT_DIR", "MASTER_PORT", "MEMPLAN_REPO", "MEMPLAN_FORCE"):
        env.pop(key, None)
    env.update(env_extra)
    run = run_watched(["bash", str(SLURM_SBATCH), *args, str(config)], cwd=tmp_path, env=env)
    suggests = [line for line in calls.read_text().splitlines() if line.startswith("-m memplan suggest")]
    return run, suggests


def _small_mlp(tmp_path: Path) -> Path:
    """configs/mlp.yaml 8 features wide with one precision to search: the Slurm template does the same with its
    plan, and `memplan suggest` plans it in less time (~7 against ~9 CPU-s, most of both importing Lightning)."""
    config = yaml.safe_load(MLP.read_text())
    config["model"]["init_args"].update(in_features=8, hidden=8, depth=1)
    config["data"]["init_args"].update(in_features=8)
    config["trainer"]["callbacks"][0]["init_args"]["suggest"]["precisions"] = ["32-true"]
    path = tmp_path / "mlp.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_a_requeued_slurm_job_reuses_its_plan_and_replans_when_the_config_changed(tmp_path):
    config = _small_mlp(tmp_path)
    # the first run's plan simulated (what is reused is the script's concern); the replan below is suggest's own
    first, suggests = _slurm_run(tmp_path, config, simulated_suggest=True)
    assert first.returncode == 0 and len(suggests) == 1, first.stderr[-2000:]
    planned = tmp_path / "memplan-4242" / "planned.yaml"
    before = planned.read_text()
    again, suggests = _slurm_run(tmp_path, config)  # requeued: same job id, same config
    assert again.returncode == 0, again.stderr[-2000:]
    assert suggests == [] and "reusing" in again.stderr and planned.read_text() == before
    text = yaml.safe_load(config.read_text())
    text["trainer"]["callbacks"][0]["init_args"]["global_batch_size"] = 512  # the user edited it before the requeue
    config.write_text(yaml.safe_dump(text))
    changed, suggests = _slurm_run(tmp_path, config)
    assert changed.returncode == 0, changed.stderr[-2000:]
    assert len(suggests) == 1 and suggests[0].endswith("--force") and "planning again" in changed.stderr
    assert json.loads((tmp_path / "memplan-4242" / "planned.plan.json").read_text())["global_batch_size"] == 512
    assert not [p.name for p in (tmp_path / "memplan-4242").iterdir() if p.name.startswith(".")]


def test_slurm_never_replaces_a_users_files_without_force_and_passes_force_through(tmp_path):
    config = _small_mlp(tmp_path)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "planned.yaml").write_text("the user's own\n")
    refused, _ = _slurm_run(tmp_path, config, OUTPUT_DIR=str(out))
    assert refused.returncode == 2 and "pass --force" in refused.stderr
    assert (out / "planned.yaml").read_text() == "the user's own\n"
    forced, suggests = _slurm_run(tmp_path, config, "--force", OUTPUT_DIR=str(out))
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert suggests[0].endswith("--force") and "trainer" in (out / "planned.yaml").read_text()
    # MEMPLAN_FORCE=1 is --force: what the script hands suggest (whose own --force the run above checked)
    by_env, suggests = _slurm_run(tmp_path, config, OUTPUT_DIR=str(out), MEMPLAN_FORCE="1", simulated_suggest=True)
    assert by_env.returncode == 0 and suggests[0].endswith("--force"), by_env.stderr[-2000:]
    assert "planning again" in by_env.stderr
