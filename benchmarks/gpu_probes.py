"""The GPU campaign's measurements that need a fresh process each, one JSON object on stdout's last line.

    python -m benchmarks.gpu_probes overheads        CUDA context, cuBLAS/cuBLASLt workspaces, cuDNN and SDPA
                                                      kernels, a 1-rank NCCL group, the caching allocator's segments
    python -m benchmarks.gpu_probes context           the bare CUDA context alone (run with CUDA_MODULE_LOADING=EAGER)
    python -m benchmarks.gpu_probes oom-retry [--cpu] MemoryPlanner given a micro-batch too large for the card:
                                                      the real CUDA OOM, the retries, training finishing
    python -m benchmarks.gpu_probes overhead [--cpu]  MemoryPlanner's cost per step on gpt2-small (tiny with --cpu)

Memory outside the caching allocator is NVML's per-process figure less torch's reserved bytes; where NVML
cannot see this process (a PID namespace), the device's `used` less its value before CUDA started, which is
only right while nothing else runs on the device (the campaign runs these probes alone). `--cpu` runs the
same code on CPU with tiny sizes: the campaign's dry run (oom-retry meets a SIMULATED OOM there, the CPU having none).
The CUDA probes (overheads, context) are in benchmarks.gpu_probes_cuda; the MemoryPlanner probes are here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_probes_cuda import context, overheads

RESULT_MARKER = "GPU_PROBE_RESULT "
"""Prefix of the one result line (library output may precede it)."""


# --- MemoryPlanner on the device ---------------------------------------------------------------
GPT2_SMALL = dict(vocab_size=50257, context=1024, d_model=768, n_layers=12, n_heads=12, dropout=0.1)
GPT2_TINY = dict(vocab_size=512, context=32, d_model=32, n_layers=2, n_heads=2, dropout=0.1)
"""gpt2-small as configs/gpt2-small.yaml builds it, and the dry run's stand-in."""


def _tokens(sizes: dict, batch_size: int):
    """GPTLM.example_batch without building the model: (idx, targets), int64 (B, context)."""
    import torch

    tokens = torch.randint(0, sizes["vocab_size"], (batch_size, sizes["context"] + 1),
                           generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _plan(micro: int, precision: str, gpu_name: str, on_gpu: bool):
    from memplan.plan import Plan

    return Plan(gpu_name=gpu_name, gpus=(0,) if on_gpu else (), nodes=1, world_size=1, micro_batch_size=micro,
                accumulate_grad_batches=1, global_batch_size=micro, precision=precision,
                gradient_checkpointing=False, strategy="auto", predicted_peak_bytes=1, device_budget_bytes=1,
                host_bytes_per_rank=0)


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "memplan"):
        logging.getLogger(name).setLevel(logging.WARNING)


DRY_OOM_ABOVE = 4
"""The dry run's SIMULATED device memory: a forward of more samples raises torch.OutOfMemoryError."""


def _simulated_oom(module, args) -> None:
    """Forward pre-hook on the dry run's token embedding (never on a GPU): the SIMULATED OOM, in real steps only
    (memplan's traces of the step run on fake tensors and use no memory)."""
    import torch

    from memplan.compat.torch import FakeTensor

    idx = args[0]
    if not isinstance(idx, FakeTensor) and idx.shape[0] > DRY_OOM_ABOVE:
        raise torch.OutOfMemoryError(f"SIMULATED out of memory (dry run): {idx.shape[0]} samples > {DRY_OOM_ABOVE}")


def oom_retry(cpu: bool) -> dict:
    """A loaded batch ~1.5x what the card holds, planned as one micro-batch: the first step runs out of
    memory for real; MemoryPlanner retries smaller on the same samples, and the fit must finish."""
    import pytorch_lightning as pl
    import torch

    from memplan.callback import MemoryPlanner
    from memplan.demos import GPTLM, RandomTokens
    from memplan.estimator.api import estimate

    _quiet()
    on_gpu = torch.cuda.is_available() and not cpu
    sizes = GPT2_TINY if not on_gpu else GPT2_SMALL
    precision = "bf16-mixed"
    out: dict = {"model": sizes, "precision": precision}
    if on_gpu:
        total = torch.cuda.get_device_properties(0).total_memory
        est = {m: estimate(lambda: GPTLM(**sizes), _tokens(sizes, m), precision=precision,
                           device=None).device_total for m in (4, 8)}
        per_sample = max((est[8] - est[4]) // 4, 1)
        micro = int(8 + (1.5 * total - est[8]) // per_sample)
        micro = (micro + 7) // 8 * 8
        out.update(device_total_bytes=total, estimate_4=est[4], estimate_8=est[8], per_sample_bytes=per_sample)
    else:
        micro = 16
        out["simulated_oom_above"] = DRY_OOM_ABOVE
    out["loaded_batch"] = micro
    steps = 3
    torch.manual_seed(0)
    model = GPTLM(**sizes)
    if not on_gpu:  # the dry run meets no real OOM on the CPU: a SIMULATED one, so the retry path runs
        model.tok.register_forward_pre_hook(_simulated_oom)
    data = RandomTokens(batch_size=micro, vocab_size=sizes["vocab_size"], context=sizes["context"],
                        num_samples=micro * (steps + 1))
    with tempfile.TemporaryDirectory() as tmp:
        planner = MemoryPlanner(_plan(micro, precision, "local" if on_gpu else "cpu", on_gpu),
                                log_dir=Path(tmp) / "memplan")
        trainer = pl.Trainer(accelerator="gpu" if on_gpu else "cpu", devices=1, precision=precision, max_steps=steps,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, log_every_n_steps=1, callbacks=[planner])
        started = time.perf_counter()
        trainer.fit(model, datamodule=data)
        out["fit_seconds"] = time.perf_counter() - started
        out["global_step"] = trainer.global_step
        out["finished"] = trainer.global_step == steps
        out["final_layout"] = None if planner.layout is None else _plain(planner.layout)
        out["changes"] = _plain(planner.changes)
        out["loss_reduction"] = None if planner.exactness is None else planner.exactness.reduction.describe
        out["rank_log"] = _log_summary(next(iter(sorted((Path(tmp) / "memplan").glob("rank*.jsonl"))), None))
    if on_gpu:
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        out["max_memory_reserved"] = torch.cuda.max_memory_reserved()
    return out


def _plain(value):
    """JSON-ready copy of a dataclass / container (unknown objects as their repr)."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _log_summary(path) -> dict:
    """The rank log's events by kind, with every OOM retry and change and the last reading in full."""
    if path is None or not Path(path).is_file():
        return {"missing": str(path)}
    events = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    kinds: dict[str, int] = {}
    for e in events:
        kinds[str(e.get("event"))] = kinds.get(str(e.get("event")), 0) + 1
    keep = [e for e in events if e.get("event") not in ("sample", "reading")]
    readings = [e for e in events if e.get("event") in ("sample", "reading")]
    return {"events": kinds, "notable": keep[:40], "readings": readings[:50]}


def overhead(cpu: bool, repeat: int) -> dict:
    """MemoryPlanner's cost per step on gpt2-small, end to end and its own code (benchmarks.callback_overhead's
    instrumentation), at the default interval."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.callback_overhead_clocks import WARMUP, OwnTime, StepClock
    from memplan.callback import MemoryPlanner
    from memplan.demos import GPTLM

    _quiet()
    on_gpu = torch.cuda.is_available() and not cpu
    sizes, micro, steps = (GPT2_SMALL, 8, 150) if on_gpu else (GPT2_TINY, 4, WARMUP + 30)
    precision = "bf16-mixed"

    def run(arm: str, n_steps: int, tmp: Path) -> dict:
        torch.manual_seed(0)
        model = GPTLM(**sizes)
        x, y = model.example_batch(micro)
        data = TensorDataset(x.repeat(n_steps + 1, 1), y.repeat(n_steps + 1, 1))
        clock = StepClock()
        target = None
        if arm in ("with", "own"):
            target = MemoryPlanner(_plan(micro, precision, "local" if on_gpu else "cpu", on_gpu),
                                   log_dir=tmp / "memplan")
        elif arm == "floor":
            target = Callback()
        trainer = pl.Trainer(accelerator="gpu" if on_gpu else "cpu", devices=1, precision=precision,
                             max_steps=n_steps, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=50,
                             callbacks=[c for c in (target, clock) if c is not None])
        own = OwnTime(target, clock) if arm in ("own", "floor") else None
        try:
            trainer.fit(model, DataLoader(data, batch_size=micro))
        finally:
            own_s = own.close() if own is not None else None
        row = {"arm": arm, "step_ms": clock.step_s * 1e3, "steps": clock.steps}
        if own_s is not None:
            row["us_per_step"] = own_s / clock.steps * 1e6
        return row

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        run("without", WARMUP + 10, Path(tmp))  # warm: kernels, cuBLAS handles, imports
        for i, arm in enumerate(["without", "with"] * repeat + ["own", "floor"]):
            try:
                runs.append(run(arm, steps, Path(tmp) / str(i)))
            except Exception as err:  # noqa: BLE001 -- e.g. the instrumentation meets a changed callback
                runs.append({"arm": arm, "error": f"{type(err).__name__}: {err}"[:1000]})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    out = {"model": sizes, "micro_batch": micro, "precision": precision, "steps": steps, "repeat": repeat,
           "device": "cuda" if on_gpu else "cpu", "runs": runs}
    step = {arm: [r["step_ms"] for r in runs if r["arm"] == arm and "step_ms" in r] for arm in ("without", "with")}
    if step["without"] and step["with"]:
        base = statistics.median(step["without"])
        out.update(median_step_ms_without=base, median_step_ms_with=statistics.median(step["with"]),
                   end_to_end_overhead=statistics.median(step["with"]) / base - 1)
        own = [r["us_per_step"] for r in runs if r["arm"] == "own" and "us_per_step" in r]
        floor = [r["us_per_step"] for r in runs if r["arm"] == "floor" and "us_per_step" in r]
        if own and floor:
            out.update(own_us_per_step=own[0], floor_us_per_step=floor[0], own_overhead=own[0] / (base * 1e3))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=("overheads", "context", "oom-retry", "overhead"))
    parser.add_argument("--cpu", action="store_true", help="run on CPU with tiny sizes (the dry run)")
    parser.add_argument("--repeat", type=int, default=3, help="overhead: end-to-end runs without and with")
    args = parser.parse_args(argv)
    print(RESULT_MARKER + json.dumps(run_probe(args.probe, cpu=args.cpu, repeat=args.repeat)), flush=True)
    return 0


def run_probe(probe: str, *, cpu: bool, repeat: int) -> dict:
    """One probe's result in this process (main prints it for the campaign, which starts each in a fresh one)."""
    if probe == "overheads":
        return overheads()
    if probe == "context":
        return context()
    if probe == "oom-retry":
        return oom_retry(cpu)
    return overhead(cpu, repeat)


if __name__ == "__main__":
    sys.exit(main())
