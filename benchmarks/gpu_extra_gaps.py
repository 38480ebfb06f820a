"""benchmarks.gpu_extra's memory gaps: the published-figure cases (ViT-L/16 as rasbt's scripts train it, autocast's
weight cache on zoo cases, FSDP2 on one GPU), each case's truth from a plain loop written here (Peaks reads the
device's peaks) and memplan's estimate of it."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from benchmarks.gpu_extra_models import (
    _autocast_batch,
    _to,
    _zoo_case,
    gpt2_small,
    gpt2_small_batch,
    vit_batch,
    vit_model,
)

VIT_ADAM_LR = 5e-5
STEPS = 3


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
    from benchmarks.published_gpu_figures import _vit
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


def run_gap(mode: str, name: str, cpu: bool) -> dict:
    """One gap case's truth (mode 'memory') or memplan's estimate of it ('estimate'), as its result line holds it."""
    gap = gap_cases()[name]
    if mode == "estimate":
        result = estimate_gap(gap, cpu)
    else:
        result = {"vit": measure_vit, "autocast": measure_autocast, "fsdp2": measure_fsdp2}[gap.kind](gap, cpu)
    return {"case": gap.name, **result}
