"""Issue 3's GPU figures: memplan's plan against the largest micro-batch that really runs (needs a CUDA GPU).

For each shipped config, on the local GPU 0, at the precision and checkpointing memplan plans:
  memplan   -- `memplan suggest --gpus 1 CONFIG --json` (wall time of the fresh process: planning time)
               and the largest micro-batch memplan predicts fits NVML's free memory with no margin
               (a search over memplan.estimate, in a child process);
  truth     -- the largest micro-batch that runs two real training steps without OOM, searched from
               memplan's figure up or down and then bisected to within 2 % (each probe a fresh process:
               an OOM leaves the allocator fragmented);
  lightning -- wall time of Lightning's BatchSizeFinder(mode="binsearch") fitting the same model, and
               the batch size it finds.
Goals: memplan's micro-batch runs (no OOM) and is >= 90 % of truth; planning takes <= 1/10 of the
BatchSizeFinder's time. The parent process never initialises CUDA, so every child sees the same free memory.

    python -m benchmarks.plan_vs_bisect_gpu [--only gpt2-small ...]
writes benchmarks/results/plan_vs_bisect_gpu.json and .md. The GPU campaign (benchmarks.gpu_campaign)
runs `run_one` with a deadline; `--dry-run` there runs it on CPU against a small byte budget, with every child,
`memplan suggest` included, run in the campaign's own process (_run_child, _suggest_here).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.processes import run_group
from benchmarks.results_io import write_results

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("gpt2-small", "resnet", "cnn")
RESOLUTION = 0.02
"""The truth is bisected until the largest run and the smallest OOM are this close (relative)."""
CAP = 1 << 14
"""Largest micro-batch tried."""
DRY_MICRO = 24
"""The dry run's stand-in for free device memory is the CPU peak of real steps at this micro-batch."""
DRY_SUGGEST = ("--gpu-memory", "1GiB", "--precision", "32-true")
"""The dry run plans fp32, whose CPU estimate matches the CPU's real peak (bf16 on CPU adds oneDNN scratch)."""
MARKER = "PLAN_VS_BISECT "


def config_path(name: str) -> str:
    return str(ROOT / "configs" / f"{name}.yaml")


def _run_child(args: list[str], timeout: float, *, in_process: bool = False) -> dict:
    """One fresh `python -m benchmarks.plan_vs_bisect_gpu --child ...`; its JSON line (RuntimeError if it failed).
    `in_process` (the dry run only) runs the same child here instead: on CPU a probe's peak is the profiler's,
    which no earlier probe disturbs, so the fresh process (needed on a GPU, where an OOM fragments the
    allocator) would only cost another start of torch and Lightning."""
    if in_process:
        return _child_run(args)
    cmd = [sys.executable, "-m", "benchmarks.plan_vs_bisect_gpu", "--child", *args]
    out = run_group(cmd, cwd=ROOT, timeout=max(timeout, 1))
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(MARKER)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(args)} failed (exit {out.returncode}): {out.stderr.strip()[-1500:]}")
    return json.loads(lines[-1][len(MARKER):])


# --- the children --------------------------------------------------------------------------------
def _child_probe(name: str, micro: int, precision: str, checkpointing: bool, cpu_budget: int | None) -> dict:
    """Two real steps at `micro`: fits unless torch.OutOfMemoryError (on CPU: the profiler's peak <= budget)."""
    import torch

    from memplan.config import load_config
    from memplan.truth import measure_cpu_peak, measure_cuda_peak

    loaded = load_config(config_path(name))
    kwargs = dict(optimizer=loaded.optimizer, precision=precision, checkpointing=checkpointing)
    if cpu_budget is not None:
        peak = measure_cpu_peak(loaded.build_model, lambda: loaded.example_batch(micro), **kwargs)
        return {"fits": peak <= cpu_budget, "peak": peak}
    try:
        m = measure_cuda_peak(loaded.build_model, lambda: loaded.example_batch(micro), **kwargs)
    except torch.OutOfMemoryError:
        return {"fits": False}
    return {"fits": True, "max_reserved": m.max_reserved, "nvml_process_peak": m.nvml_process_peak}


def _child_memplan_max(name: str, precision: str, checkpointing: bool, budget: int, start: int, cpu: bool) -> dict:
    """The largest micro-batch whose estimate fits `budget` bytes (device_total; on CPU peak_allocated)."""
    from memplan.config import load_config

    loaded = load_config(config_path(name))

    def fits(m: int) -> bool:
        est = loaded.estimate(m, precision=precision, checkpointing=checkpointing, device="cpu" if cpu else None)
        return (est.peak_allocated if cpu else est.device_total) <= budget

    started = time.perf_counter()
    largest, _, probes = search_largest(fits, start, rel=0.0)
    return {"memplan_max": largest, "estimates": len(probes), "seconds": time.perf_counter() - started}


def _child_batch_size_finder(name: str, precision: str, dry: bool) -> dict:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import BatchSizeFinder

    from memplan.config import load_config

    loaded = load_config(config_path(name))
    model, dm = loaded.build_model(), loaded.data.instantiate()
    finder = BatchSizeFinder(mode="binsearch", **(dict(max_trials=2, steps_per_trial=1) if dry else {}))
    trainer = pl.Trainer(accelerator="cpu" if dry else "gpu", devices=1, precision=precision, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[finder])
    started = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    return {"seconds": time.perf_counter() - started, "optimal_batch_size": finder.optimal_batch_size}


# --- the search ----------------------------------------------------------------------------------
def search_largest(fits: Callable[[int], bool], start: int, *, rel: float = RESOLUTION,
                   cap: int = CAP) -> tuple[int, int | None, list[tuple[int, bool]]]:
    """(largest m that fits, smallest m found not to fit or None, [(m, fits) in probe order]), assuming
    `fits` is monotone: from `start`, steps growing x2 up (or down) until the answer is bracketed, then
    bisection until the bracket is within `rel` of the largest (exact when rel is 0). Largest 0: not even 1 fits."""
    probes: list[tuple[int, bool]] = []

    def probe(m: int) -> bool:
        probes.append((m, fits(m)))
        return probes[-1][1]

    m = max(1, min(int(start), cap))
    step = max(1, m // 20)
    if probe(m):
        lo, hi = m, None
        while hi is None and lo < cap:
            nxt = min(cap, lo + step)
            lo, hi = (nxt, None) if probe(nxt) else (lo, nxt)
            step *= 2
        if hi is None:
            return lo, None, probes
    else:
        lo, hi = 0, m
        while lo == 0 and hi > 1:
            nxt = max(1, hi - step)
            lo, hi = (nxt, hi) if probe(nxt) else (0, nxt)
            step *= 2
        if lo == 0:
            return 0, hi, probes
    while hi - lo > max(1, int(rel * lo)):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    return lo, hi, probes


def free_device_bytes() -> int:
    """NVML's free memory on GPU 0, read without a CUDA context in this process."""
    from memplan.hardware import gpu_for_cuda_index

    gpu = gpu_for_cuda_index(0)
    if gpu is None or gpu.free_bytes is None:
        raise RuntimeError("NVML cannot read GPU 0's free memory; plan_vs_bisect_gpu needs it")
    return gpu.free_bytes


def _suggest_here(argv: list[str]) -> subprocess.CompletedProcess:
    """`memplan ARGV` in this process, its output captured (the dry run, whose planning time is no figure)."""
    from memplan.commands.cli import main as memplan

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = memplan(argv)
    return subprocess.CompletedProcess(["memplan", *argv], code, out.getvalue(), err.getvalue())


def _dry_budget(name: str, setting: list[str], timeout: float) -> int:
    """The dry run's 'free memory': the CPU peak two real steps at DRY_MICRO take."""
    return _run_child(["probe", name, str(DRY_MICRO), *setting, "--cpu-budget", "0"], timeout, in_process=True)["peak"]


def run_one(name: str, row: dict, *, dry: bool = False, deadline: float | None = None,
            saved: Callable[[], None] = lambda: None) -> dict:
    """Fill `row` with one config's figures, calling `saved()` after each (so a cut-off run keeps what it
    found); `deadline` is a time.monotonic() value no child may run past."""
    def left() -> float:
        return 600.0 if deadline is None else deadline - time.monotonic()

    row.update(config=name, dry_run=dry)
    suggest = [sys.executable, "-m", "memplan", "suggest", "--gpus", "1", *(DRY_SUGGEST if dry else []),
               config_path(name), "--json"]
    started = time.perf_counter()
    done = _suggest_here(suggest[3:]) if dry else run_group(suggest, cwd=ROOT, timeout=max(left(), 1))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(suggest[1:])} failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}")
    plan = json.loads(done.stdout)
    row["suggest_seconds"] = time.perf_counter() - started
    saved()
    precision, ckpt = plan["precision"], plan["gradient_checkpointing"]
    row.update(precision=precision, checkpointing=ckpt, planned_micro_batch=plan["micro_batch_size"],
               planned_peak_bytes=plan["predicted_peak_bytes"])
    setting = ["--precision", precision, *(["--checkpointing"] if ckpt else [])]
    row["free_bytes"] = budget = _dry_budget(name, setting, left()) if dry else free_device_bytes()
    mm = _run_child(["memplan-max", name, *setting, "--budget", str(budget), "--start", str(plan["micro_batch_size"]),
                     *(["--cpu"] if dry else [])], left(), in_process=dry)
    row.update(memplan_max_micro_batch=mm["memplan_max"], memplan_max_estimates=mm["estimates"],
               memplan_max_seconds=mm["seconds"])
    row["probes"] = []
    saved()

    def fits(m: int) -> bool:
        t = time.perf_counter()
        got = _run_child(["probe", name, str(m), *setting, *(["--cpu-budget", str(budget)] if dry else [])], left(),
                         in_process=dry)
        row["probes"].append({"micro_batch": m, **got, "seconds": time.perf_counter() - t})
        saved()
        return got["fits"]

    row["planned_runs"] = fits(plan["micro_batch_size"])
    largest, failing, _ = search_largest(fits, mm["memplan_max"] or 1, cap=64 if dry else CAP,
                                         rel=0.25 if dry else RESOLUTION)
    row.update(truth_max_micro_batch=largest, truth_first_oom=failing,
               memplan_max_runs=any(p["micro_batch"] == mm["memplan_max"] and p["fits"] for p in row["probes"]),
               ratio=mm["memplan_max"] / largest if largest else None)
    bsf = _run_child(["bsf", name, "--precision", precision, *(["--dry"] if dry else [])], left(), in_process=dry)
    row.update(batch_size_finder_seconds=bsf["seconds"], batch_size_finder_batch=bsf["optimal_batch_size"],
               suggest_over_batch_size_finder=row["suggest_seconds"] / bsf["seconds"])
    return row


def render(report: dict) -> str:
    lines = [f"# memplan's micro-batch vs real bisection ({report['gpu']}, torch {report['torch']}, {report['date']})", "",
             "| config | precision | ckpt | planned | memplan max | truth max | ratio | memplan's runs | suggest s | "
             "BatchSizeFinder s (its batch) |", "|---|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in report["rows"]:
        ratio = "-" if r.get("ratio") is None else f"{100 * r['ratio']:.0f}%"
        lines.append(f"| {r['config']} | {r.get('precision')} | {r.get('checkpointing')} | {r.get('planned_micro_batch')} | "
                     f"{r.get('memplan_max_micro_batch')} | {r.get('truth_max_micro_batch')} | {ratio} | "
                     f"{r.get('memplan_max_runs')} | {r.get('suggest_seconds', 0):.1f} | "
                     f"{r.get('batch_size_finder_seconds', 0):.1f} ({r.get('batch_size_finder_batch')}) |")
    return "\n".join(lines) + "\n"


def _child_run(argv: list[str]) -> dict:
    """What one `--child ARGV` process reports."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.plan_vs_bisect_gpu --child")
    p.add_argument("what", choices=("probe", "memplan-max", "bsf"))
    p.add_argument("config")
    p.add_argument("micro", nargs="?", type=int)
    p.add_argument("--precision", required=True)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--cpu-budget", type=int)
    p.add_argument("--budget", type=int)
    p.add_argument("--start", type=int, default=8)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--dry", action="store_true")
    a = p.parse_args(argv)
    if a.what == "probe":
        out = _child_probe(a.config, a.micro, a.precision, a.checkpointing, a.cpu_budget)
    elif a.what == "memplan-max":
        out = _child_memplan_max(a.config, a.precision, a.checkpointing, a.budget, a.start, a.cpu)
    else:
        out = _child_batch_size_finder(a.config, a.precision, a.dry)
    return out


def _child_main(argv: list[str]) -> int:
    print(MARKER + json.dumps(_child_run(argv)), flush=True)
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return _child_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    from memplan.hardware import nvml_available

    if not nvml_available():
        print("plan_vs_bisect_gpu needs a CUDA GPU that NVML sees; none is available here", file=sys.stderr)
        return 2
    import torch

    rows = []
    for name in args.only or CONFIGS:
        rows.append(run_one(name, {}))
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "gpu": rows and _gpu_name(), "torch": torch.__version__, "rows": rows}
    write_results("plan_vs_bisect_gpu", report, render(report))
    return 0


def _gpu_name() -> str | None:
    from memplan.hardware import gpu_for_cuda_index

    gpu = gpu_for_cuda_index(0)
    return None if gpu is None else gpu.name


if __name__ == "__main__":
    sys.exit(main())
