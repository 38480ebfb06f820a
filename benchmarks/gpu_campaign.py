"""Every GPU figure memplan owes (issues 14 and 25), in parts of a few minutes each on the lent GPU machine.

    python -m benchmarks.gpu_campaign --part 1|2|3|4|5 --out DIR [--budget-s 540] [--dry-run]
                                      [--only SECTION,...] [--cases NAME,...]

Part 1, most valuable first: the environment (GPU, driver, torch, CUDA); the CUDA context, cuBLAS/cuBLASLt
workspaces, cuDNN/SDPA/NCCL kernels and allocator segments (benchmarks.gpu_probes overheads, and the context
under CUDA_MODULE_LOADING=EAGER); `memplan validate` on the GPU and the calibration it writes, twice (the
second run uses it); accuracy on the zoo (benchmarks.accuracy_gpu: torch's and NVML's peaks vs the native
and the CPU-emulated estimates), then the zoo's missing fp32 / bf16-mixed / 16-mixed x checkpointing variants.
Part 2: MemoryPlanner through a real CUDA OOM; MemoryPlanner's per-step overhead on gpt2-small; the planner
against bisection and Lightning's BatchSizeFinder (benchmarks.plan_vs_bisect_gpu) on gpt2-small, resnet and cnn.
Part 3 (benchmarks.gpu_extra): the published-figure memory gaps, each truth against memplan's native and emulated
estimates. Part 4: measured step times of GPT-2 small and ViT-L/16 (memplan's predictions are made afterwards, on
CPU, by benchmarks.gpu_results), after a CUDA kernel profile of GPT-2 small's step (benchmarks.gpu_extra --profile).
Part 5 (benchmarks.gpu_ops): each convolution's transient memory (cuDNN workspaces) and op-by-op allocator readings
of zoo steps. `--only` runs the named sections of a part (the environment always); `--cases` keeps only the named
accuracy / op-profile cases (a part cut short earlier).

Everything runs in child processes; this process never creates a CUDA context. DIR/part<N>.json is rewritten
after every finished piece and DIR/part<N>.log gets every line printed, so a run cut short returns what it
measured. Each part stops starting work at --budget-s and kills what still runs then; a failed measurement is
recorded with its error and the others go on. Estimates run without any saved calibration (MEMPLAN_CALIBRATION
points to an empty folder), so they show memplan's sourced constants; `memplan validate` gets its own file.

--dry-run runs the same steps on CPU with tiny sizes (tests/benchmarks/test_gpu_campaign.py); its figures
are no GPU figures. Where a fresh process matters only on a GPU, the dry run saves its start: the accuracy cases,
the planner-vs-bisection steps, the part-2 probes, part 3's cases (but FSDP2's truth, which sets up a process
group), part 4's step times, `memplan validate` and, where no driver is present, the CUDA probes run in this
process.
`python -m benchmarks.gpu_results DIR` turns the JSON into benchmarks/results/*_gpu.md.
"""
from __future__ import annotations

import argparse
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
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.processes import run_group

ROOT = Path(__file__).resolve().parent.parent
FORMAT = 1
"""Version of the part<N>.json layout (benchmarks.gpu_results reads it)."""
DRY_CASES = ("linear-b64-sgd",)
DRY_EXTRA_CASES = ("mlp-b64-bf16mixed-gpu",)
VALIDATE = (("gpt2-small", 8), ("cnn", 64))
DRY_VALIDATE = (("mlp", 8),)
PACKAGES = ("torch", "pytorch-lightning", "lightning", "lightning-utilities", "torchmetrics", "transformers",
            "nvidia-ml-py", "psutil", "rich", "matplotlib", "PyYAML", "numpy", "jsonargparse", "docstring-parser",
            "typeshed-client")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """One part's run."""

    part: int
    """1 to 4."""
    out: Path
    """Folder for part<N>.json and part<N>.log."""
    budget_s: float
    """Seconds after which nothing new starts and running children are killed."""
    dry_run: bool
    """CPU, tiny sizes: checks the campaign, measures nothing of a GPU."""
    jobs: int
    """Estimate processes at once (CPU work)."""
    measure_jobs: int
    """GPU measurement processes at once (each reads only its own process's memory)."""
    only: tuple[str, ...] = ()
    """The sections to run (all when empty); the environment always runs."""
    cases: tuple[str, ...] = ()
    """The accuracy / op-profile cases to keep (all when empty)."""

    def chosen(self, names) -> list[str]:
        return [n for n in names if not self.cases or n in self.cases]


class Recorder:
    """The part's JSON, rewritten atomically after every change, and its log."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.deadline = time.monotonic() + settings.budget_s
        settings.out.mkdir(parents=True, exist_ok=True)
        self.path = settings.out / f"part{settings.part}.json"
        self.log_path = settings.out / f"part{settings.part}.log"
        self.data: dict = {"format": FORMAT, "part": settings.part, "dry_run": settings.dry_run,
                           "started": _now(), "budget_s": settings.budget_s, "sections": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, message: str) -> None:
        line = f"[{_now()}] {message}"
        print(line, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def save(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".part", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f, indent=1, default=repr)
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def section(self, name: str):
        """A dict to fill; its status (done / error / out of time) and seconds are recorded however it ends."""
        entry: dict = {"status": "running"}
        self.data["sections"][name] = entry
        if self.settings.only and name != "environment" and name not in self.settings.only:
            entry["status"] = "skipped: not asked (--only)"
            yield None
            return
        if self.left() <= 5:
            entry["status"] = "skipped: out of time"
            self.log(f"{name}: skipped, out of time")
            self.save()
            yield None
            return
        self.log(f"{name}: start ({self.left():.0f} s left)")
        self.save()
        started = time.monotonic()
        try:
            yield entry
            entry["status"] = "done"
        except subprocess.TimeoutExpired as err:
            entry["status"] = "out of time"
            entry["error"] = f"TimeoutExpired: {err.cmd if isinstance(err.cmd, str) else ' '.join(err.cmd)}"[:2000]
        except Exception as err:  # noqa: BLE001 -- a failed section is recorded; the next one still runs
            entry["status"] = "error"
            entry["error"] = f"{type(err).__name__}: {err}"[:4000]
            entry["traceback"] = traceback.format_exc()[-4000:]
        finally:
            entry["seconds"] = time.monotonic() - started
            self.log(f"{name}: {entry['status']} in {entry['seconds']:.1f} s"
                     + (f" -- {entry['error'][:300]}" if "error" in entry else ""))
            self.save()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_child(rec: Recorder, argv: list[str], *, env: dict | None = None, cap_s: float = 600) -> subprocess.CompletedProcess:
    """Run a child in the repository root, killed at the part's deadline (or after cap_s; a dry run has no
    cap_s: on a loaded CPU it is slow, and its caller tells a hang by lack of CPU progress)."""
    cap_s = rec.left() if rec.settings.dry_run else cap_s
    return run_group(argv, cwd=ROOT, env=env, timeout=max(1.0, min(cap_s, rec.left())))


def marked_json(stdout: str, marker: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(marker)]
    if not lines:
        raise RuntimeError(f"no line starting {marker.strip()!r} in the child's output")
    return json.loads(lines[-1][len(marker):])


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


# --- the parts ------------------------------------------------------------------------------------
def run_part(settings: Settings) -> dict:
    rec = Recorder(settings)
    dry = settings.dry_run
    calib_dir = Path(tempfile.mkdtemp(prefix="memplan-no-calibration-"))
    os.environ["MEMPLAN_CALIBRATION"] = str(calib_dir / "calibration.json")  # no file: the sourced constants
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    with rec.section("environment") as e:
        if e is not None:
            environment(e, dry)
    if settings.part == 3:
        from benchmarks.gpu_extra import DRY_GAPS, gap_cases

        with rec.section("memory_gaps") as e:
            if e is not None:
                memory_gaps(rec, e, list(DRY_GAPS if dry else gap_cases()), dry)
    elif settings.part == 4:
        from benchmarks.gpu_extra import TIME_MODELS

        with rec.section("kernel_profile") as e:
            if e is not None:
                kernel_profile(rec, e, dry)
        for model in TIME_MODELS:
            with rec.section(f"step_time_{model}") as e:
                if e is not None:
                    step_times(rec, e, model, dry)
    elif settings.part == 5:
        from benchmarks.gpu_ops import DRY_PROFILE_CASES, PROFILE_CASES, conv_grid_section, op_profiles

        with rec.section("conv_grid") as e:
            if e is not None:
                conv_grid_section(rec, e, dry)
        with rec.section("op_profiles") as e:
            if e is not None:
                op_profiles(rec, e, settings.chosen(DRY_PROFILE_CASES if dry else PROFILE_CASES), dry)
    elif settings.part == 1:
        with rec.section("cuda_overheads") as e:
            if e is not None:
                cuda_overheads(rec, e)
        with rec.section("validate") as e:
            if e is not None:
                validate(rec, e, dry)
        with rec.section("accuracy_zoo") as e:
            if e is not None:
                from benchmarks.zoo import CASES  # (imports torch: not before a section runs)

                accuracy(rec, e, settings.chosen(DRY_CASES if dry else CASES), dry)
        with rec.section("accuracy_extra") as e:
            if e is not None:
                from benchmarks.accuracy_gpu import extra_cases

                accuracy(rec, e, settings.chosen(DRY_EXTRA_CASES if dry else extra_cases()), dry)
    else:
        with rec.section("oom_retry") as e:
            if e is not None:
                probe(rec, e, "oom-retry", dry, cap_s=240)
        with rec.section("callback_overhead") as e:
            if e is not None:
                probe(rec, e, "overhead", dry, cap_s=150, repeat=2)
        configs = ("mlp",) if dry else ("gpt2-small", "resnet", "cnn")
        for config in configs:
            with rec.section(f"plan_vs_bisect_{config}") as e:
                if e is not None:
                    plan_vs_bisect(rec, e, config, dry)
    rec.data["finished"] = _now()
    rec.save()
    shutil.rmtree(calib_dir, ignore_errors=True)
    statuses = {name: s["status"] for name, s in rec.data["sections"].items()}
    rec.log(f"part {settings.part} finished: {statuses}")
    return rec.data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", type=int, choices=(1, 2, 3, 4, 5), required=True,
                        help="which part: 1 and 2 (issue 14), 3 memory gaps, 4 step times (issue 25), 5 op readings")
    parser.add_argument("--out", required=True, help="folder for part<N>.json and part<N>.log (e.g. $OUT)")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="stop starting work and kill running children after this many seconds (default 540)")
    parser.add_argument("--dry-run", action="store_true", help="on CPU with tiny sizes: checks the campaign runs")
    parser.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 4)),
                        help="estimate processes at once (default: CPU count - 4, at most 8)")
    parser.add_argument("--measure-jobs", type=int, default=3, help="GPU measurement processes at once (default 3)")
    parser.add_argument("--only", default="", help="comma-separated sections of the part to run (default: all)")
    parser.add_argument("--cases", default="", help="comma-separated accuracy / op-profile cases to keep (default all)")
    args = parser.parse_args(argv)
    if args.budget_s <= 0 or args.jobs < 1 or args.measure_jobs < 1:
        parser.error("--budget-s must be > 0 and --jobs / --measure-jobs >= 1")
    data = run_part(Settings(part=args.part, out=Path(args.out), budget_s=args.budget_s, dry_run=args.dry_run,
                             jobs=args.jobs, measure_jobs=args.measure_jobs,
                             only=tuple(filter(None, args.only.split(","))),
                             cases=tuple(filter(None, args.cases.split(",")))))
    return 0 if all(s["status"] == "done" or s["status"].startswith("skipped: not asked")
                    for s in data["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
