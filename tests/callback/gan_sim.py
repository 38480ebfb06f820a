"""A small GAN that optimizes manually (`automatic_optimization = False`), two Adam optimizers and a
scheduler, for the manual-optimization tests (CPU only). `optimizer_steps` counts each optimizer's
steps and `step_batches` the samples each optimizer step saw."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NOISE, FEATURES, SAMPLES = 8, 16, 64


class TinyGAN(pl.LightningModule):
    def __init__(self, batch_size: int = 16, with_attr: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        if with_attr:
            self.batch_size = batch_size
        self._loader_batch = batch_size
        self.generator = nn.Sequential(nn.Linear(NOISE, 64), nn.ReLU(), nn.Linear(64, FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))
        self.step_batches: list[int] = []

    def training_step(self, batch, batch_idx):
        (real,) = batch
        g_opt, d_opt = self.optimizers()
        noise = torch.randn(len(real), NOISE, device=real.device)

        self.toggle_optimizer(d_opt)
        fake = self.generator(noise).detach()
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        d_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones) + \
            F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        self.untoggle_optimizer(d_opt)
        self.step_batches.append(len(real))

        self.toggle_optimizer(g_opt)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(noise)), ones)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)
        self.step_batches.append(len(real))
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})
        self.lr_schedulers().step()

    def configure_optimizers(self):
        g_opt = torch.optim.Adam(self.generator.parameters(), lr=1e-3)
        d_opt = torch.optim.Adam(self.discriminator.parameters(), lr=1e-3)
        return [g_opt, d_opt], [torch.optim.lr_scheduler.StepLR(g_opt, step_size=10)]

    def train_dataloader(self):
        data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=torch.Generator().manual_seed(0)))
        return DataLoader(data, batch_size=getattr(self, "batch_size", self._loader_batch))
