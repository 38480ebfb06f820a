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

The sections are in benchmarks.gpu_campaign_sections, the Settings / Recorder / child runner in
benchmarks.gpu_campaign_record; this module runs a part's sections in order.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu_campaign_record import Recorder, Settings, _now
from benchmarks.gpu_campaign_sections import (
    accuracy,
    cuda_overheads,
    environment,
    kernel_profile,
    memory_gaps,
    plan_vs_bisect,
    probe,
    step_times,
    validate,
)

DRY_CASES = ("linear-b64-sgd",)
DRY_EXTRA_CASES = ("mlp-b64-bf16mixed-gpu",)



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
