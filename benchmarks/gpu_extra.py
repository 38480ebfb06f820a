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
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass

RESULT_MARKER = "GPU_EXTRA_RESULT "
"""Prefix of each result line (library output may precede it)."""
VIT_ADAM_LR = 5e-5
STEPS = 3
WARMUP_STEPS, TIMED_STEPS = 3, 10


@dataclass(frozen=True, kw_only=True)
class Gap:
    """One memory-gap case."""

    name: str
    kind: str
    """'vit', 'autocast' or 'fsdp2'."""
    precision: str
    batch: int
    zoo: str = ""
    """The zoo case ('autocast')."""


def gap_cases() -> dict[str, Gap]:
    cases = [Gap(name=f"vit-l16-{tag}-b{b}", kind="vit", precision=p, batch=b)
             for b in (16, 64) for p, tag in (("16-mixed", "16mixed"), ("bf16-true", "bf16true"), ("32-true", "fp32"))]
    cases += [Gap(name=f"autocast-cache-{z}", kind="autocast", precision="bf16-mixed", batch=0, zoo=z)
              for z in ("lstm-b32", "gpt2-b8", "resnet18-b8", "bert-b8")]
    cases += [Gap(name=f"fsdp2-1gpu-{tag}", kind="fsdp2", precision=p, batch=8)
              for p, tag in (("bf16-mixed", "bf16mixed"), ("32-true", "fp32"))]
    return {c.name: c for c in cases}


DRY_GAPS = ("vit-l16-16mixed-b16", "autocast-cache-lstm-b32", "fsdp2-1gpu-fp32")


# --- models and batches ---------------------------------------------------------------------------
def _autocast_batch(case, cpu: bool) -> int:
    """The zoo case's batch; 2 in a dry run (tiny sizes, as the other cases')."""
    return 2 if cpu else case.batch_size


def _zoo_case(name: str):
    from benchmarks.zoo import CASES

    return CASES[name]


def vit_model(cpu: bool):
    """torchvision's vit_l_16 with a 10-class head (tiny on CPU); memplan's module-for-module copy where
    torchvision is missing (recorded)."""
    import torch.nn as nn

    size = dict(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64) if cpu else {}
    try:
        from torchvision.models import vit_l_16
        from torchvision.models.vision_transformer import VisionTransformer as TorchvisionViT
    except ImportError:
        from benchmarks.published_gpu import VisionTransformer

        keys = dict(image="image_size", patch="patch_size", layers="num_layers", heads="num_heads", dim="hidden_dim",
                    mlp="mlp_dim")
        return VisionTransformer(**{k: size[v] for k, v in keys.items()} if cpu else {}), "benchmarks.published_gpu"
    model = TorchvisionViT(**size) if cpu else vit_l_16()
    model.heads.head = nn.Linear(model.hidden_dim, 10)
    return model, "torchvision"


def vit_batch(batch: int, cpu: bool):
    import torch

    side = 32 if cpu else 224
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, side, side, generator=g), torch.randint(0, 10, (batch,), generator=g)


DRY_VOCAB = 1001  # the dry run's: odd like GPT-2's 50257, whose LM head was most of a tiny model's step


def gpt2_small(cpu: bool):
    import transformers

    size = dict(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=DRY_VOCAB) if cpu else {}
    config = transformers.GPT2Config(attn_implementation="sdpa", use_cache=False, **size)
    return transformers.GPT2LMHeadModel(config).train()


def gpt2_small_batch(batch: int, cpu: bool) -> dict:
    import torch

    ids = torch.randint(0, DRY_VOCAB if cpu else 50257, (batch, 32 if cpu else 1024),
                        generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _to(tree, device):
    from memplan.batching import map_tensors

    return map_tensors(tree, lambda t: t.to(device))


# --- memory truths ----------------------------------------------------------------------------------
class Peaks:
    """max_memory_allocated / reserved over the whole run and over the steps after the first."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device == "cuda"
        self.torch = torch
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def after_first_step(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.whole = (self.torch.cuda.max_memory_allocated(), self.torch.cuda.max_memory_reserved())
            self.torch.cuda.reset_peak_memory_stats()

    def result(self) -> dict:
        if not self.cuda:
            return {"device": "cpu"}
        cuda = self.torch.cuda
        cuda.synchronize()
        steady = (cuda.max_memory_allocated(), cuda.max_memory_reserved())
        return {"device": "cuda", "max_allocated": max(self.whole[0], steady[0]),
                "max_reserved": max(self.whole[1], steady[1]), "steady_max_allocated": steady[0],
                "steady_max_reserved": steady[1], "first_step_max_allocated": self.whole[0],
                "first_step_max_reserved": self.whole[1]}


def measure_vit(gap: Gap, cpu: bool) -> dict:
    import torch
    import torch.nn.functional as F

    device = "cpu" if cpu else "cuda"
    peaks = Peaks(device)
    model, source = vit_model(cpu)
    if gap.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=VIT_ADAM_LR)
    scaler = torch.amp.GradScaler(device, enabled=gap.precision == "16-mixed" and not cpu)
    x, y = _to(vit_batch(gap.batch, cpu), device)
    for step in range(STEPS):
        if gap.precision == "16-mixed":
            with torch.autocast(device, dtype=torch.bfloat16 if cpu else torch.float16):
                loss = F.cross_entropy(model(x), y)
        elif gap.precision == "bf16-true":
            loss = F.cross_entropy(model(x.to(torch.bfloat16)).float(), y)
        else:
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step == 0:
            peaks.after_first_step()
    return {"model_source": source, "loop": "forward + loss, zero_grad, backward, step (the scripts' order)",
            **peaks.result()}


def measure_autocast(gap: Gap, cpu: bool) -> dict:
    """The plain autocast loop's peaks. On a CPU (a dry run) whose oneDNN has no bfloat16 kernels (no AVX-512 BF16
    or AMX: an AVX2-only AMD EPYC, whose oneDNN cannot build a bf16 LSTM), the loop runs on ATen's own kernels
    instead, and the result says so: the dry run checks the campaign's plumbing, not these CPU figures."""
    import torch

    if cpu and not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # private: a dry run's choice only
        with torch.backends.mkldnn.flags(enabled=False):
            return {**_measure_autocast(gap, cpu), "cpu_kernels": "ATen's (this CPU's oneDNN has no bfloat16)"}
    return _measure_autocast(gap, cpu)


def _measure_autocast(gap: Gap, cpu: bool) -> dict:
    import torch

    from benchmarks.zoo import make_optimizer

    case = _zoo_case(gap.zoo)
    device = "cpu" if cpu else "cuda"
    peaks = Peaks(device)
    torch.manual_seed(0)
    model = case.build().to(device)
    optimizer = make_optimizer(case.optimizer, model.parameters())
    batch = _to(case.make_batch(_autocast_batch(case, cpu)), device)
    for step in range(STEPS):
        with torch.autocast(device, dtype=torch.bfloat16):  # cache_enabled: torch's default, True
            loss = case.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:
            peaks.after_first_step()
    return {"zoo_case": case.name, "optimizer": case.optimizer, "batch": _autocast_batch(case, cpu),
            "loop": "autocast(bf16, cache on) forward + loss, backward, step, zero_grad(set_to_none=True)",
            **peaks.result()}


def measure_fsdp2(gap: Gap, cpu: bool) -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    from memplan.estimator.checkpointing import find_repeated_blocks

    device = "cpu" if cpu else "cuda"
    batch = gpt2_small_batch(gap.batch, cpu)
    state: dict = {}

    class Gpt2(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            if self.model is None:
                model = gpt2_small(cpu)
                mesh = self.device_mesh["data_parallel"]
                for _, block in find_repeated_blocks(model):
                    fully_shard(block, mesh=mesh)
                self.model = fully_shard(model, mesh=mesh)

        def training_step(self, b, batch_idx):
            return self.model(**b).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters())

        def on_train_batch_start(self, b, batch_idx) -> None:
            if batch_idx == 0:
                state["peaks"] = Peaks(device)
            if batch_idx == 1:
                state["peaks"].after_first_step()

    trainer = pl.Trainer(accelerator=device, devices=1, precision=gap.precision, max_steps=STEPS,
                         strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(Gpt2(), DataLoader([batch] * STEPS, batch_size=None))
    return {"loop": "Lightning ModelParallelStrategy(1, 1), fully_shard per GPT2Block and root, AdamW",
            **state["peaks"].result()}


def estimate_gap(gap: Gap, cpu: bool) -> dict:
    """memplan's estimate of a gap case on this machine's GPU (device None; "cpu" for the dry run)."""
    from benchmarks.published_gpu import _vit
    from memplan.estimator import estimate

    device = "cpu" if cpu else None
    if gap.kind == "vit":
        if cpu:
            return {"skipped": "the ViT-L/16 estimate is full size only"}
        est = _vit(gap.precision, gap.batch, device=device)(False)
    elif gap.kind == "autocast":
        case = _zoo_case(gap.zoo)
        est = estimate(case.build, case.make_batch(_autocast_batch(case, cpu)), loss=case.loss,
                       optimizer=case.optimizer, precision="bf16-mixed", loop="torch", device=device)
    else:
        est = estimate(functools.partial(gpt2_small, cpu), gpt2_small_batch(gap.batch, cpu), optimizer="adamw",
                       precision=gap.precision, strategy="fsdp", world_size=1, device=device)
    return {"peak_allocated": est.peak_allocated, "peak_reserved": est.peak_reserved,
            "device_total": est.device_total, "device": est.device, "trace_seconds": est.trace_seconds}


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


def run_gap(mode: str, name: str, cpu: bool) -> dict:
    """One gap case's truth (mode 'memory') or memplan's estimate of it ('estimate'), as its result line holds it."""
    gap = gap_cases()[name]
    if mode == "estimate":
        result = estimate_gap(gap, cpu)
    else:
        result = {"vit": measure_vit, "autocast": measure_autocast, "fsdp2": measure_fsdp2}[gap.kind](gap, cpu)
    return {"case": gap.name, **result}


if __name__ == "__main__":
    sys.exit(main())
