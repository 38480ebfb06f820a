"""The GPU campaign's parts 3 and 4 (issue 25): the published-figure memory gaps, and measured step times.

    python -m benchmarks.gpu_extra --memory NAME [--cpu]     one gap case's truth, a plain loop written here
    python -m benchmarks.gpu_extra --estimate NAME           memplan's estimate of it (MEMPLAN_TRACE_ON_CPU=1: emulated)
    python -m benchmarks.gpu_extra --time MODEL [--cpu]      measured step times of MODEL's settings
    python -m benchmarks.gpu_extra --profile [--cpu]         GPT-2 small's step, kernel by kernel (torch.profiler)

Memory gaps (issue 22 section 3), each truth in a fresh process, none through memplan's step code:
- `vit-l16-*`: torchvision's own vit_l_16 (head Linear(1024, 10)) trained as rasbt/pytorch-memory-optim's scripts
  do (benchmarks.published_gpu): 32-true; 16-mixed with autocast (weight cache on, as Fabric's) and GradScaler;
  bf16-true (module in bf16, the float32 batch cast in the forward). Batch 16 and 64, Adam(lr=5e-5).
- `autocast-cache-*`: zoo models in a plain bf16 autocast loop (torch.autocast's default cache_enabled=True),
  estimated with loop="torch".
- `fsdp2-1gpu-*`: GPT-2 small under Lightning's ModelParallelStrategy on one GPU (fully_shard per block and on
  the root over a 1-rank NCCL mesh): FSDP2's own streams and their allocator pools.
Each truth reads torch.cuda.max_memory_allocated / max_memory_reserved over the whole run (as the published
scripts print them) and over the steady-state steps (peaks reset after step 1), which is what memplan estimates.

Step time (the step-time model of planner/costs.py): GPT-2 small (124M, 1024 tokens) at micro-batch 4, 8, 16 and
ViT-L/16 at 32, in 32-true and bf16-mixed, with and without full checkpointing of each block, in Lightning's step
order (forward, zero_grad, backward, step; autocast without its weight cache, as Lightning runs it); 3 warm-up
steps, then 10 timed steps (CUDA synchronised). The prediction is made afterwards from CPU traces
(benchmarks.gpu_results); nothing here predicts.

`--cpu` runs the same code on CPU with tiny sizes (the campaign's dry run); its figures are no GPU figures.
The gap cases and their truths are in benchmarks.gpu_extra_gaps, the models and batches in
benchmarks.gpu_extra_models; the step times, the kernel profile and the command line are here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks.gpu_extra_gaps import DRY_GAPS, gap_cases, run_gap  # noqa: F401 (DRY_GAPS: the campaign reads it here)
from benchmarks.gpu_extra_models import (
    _to,
    gpt2_small,
    gpt2_small_batch,
    vit_batch,
    vit_model,
)

RESULT_MARKER = "GPU_EXTRA_RESULT "
"""Prefix of each result line (library output may precede it)."""
WARMUP_STEPS, TIMED_STEPS = 3, 10


# --- step time ---------------------------------------------------------------------------------------
def time_settings(model: str, cpu: bool) -> list[tuple[str, int, bool]]:
    """(precision, micro-batch, checkpointing) measured for `model`."""
    micro = {"gpt2-small": (1, 2) if cpu else (4, 8, 16), "vit-l16": (2,) if cpu else (32,)}[model]
    return [(p, m, c) for p in ("bf16-mixed", "32-true") for c in (False, True) for m in micro]


def time_model(model_name: str, cpu: bool) -> None:
    """Prints one result line per setting as it finishes (a run cut short keeps the settings done)."""
    import torch
    import torch.nn.functional as F

    from memplan.estimator.checkpointing import apply_checkpointing

    device = "cpu" if cpu else "cuda"
    warmup, timed = (1, 2) if cpu else (WARMUP_STEPS, TIMED_STEPS)
    for precision, micro, ckpt in time_settings(model_name, cpu):
        row = {"model": model_name, "precision": precision, "micro_batch": micro, "checkpointing": ckpt}
        try:
            torch.manual_seed(0)
            if model_name == "gpt2-small":
                model, batch = gpt2_small(cpu), gpt2_small_batch(micro, cpu)
                row["model_source"] = "transformers GPT2LMHeadModel"
                loss_fn = lambda m, b: m(**b).loss  # noqa: E731
            else:
                (model, row["model_source"]), batch = vit_model(cpu), vit_batch(micro, cpu)
                loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
            if ckpt:
                apply_checkpointing(model, True)
            model, batch = model.to(device), _to(batch, device)
            optimizer = torch.optim.AdamW(model.parameters())
            amp = precision == "bf16-mixed"
            seconds = []
            for step in range(warmup + timed):
                if not cpu:
                    torch.cuda.synchronize()
                started = time.perf_counter()
                with torch.autocast(device, dtype=torch.bfloat16, enabled=amp, cache_enabled=False):
                    loss = loss_fn(model, batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if not cpu:
                    torch.cuda.synchronize()
                if step >= warmup:
                    seconds.append(time.perf_counter() - started)
            row.update(step_seconds_median=statistics.median(seconds), step_seconds=seconds,
                       parameters=sum(p.numel() for p in model.parameters()),
                       tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
            del model, optimizer, loss
        except Exception as err:  # noqa: BLE001 -- one setting's failure (an OOM) is recorded, the next runs
            row["error"] = f"{type(err).__name__}: {err}"[:500]
        if not cpu:
            torch.cuda.empty_cache()
        print(RESULT_MARKER + json.dumps(row), flush=True)


TIME_MODELS = ("gpt2-small", "vit-l16")
PROFILE_SETTINGS = (("bf16-mixed", 8), ("32-true", 8))
"""GPT-2 small's (precision, micro-batch) profiled: the step-time model's largest miss (bf16) beside fp32."""


def profile_steps(cpu: bool) -> dict:
    """GPT-2 small's step under torch.profiler, per setting: the step's wall time, the GPU's busy time (the sum of
    its kernels), the kernel count, and the kernels and aten ops taking the most device time (per step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = "cpu" if cpu else "cuda"
    warmup, profiled = (1, 1) if cpu else (3, 3)
    out: dict = {"steps_profiled": profiled, "settings": []}
    for precision, micro in PROFILE_SETTINGS[:1] if cpu else PROFILE_SETTINGS:
        torch.manual_seed(0)
        model = gpt2_small(cpu).to(device)
        batch = _to(gpt2_small_batch(1 if cpu else micro, cpu), device)
        optimizer = torch.optim.AdamW(model.parameters())
        amp = precision == "bf16-mixed"

        def step(model=model, optimizer=optimizer) -> None:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=amp, cache_enabled=False):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        for _ in range(warmup):
            step()
        activities = [ProfilerActivity.CPU] + ([] if cpu else [ProfilerActivity.CUDA])
        if not cpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(profiled):
                step()
            if not cpu:
                torch.cuda.synchronize()
        wall = (time.perf_counter() - started) / profiled
        kernels = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        kernel_us = [getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) for e in kernels]
        busy_us = sum(kernel_us) / profiled
        by_kernel: dict[str, list] = {}
        for e, us in zip(kernels, kernel_us):
            row = by_kernel.setdefault(e.name[:160], [0, 0.0])
            row[0] += 1
            row[1] += us
        averages = prof.key_averages()
        ops = sorted((a for a in averages if a.key.startswith("aten::")),
                     key=lambda a: (-getattr(a, "device_time_total", 0.0), -a.cpu_time_total))[:40]
        out["settings"].append({
            "precision": precision, "micro_batch": micro, "wall_seconds_per_step": wall,
            "gpu_busy_seconds_per_step": busy_us / 1e6, "kernels_per_step": len(kernels) / profiled,
            "aten_ops_per_step": sum(a.count for a in averages if a.key.startswith("aten::")) / profiled,
            "top_kernels": sorted(([k, n / profiled, us / profiled] for k, (n, us) in by_kernel.items()),
                                  key=lambda r: -r[2])[:40],
            "top_aten_ops_device_us": [[a.key, a.count / profiled, getattr(a, "device_time_total", 0.0) / profiled,
                                        a.cpu_time_total / profiled] for a in ops]})
        del model, optimizer
        if not cpu:
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--memory", choices=sorted(gap_cases()), help="one gap case's truth")
    what.add_argument("--estimate", choices=sorted(gap_cases()), help="memplan's estimate of one gap case")
    what.add_argument("--time", choices=TIME_MODELS, help="step times of one model's settings")
    what.add_argument("--profile", action="store_true", help="GPT-2 small's step under torch.profiler")
    parser.add_argument("--cpu", action="store_true", help="on CPU with tiny sizes (the dry run)")
    args = parser.parse_args(argv)
    if args.profile:
        print(RESULT_MARKER + json.dumps(profile_steps(args.cpu)), flush=True)
        return 0
    if args.time:
        time_model(args.time, args.cpu)
        return 0
    result = run_gap("estimate" if args.estimate else "memory", args.memory or args.estimate, args.cpu)
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0




if __name__ == "__main__":
    sys.exit(main())
