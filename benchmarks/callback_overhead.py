"""What MemoryPlanner costs per training step on CPU at its default interval (a reading every
log_every_n_steps = 50 steps). Goal: under 0.5 % of step time.

On memplan's demo models, one process, warm, Trainer(accelerator="cpu", devices=1), a plan that
matches the loader (so nothing changes but the watching), a CSVLogger (so the metrics path is paid):
Every run is a fresh process forked after the imports and warmed by 30 steps, as a training job runs
one fit per process.
  end to end  the same fit for STEPS steps without and with MemoryPlanner, interleaved; each run's
              mean step time from step WARMUP on. Overhead = median(with) / median(without) - 1. On a
              shared 2-core machine the run-to-run noise is of the same size; the table shows both.
  own code    instrumented runs, from step OWN_FROM (after the default guard lifted): the time Lightning spends
              dispatching every hook to MemoryPlanner and in the hooks' bodies, plus its training_step wrapper
              less the user's work in it (the training_step, the module's backward it runs, the user's
              `self.log` calls it holds and makes after the chunk), plus all of Lightning's backward of
              the carrier loss (the gradient handoff; an upper bound: a plain backward pays autograd's
              start-up too), per step (the end-of-fit summary excluded). Precise where end to end is noisy.
  floor       the same instrumentation on an empty Callback: what Lightning's dispatch of ~8 hooks a
              step costs for any callback (DeviceStatsMonitor included); MemoryPlanner's own work is
              `own code - floor`.

    python -m benchmarks.callback_overhead [--repeat 5] [--steps-scale 1.0]
writes benchmarks/results/callback_overhead.json and .md.

    python -m benchmarks.callback_overhead --breakdown
prints where own code's time goes, by part and by kind of step (guarded, a reading, the rest), in the GPU
campaign's setting (benchmarks.gpu_probes overhead: GPT-2 small's structure, bf16-mixed, own code from step 20),
run on CPU at a tiny width.

The clocks (StepClock, OwnTime) are in benchmarks.callback_overhead_clocks; this module runs the fits and reports.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import warnings
from datetime import datetime, timezone
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.callback_overhead_clocks import (  # noqa: F401 (USER_PART: tests/benchmarks reads it from here)
    USER_PART,
    WARMUP,
    OwnTime,
    StepClock,
)
from benchmarks.results_io import RESULTS, write_results
from memplan.callback import MemoryPlanner
from memplan.demos import MLP, ImageCNN
from memplan.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.005
INSTRUMENTED_REPEATS = 2
OWN_FROM = 100
"""Own code is counted from this step: after the default guard has lifted (at the reading of step 50)."""
MLP_OWN_GOAL_US = 40.0
"""Issue 11: own code per unguarded step on this machine's MLP step, at the default interval."""
GUARDS = ("auto", "always")
"""auto (the default): guarded until the first reading (step 50) shows this CPU's plenty of room, then
Lightning backwards each whole batch; always: every backward in training_step and the gradient
handoff, every step (what a rank pays while its memory is tight)."""

SCENARIOS = {
    # name: (build, batch size, steps): a 1.5 ms step (the worst case for a fixed per-step cost) and
    # a convolutional one closer to real work
    "mlp": (lambda: MLP(), 64, 3000),
    "cnn": (lambda: ImageCNN(channels=16), 16, 300),
}


def run_once(name: str, arm: str, steps: int, out: Path, guard: str = "auto") -> dict:
    """arm: 'without', 'with' (MemoryPlanner, not instrumented), 'own' (MemoryPlanner, instrumented),
    'floor' (an empty Callback, instrumented)."""
    build, batch_size, _ = SCENARIOS[name]
    torch.manual_seed(0)
    model = build()
    x, y = model.example_batch(batch_size)
    data = TensorDataset(x.repeat(steps + 1, *[1] * (x.dim() - 1)), y.repeat(steps + 1))
    clock = StepClock()
    # own code is counted from OWN_FROM: with guard="auto", after the first reading (step 50) has
    # lifted the guard, so it is the cost of an unguarded step (issue 11's figure)
    own_clock = StepClock(OWN_FROM) if arm in ("own", "floor") else None
    target: Callback | None = None
    if arm in ("with", "own"):
        plan = Plan(gpu_name="cpu", gpus=(), nodes=1, world_size=1, micro_batch_size=batch_size,
                    accumulate_grad_batches=1, global_batch_size=batch_size, precision="32-true",
                    gradient_checkpointing=False, strategy="auto", predicted_peak_bytes=1, device_budget_bytes=1,
                    host_bytes_per_rank=0)
        target = MemoryPlanner(plan, log_dir=out / "memplan", guard=guard)  # the default interval
    elif arm == "floor":
        target = Callback()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=CSVLogger(out),
                         callbacks=[c for c in (target, clock, own_clock) if c is not None], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=50)
    own = OwnTime(target, own_clock) if own_clock is not None else None
    try:
        trainer.fit(model, DataLoader(data, batch_size=batch_size))
    finally:
        own_s = own.close() if own is not None else None
    row = {"arm": arm, "step_ms": clock.step_s * 1e3, "steps": clock.steps}
    if own_s is not None:
        row["us_per_step"] = own_s / own_clock.steps * 1e6
    return row


def run_fresh(name: str, arm: str, steps: int, out: Path, guard: str) -> dict:
    """run_once in a fresh process forked from this one, which has only imported (a training job runs
    one fit per process: a process that has run many fits has a larger, colder heap, which slows
    every callback's Python by a few microseconds a step). The child warms itself first (kernels)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        run_once(name, "without", WARMUP + 10, out / "warm")
        send.send(run_once(name, arm, steps, out / "run", guard))

    process = context.Process(target=child)
    process.start()
    send.close()
    try:
        row = receive.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"{name} {arm} guard={guard}: the run's process died (exit {process.exitcode})") from None
    process.join()
    return row


def measure(name: str, guard: str, repeat: int, scale: float) -> dict:
    steps = max(WARMUP + 100, int(SCENARIOS[name][2] * scale))
    arms = ["without", "with"] * repeat + ["own", "floor"] * INSTRUMENTED_REPEATS
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, arm in enumerate(arms):
            row = run_fresh(name, arm, steps, Path(tmp) / str(i), guard)
            runs.append(row)
            extra = f", {row['us_per_step']:.1f} us/step" if "us_per_step" in row else ""
            print(f"{name} guard={guard} {arm}: {row['step_ms']:.3f} ms/step{extra}", flush=True)
    step = {arm: [r["step_ms"] for r in runs if r["arm"] == arm] for arm in ("without", "with")}
    base = statistics.median(step["without"])
    paired = [w / wo - 1 for wo, w in zip(step["without"], step["with"])]
    own = statistics.median(r["us_per_step"] for r in runs if r["arm"] == "own")
    floor = statistics.median(r["us_per_step"] for r in runs if r["arm"] == "floor")
    return {
        "scenario": name, "guard": guard, "steps": steps, "repeat": repeat, "runs": runs,
        "median_step_ms_without": base, "median_step_ms_with": statistics.median(step["with"]),
        "end_to_end_overhead": statistics.median(step["with"]) / base - 1,
        "paired_overhead_min": min(paired), "paired_overhead_max": max(paired),
        "noise_without": (max(step["without"]) - min(step["without"])) / base,
        "own_us_per_step": own, "own_overhead": own / (base * 1e3),
        "floor_us_per_step": floor, "memplan_us_per_step": own - floor,
        "breakeven_step_ms": own / GOAL / 1e3,
    }


def write_report(rows: list[dict], repeat: int) -> None:
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
              "cpu_count": os.cpu_count(), "torch": torch.__version__, "lightning": pl.__version__,
              "command": f"python -m benchmarks.callback_overhead --repeat {repeat}", "repeat": repeat, "goal": GOAL,
              "rows": rows}
    write_results("callback_overhead", report, render(report))


def render(report: dict) -> str:
    """The Markdown table of a report (also from the committed JSON: --render)."""
    repeat, rows = report.get("repeat", 5), report["rows"]
    lines = [f"# MemoryPlanner overhead on CPU ({report['date']}, {report['machine']}, {report['cpu_count']} CPUs, "
             f"torch {report['torch']}, Lightning {report['lightning']})", "",
             f"Command: `{report['command']}`. Default interval (one reading every 50 steps); {repeat} runs without "
             f"and with, interleaved, each in a fresh process (forked after the imports, warmed by 30 steps), "
             f"plus {INSTRUMENTED_REPEATS} instrumented runs each of MemoryPlanner and of an "
             "empty Callback. Goal: < 0.5 % of step time.", "",
             "| model | guard | steps | ms/step without | ms/step with | "
             "end to end: median (paired min..max) | noise | "
             "own code us/step (%) | of which any callback's dispatch us/step | < 0.5 % for steps over | goal |",
             "|---|---|---:|---:|---:|---|---:|---|---:|---:|---|"]
    for r in rows:
        verdict = "met" if r["own_overhead"] < GOAL else "NOT met"
        lines.append(
            f"| {r['scenario']} | {r['guard']} | {r['steps']} | "
            f"{r['median_step_ms_without']:.3f} | {r['median_step_ms_with']:.3f} | "
            f"{r['end_to_end_overhead']:+.2%} ({r['paired_overhead_min']:+.2%}..{r['paired_overhead_max']:+.2%}) | "
            f"{r['noise_without']:.1%} | {r['own_us_per_step']:.1f} ({r['own_overhead']:.2%}) | "
            f"{r['floor_us_per_step']:.1f} | {r['breakeven_step_ms']:.1f} ms | {verdict} |")
    mlp_auto = next((r for r in rows if r["scenario"] == "mlp" and r["guard"] == "auto"), None)
    if mlp_auto is not None:
        verdict = "met" if mlp_auto["own_us_per_step"] <= MLP_OWN_GOAL_US else "NOT met"
        lines += ["", f"Issue 11's figure: own code per unguarded step on the MLP at the default interval "
                  f"{mlp_auto['own_us_per_step']:.1f} us (goal <= {MLP_OWN_GOAL_US:.0f} us): {verdict}."]
    lines += ["", "Own code: Lightning's dispatch of every hook to MemoryPlanner and the hooks' bodies, plus its "
              "training_step wrapper less the user's work in it (training_step, each chunk's backward, the user's "
              "self.log calls it holds and makes after the chunk), plus "
              "Lightning's whole backward of the carrier loss (the gradient handoff; an upper bound, as a plain "
              "backward pays autograd's start-up too); the reading, the gather, the JSON line and the logger call "
              "of every 50th step included. Any callback's dispatch: the same for an empty Callback, the floor no "
              "callback gets under. End to end: the same cost seen through the machine's noise.", "",
              "Guard: `auto` (the default) is guarded until the first reading, at step 50, finds this CPU's plenty of "
              "room, then leaves each whole batch's backward to Lightning. Own code is counted from step "
              f"{OWN_FROM} (each step after the guard lifted: the figure issue 11 names, own code per unguarded "
              "step); end to end includes the 50 guarded steps (1/6 of the cnn's 300). "
              "`always` is guarded every step: every backward in training_step and the "
              "gradient handoff, which is what a rank pays while its memory is tight or after an OOM."]
    return "\n".join(lines) + "\n"


GPT2_SHAPE = dict(vocab_size=512, context=32, d_model=48, n_layers=12, n_heads=12, dropout=0.1)
"""GPT-2 small's structure (12 blocks, 148 parameter tensors, tied embeddings) at a width a CPU steps in
milliseconds: the callback's per-parameter and per-hook work as on the GPU probe's model, the math tiny."""


def breakdown(steps: int = 150, micro: int = 8, guard: str = "auto") -> dict:
    """Where MemoryPlanner's own time goes in the GPU campaign's callback_overhead setting (benchmarks.gpu_probes:
    GPTLM, bf16-mixed, micro-batch 8, default interval, own code counted from step WARMUP, the guarded steps before
    the first reading at step 50 included), run here on CPU with GPT2_SHAPE; one instrumented run in this process."""
    from memplan.demos import GPTLM

    torch.manual_seed(0)
    model = GPTLM(**GPT2_SHAPE)
    x, y = model.example_batch(micro)
    data = TensorDataset(x.repeat(steps + 1, 1), y.repeat(steps + 1, 1))
    clock = StepClock()
    plan = Plan(gpu_name="cpu", gpus=(), nodes=1, world_size=1, micro_batch_size=micro, accumulate_grad_batches=1,
                global_batch_size=micro, precision="bf16-mixed", gradient_checkpointing=False, strategy="auto",
                predicted_peak_bytes=1, device_budget_bytes=1, host_bytes_per_rank=0)
    with tempfile.TemporaryDirectory() as tmp:
        target = MemoryPlanner(plan, log_dir=Path(tmp) / "memplan", guard=guard)
        trainer = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             log_every_n_steps=50, callbacks=[target, clock])
        own = OwnTime(target, clock)
        try:
            trainer.fit(model, DataLoader(data, batch_size=micro))
        finally:
            own_s = own.close()
    return {"model": GPT2_SHAPE, "parameters": sum(1 for _ in model.parameters()), "micro_batch": micro,
            "guard": guard, "steps_timed": clock.steps, "step_ms": clock.step_s * 1e3,
            "own_us_per_step": own_s / clock.steps * 1e6, **own.breakdown(clock.steps, 50)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="end-to-end runs without and with the callback")
    parser.add_argument("--steps-scale", type=float, default=1.0, help="scale every scenario's step count")
    parser.add_argument("--render", action="store_true", help="only rewrite the .md from the committed .json")
    parser.add_argument("--breakdown", action="store_true",
                        help="print where own code's time goes in the GPU probe's setting, run on CPU (no files)")
    args = parser.parse_args()
    if args.breakdown:
        warnings.filterwarnings("ignore")
        logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
        logging.getLogger("memplan").setLevel(logging.WARNING)
        print(json.dumps(breakdown(), indent=1))
        return 0
    if args.render:
        report = json.loads((RESULTS / "callback_overhead.json").read_text())
        (RESULTS / "callback_overhead.md").write_text(render(report))
        return 0
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    logging.getLogger("memplan").setLevel(logging.WARNING)
    write_report([measure(name, guard, args.repeat, args.steps_scale) for name in SCENARIOS for guard in GUARDS],
                 args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
