"""torch.amp.GradScaler's device tensors in a 16-mixed CUDA estimate (memplan.estimator.step.grad_scaler_tensors,
unscale_grads), against the H100 campaign's truths (benchmarks/results/gpu_campaign_raw_h100/part1.json)."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn

from memplan.estimator.api import estimate


def mlp():
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


def loss(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _phases(precision: str, device: str) -> dict:
    batch = (torch.randn(64, 256), torch.randint(0, 10, (64,)))
    est = estimate(mlp, batch, loss=loss, optimizer="adamw", precision=precision, device=device)
    return dict(est.peak_allocated_by_phase)


def test_a_16mixed_cuda_step_holds_the_scale_the_growth_tracker_and_found_inf():
    """mlp-b64 on the H100: its 16-mixed run peaked 1,536 B above its bf16-mixed twin, in the optimizer step (truths
    71,058,432 and 71,056,896 B): the scale and the growth tracker kept from the first scale(), and the found_inf copy
    the scaler keeps from unscale_ until update(). In the forward the first two; in the backward also the scaled loss."""
    fp16, bf16 = _phases("16-mixed", "H100-80GB"), _phases("bf16-mixed", "H100-80GB")
    assert fp16["optimizer"] - bf16["optimizer"] == 3 * 512
    assert fp16["forward"] - bf16["forward"] == 2 * 512
    assert fp16["backward"] - bf16["backward"] == 3 * 512


class ManualMLP(pl.LightningModule):
    """mlp() optimized by hand: Lightning's precision plugin unscales at `opt.step()` as in automatic optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = mlp()

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss(self.net, batch))
        opt.step()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_manual_optimization_holds_the_scaler_s_found_inf_copy_through_the_step_as_automatic_does():
    batch = (torch.randn(64, 256), torch.randint(0, 10, (64,)))
    phases = {p: dict(estimate(ManualMLP, batch, precision=p, device="H100-80GB").peak_allocated_by_phase)
              for p in ("16-mixed", "bf16-mixed")}
    assert phases["16-mixed"]["optimizer"] - phases["bf16-mixed"]["optimizer"] == 3 * 512
