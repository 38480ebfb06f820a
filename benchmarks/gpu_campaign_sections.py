"""benchmarks.gpu_campaign's sections: each measurement a part runs (the environment, the CUDA overheads, `memplan
validate`, accuracy, planner against bisection, the MemoryPlanner probes, the memory gaps, the kernel profile and
the step times), each filling its entry of part<N>.json from child processes."""
from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from benchmarks.gpu_campaign_record import ROOT, Recorder, marked_json, run_child

VALIDATE = (("gpt2-small", 8), ("cnn", 64))
DRY_VALIDATE = (("mlp", 8),)
PACKAGES = ("torch", "pytorch-lightning", "lightning", "lightning-utilities", "torchmetrics", "transformers",
            "nvidia-ml-py", "psutil", "rich", "matplotlib", "PyYAML", "numpy", "jsonargparse", "docstring-parser",
            "typeshed-client")



# --- sections -------------------------------------------------------------------------------------
def environment(entry: dict, dry: bool) -> None:
    """Versions and the GPU as NVML sees it, with no CUDA context in this process."""
    import torch

    from memplan.hardware import gpu_for_cuda_index, nvml_query, nvml_unavailable_reason

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    gpu = gpu_for_cuda_index(0)
    cuda_driver = nvml_query("nvmlSystemGetCudaDriverVersion", default=None)
    entry.update(
        python=platform.python_version(), platform=platform.platform(), cpu_count=os.cpu_count(),
        torch=torch.__version__, torch_cuda=torch.version.cuda, cudnn=_cudnn_version(), packages=versions,
        nvml_unavailable=nvml_unavailable_reason(),
        driver=nvml_query("nvmlSystemGetDriverVersion", default=None),
        cuda_driver=None if not isinstance(cuda_driver, int) else f"{cuda_driver // 1000}.{cuda_driver % 1000 // 10}",
        gpu=None if gpu is None else {"name": gpu.name, "total_bytes": gpu.total_bytes, "used_bytes": gpu.used_bytes,
                                      "compute_capability": gpu.compute_capability, "mig_mode": gpu.mig_mode,
                                      "processes": len(gpu.processes)},
        env={k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_MODULE_LOADING", "PYTORCH_CUDA_ALLOC_CONF",
                                             "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG", "PYTHONPATH")},
        memplan_commit=_git_commit(), dry_run=dry,
    )
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        entry["nvidia_smi"] = smi.stdout[-3000:]


def _cudnn_version() -> int | None:
    import torch

    try:
        return torch.backends.cudnn.version()
    except RuntimeError:  # no cuDNN in this build
        return None


def _git_commit() -> str | None:
    if not shutil.which("git"):
        return None
    got = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return got.stdout.strip() or None


def cuda_overheads(rec: Recorder, entry: dict) -> None:
    from benchmarks.gpu_probes import RESULT_MARKER, run_probe
    from memplan.hardware import nvml_available

    for key, probe, extra_env in (("lazy", "overheads", {}), ("eager", "context", {"CUDA_MODULE_LOADING": "EAGER"})):
        if rec.settings.dry_run and not nvml_available():  # no driver: the probe says so without touching CUDA
            entry[key] = run_probe(probe, cpu=True, repeat=1)
            continue
        done = run_child(rec, [sys.executable, "-m", "benchmarks.gpu_probes", probe],
                         env=dict(os.environ, **extra_env), cap_s=180)
        entry[key] = (marked_json(done.stdout, RESULT_MARKER) if done.returncode == 0
                      else {"error": done.stderr.strip()[-3000:]})
        rec.save()


def validate(rec: Recorder, entry: dict, dry: bool) -> None:
    """`memplan validate` twice per config: the first run saves the calibration, the second uses it."""
    folder = Path(tempfile.mkdtemp(prefix="memplan-validate-"))
    calibration = folder / "calibration.json"
    env = dict(os.environ, MEMPLAN_CALIBRATION=str(calibration))
    try:
        for config, batch in DRY_VALIDATE if dry else VALIDATE:
            for attempt in ("first",) if dry else ("first", "calibrated"):
                argv = [sys.executable, "-m", "memplan", "validate", str(ROOT / "configs" / f"{config}.yaml"),
                        "--batch-size", str(batch), "--json"]
                done = _validate_here(argv, env) if dry else run_child(rec, argv, env=env, cap_s=240)
                result = {"command": " ".join(argv[1:]), "exit": done.returncode,
                          "stderr_tail": done.stderr.strip()[-1500:]}
                try:
                    result["json"] = json.loads(done.stdout)
                except json.JSONDecodeError:
                    result["stdout_tail"] = done.stdout.strip()[-3000:]
                entry[f"{config}-{attempt}"] = result
                rec.save()
        entry["calibration_file"] = json.loads(calibration.read_text()) if calibration.is_file() else None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _validate_here(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    """A dry run's `memplan validate` (argv as a child would run it) in this process, with env's calibration file:
    on CPU a fresh process only imports Lightning again, and the CPU truth is the profiler's, not the process's."""
    from memplan.commands.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved = os.environ.get("MEMPLAN_CALIBRATION")
    os.environ["MEMPLAN_CALIBRATION"] = env["MEMPLAN_CALIBRATION"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv[3:])
    finally:
        if saved is None:
            os.environ.pop("MEMPLAN_CALIBRATION", None)
        else:
            os.environ["MEMPLAN_CALIBRATION"] = saved
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def accuracy(rec: Recorder, entry: dict, names: list[str], dry: bool) -> None:
    """Each case's truth (GPU processes, measure_jobs at once) and native + emulated estimates (jobs at once);
    a dry run gets all three in this process (benchmarks.accuracy_gpu.dry_case)."""
    from benchmarks.accuracy_gpu import child_command, dry_case, make_row, parse_child, summarize

    entry.update(cases=list(names), rows=[], missing=[])
    parts: dict[str, dict] = {name: {} for name in names}

    def one(mode: str, name: str, emulate: bool) -> dict:
        if rec.left() <= 10:
            return {"error": "skipped: out of time"}
        argv, env = child_command(mode, name, cpu=dry, emulate=emulate)
        env.setdefault("OMP_NUM_THREADS", "2")  # up to jobs + measure_jobs processes share the CPUs
        try:
            done = run_child(rec, argv, env=env, cap_s=300)
        except subprocess.TimeoutExpired:
            return {"error": "killed: out of time"}
        try:
            return parse_child(done.returncode, done.stdout, done.stderr)
        except (json.JSONDecodeError, IndexError) as err:
            return {"error": f"unreadable output: {err}"}

    def finished(name: str) -> None:
        row = make_row(name, parts[name]["truth"], parts[name]["native"], parts[name]["emulated"])
        entry["rows"].append(row)
        entry["summary"] = summarize(entry["rows"])
        errors = {k: v["error"] for k, v in parts[name].items() if "error" in v}
        rec.log(f"accuracy {name}: allocated err native {_pct(row['native_err_allocated'])} "
                f"emulated {_pct(row['emulated_err_allocated'])}" + (f" errors {errors}" if errors else ""))
        rec.save()

    s = rec.settings
    if dry:  # on CPU no allocator state or CUDA context to keep apart: the cases run here, one after another
        for name in names:
            parts[name] = (dry_case(name) if rec.left() > 10
                           else dict.fromkeys(("truth", "native", "emulated"), {"error": "skipped: out of time"}))
            finished(name)
    with ThreadPoolExecutor(s.measure_jobs) as gpu_pool, ThreadPoolExecutor(s.jobs) as cpu_pool:
        futures = {}
        for name in [] if dry else names:
            futures[gpu_pool.submit(one, "measure", name, False)] = (name, "truth")
            futures[cpu_pool.submit(one, "estimate", name, False)] = (name, "native")
            futures[cpu_pool.submit(one, "estimate", name, True)] = (name, "emulated")
        for future in as_completed(futures):
            name, what = futures[future]
            parts[name][what] = future.result()
            if len(parts[name]) == 3:
                finished(name)
    order = {name: i for i, name in enumerate(entry["cases"])}
    entry["rows"].sort(key=lambda r: order[r["case"]])
    entry["missing"] = [r["case"] for r in entry["rows"] if "error" in r["truth"]]
    entry["out_of_time"] = [r["case"] for r in entry["rows"]
                            if any("out of time" in r[k].get("error", "") for k in ("truth", "native", "emulated"))]
    if entry["missing"]:
        rec.log(f"accuracy: no truth for {len(entry['missing'])} cases: {' '.join(entry['missing'])}")


def _pct(e: float | None) -> str:
    return "-" if e is None else f"{100 * e:+.2f}%"


def plan_vs_bisect(rec: Recorder, entry: dict, config: str, dry: bool) -> None:
    from benchmarks.plan_vs_bisect_gpu import run_one

    try:
        run_one(config, entry, dry=dry, deadline=rec.deadline, saved=rec.save)
    finally:
        rec.save()


def probe(rec: Recorder, entry: dict, name: str, dry: bool, cap_s: float, repeat: int = 1) -> None:
    from benchmarks.gpu_probes import RESULT_MARKER, run_probe
    from benchmarks.gpu_report import one_line

    if dry:  # on CPU a fresh process only restarts Lightning: the probe runs here
        entry.update(run_probe(name, cpu=True, repeat=1))
        return
    done = run_child(rec, [sys.executable, "-m", "benchmarks.gpu_probes", name, "--repeat", str(repeat)],
                     env=dict(os.environ), cap_s=cap_s)
    entry["stderr_tail"] = done.stderr.strip()[-3000:]
    if done.returncode != 0:
        raise RuntimeError(f"gpu_probes {name} exited {done.returncode}: {one_line(done.stderr)[:2000]}")
    entry.update(marked_json(done.stdout, RESULT_MARKER))


def memory_gaps(rec: Recorder, entry: dict, names: list[str], dry: bool) -> None:
    """benchmarks.gpu_extra's gap cases: each truth in a fresh GPU process (measure_jobs at once), its native and
    emulated estimates in CPU processes (jobs at once); a dry run skips the estimates' second fresh process."""
    from benchmarks.gpu_extra import RESULT_MARKER, gap_cases, run_gap

    entry.update(cases=list(names), rows={})

    def one(mode: str, name: str, emulate: bool) -> dict:
        if rec.left() <= 10:
            return {"error": "skipped: out of time"}
        env = dict(os.environ, OMP_NUM_THREADS="2", MEMPLAN_TRACE_ON_CPU="1" if emulate else "0")
        argv = [sys.executable, "-m", "benchmarks.gpu_extra", f"--{mode}", name, *(["--cpu"] if dry else [])]
        try:
            done = run_child(rec, argv, env=env, cap_s=300)
        except subprocess.TimeoutExpired:
            return {"error": "killed: out of time"}
        if done.returncode != 0:
            return {"error": done.stderr.strip()[-1500:] or f"exit {done.returncode}"}
        return marked_json(done.stdout, RESULT_MARKER)

    def here(mode: str, name: str, emulate: bool) -> dict:
        """A dry run's case in this process (on CPU a fresh process only restarts Python); FSDP2's truth keeps
        its own: it sets up a process group (its estimate traces in a fake one that it takes down again)."""
        if gap_cases()[name].kind == "fsdp2" and mode == "memory":
            return one(mode, name, emulate)
        try:
            return run_gap(mode, name, cpu=True)
        except Exception as err:  # noqa: BLE001 -- recorded as its child's failure would be; the next case runs
            return {"error": f"{type(err).__name__}: {err}"[:1500]}

    def record(name: str, what: str, result: dict) -> None:
        entry["rows"].setdefault(name, {})[what] = result
        rec.log(f"gap {name} {what}: {json.dumps(result)[:300]}")
        rec.save()

    jobs = [(name, what, mode, emulate) for name in names
            for what, mode, emulate in (("truth", "memory", False), ("native", "estimate", False),
                                        ("emulated", "estimate", True)) if not (dry and what == "emulated")]
    if dry:  # one after another: the estimates and the loops share this process's torch state
        for name, what, mode, emulate in jobs:
            record(name, what, here(mode, name, emulate) if rec.left() > 10 else {"error": "skipped: out of time"})
        return
    s = rec.settings
    with ThreadPoolExecutor(s.measure_jobs) as gpu_pool, ThreadPoolExecutor(s.jobs) as cpu_pool:
        futures = {(gpu_pool if mode == "memory" else cpu_pool).submit(one, mode, name, emulate): (name, what)
                   for name, what, mode, emulate in jobs}
        for future in as_completed(futures):
            name, what = futures[future]
            record(name, what, future.result())


def kernel_profile(rec: Recorder, entry: dict, dry: bool) -> None:
    """benchmarks.gpu_extra --profile: GPT-2 small's step under torch.profiler, kernels by CUDA time."""
    from benchmarks.gpu_extra import RESULT_MARKER, profile_steps

    if dry:
        entry.update(profile_steps(cpu=True))
        return
    done = run_child(rec, [sys.executable, "-m", "benchmarks.gpu_extra", "--profile"],
                     env=dict(os.environ, OMP_NUM_THREADS="8"), cap_s=120)
    entry["stderr_tail"] = done.stderr.strip()[-1500:]
    if done.returncode != 0:
        raise RuntimeError(f"gpu_extra --profile exited {done.returncode}")
    entry.update(marked_json(done.stdout, RESULT_MARKER))


def step_times(rec: Recorder, entry: dict, model: str, dry: bool) -> None:
    """benchmarks.gpu_extra --time MODEL: one row per setting; the rows printed before a kill are kept."""
    from benchmarks.gpu_extra import RESULT_MARKER, time_model

    rows = entry.setdefault("rows", [])
    if dry:  # on CPU nothing but Python restarts in a fresh process: the settings run here
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            time_model(model, cpu=True)
        rows.extend(json.loads(line[len(RESULT_MARKER):]) for line in printed.getvalue().splitlines()
                    if line.startswith(RESULT_MARKER))
        entry["exit"] = 0
        for row in rows:
            rec.log(f"step time {json.dumps(row)[:300]}")
        return
    argv = [sys.executable, "-m", "benchmarks.gpu_extra", "--time", model]
    child = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="8"))
    try:
        out, err = child.communicate(timeout=max(1.0, rec.left()))
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, 9)
        out, err = child.communicate()
        entry["error"] = "killed: out of time"
    rows.extend(json.loads(line[len(RESULT_MARKER):]) for line in out.splitlines() if line.startswith(RESULT_MARKER))
    entry["exit"], entry["stderr_tail"] = child.returncode, err.strip()[-1500:]
    for row in rows:
        rec.log(f"step time {json.dumps(row)[:300]}")

