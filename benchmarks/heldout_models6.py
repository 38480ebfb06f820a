"""Plain-torch models for the sixth held-out sweep (benchmarks/heldout_cases6.py): training patterns the earlier
sweeps do not reach (a frozen teacher distilled under no_grad, a frozen backbone, LoRA adapters on a frozen base,
a shared encoder called three times, a MoCo queue with a momentum encoder, two heads, data-dependent torch.where and
gather), batch structures (a PackedSequence, nested tuples, strings in a dict) and LightningModules that configure
their own optimizers (parameter groups, manual optimization with two optimizers and a scheduler, two backwards)."""
from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.realmodels_models import SEQ, VOCAB


def _encoder(dim: int = 64) -> nn.Sequential:
    return nn.Sequential(nn.Embedding(VOCAB, dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.LayerNorm(2 * dim),
                         nn.Linear(2 * dim, dim))


class TeacherStudent(nn.Module):
    """A frozen 4x wider teacher (requires_grad False, eval) run under torch.no_grad; the student is trained on
    CE + temperature-scaled KL to the teacher's logits."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Embedding(VOCAB, 128), nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 10))
        self.teacher.requires_grad_(False)
        self.student = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))

    def forward(self, ids: torch.Tensor):
        with torch.no_grad():
            teacher = self.teacher.eval()(ids).mean(1)
        return self.student(ids).mean(1), teacher


def distill_loss(model: nn.Module, batch) -> torch.Tensor:
    student, teacher = model(batch[0])
    t = 2.0
    kl = F.kl_div(F.log_softmax(student / t, -1), F.log_softmax(teacher / t, -1), log_target=True,
                  reduction="batchmean")
    return 0.5 * F.cross_entropy(student, batch[1]) + 0.5 * t * t * kl


class FrozenBackbone(nn.Module):
    """A conv backbone with requires_grad=False (kept in train mode: its batch norm still updates) and a
    trainable two-layer head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                      nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU())
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 16 * 16, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (self.drop(x) @ self.a.t() @ self.b.t()) * 2.0


class LoRATransformer(nn.Module):
    """A frozen MLP stack (embedding and base linears frozen) with rank-4 adapters on every linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 128).requires_grad_(False)
        self.layers = nn.ModuleList(LoRALinear(nn.Linear(128, 128)) for _ in range(4))
        self.norm = nn.LayerNorm(128)
        self.head = nn.Linear(128, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = x + F.gelu(layer(x))
        return self.head(self.norm(x).mean(1))


class TripletEncoder(nn.Module):
    """One encoder applied to anchor, positive and negative token sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = _encoder()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.enc(ids).mean(1), dim=-1)


def triplet_loss(model: nn.Module, batch) -> torch.Tensor:
    a, p, n = (model(x) for x in batch)
    return F.triplet_margin_loss(a, p, n, margin=0.2)


class MoCo(nn.Module):
    """MoCo v2: a query encoder, a key encoder updated by momentum in forward (no_grad), and a 4096 x 64 queue of
    negatives in a buffer, enqueued in place after each forward."""

    def __init__(self, queue: int = 4096, dim: int = 64) -> None:
        super().__init__()
        self.q = _encoder(dim)
        self.k = copy.deepcopy(self.q).requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(queue, dim), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.q(view1).mean(1), dim=1)
        with torch.no_grad():
            for pk, pq in zip(self.k.parameters(), self.q.parameters()):
                pk.mul_(0.99).add_(pq.detach(), alpha=0.01)
            k = F.normalize(self.k(view2).mean(1), dim=1)
        pos = (q * k).sum(1, keepdim=True)
        neg = q @ self.queue.clone().detach().t()
        logits = torch.cat([pos, neg], 1) / 0.07
        with torch.no_grad():
            n = k.shape[0]
            self.queue[:n] = k  # a fixed slot: the real MoCo rolls ptr; same shapes and memory
            self.ptr.add_(n)
        return F.cross_entropy(logits, torch.zeros(n, dtype=torch.long))


class MultiTask(nn.Module):
    """A shared trunk, a 10-way classification head and a 64-d regression head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.cls = nn.Linear(256, 10)
        self.reg = nn.Sequential(nn.Linear(256, 128), nn.Tanh(), nn.Linear(128, 64))

    def forward(self, x: torch.Tensor):
        h = self.trunk(x)
        return self.cls(h), self.reg(h)


def multitask_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y, target = batch
    logits, reg = model(x)
    return 0.7 * F.cross_entropy(logits, y) + 0.3 * F.smooth_l1_loss(reg, target)


class WhereGather(nn.Module):
    """A forward that masks by the batch's ids with torch.where, picks the last real token per row with gather and
    the rows' positions with index_select."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 96, padding_idx=0)
        self.pos = nn.Embedding(SEQ, 96)
        self.mix = nn.Linear(96, 96)
        self.head = nn.Linear(192, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        real = ids != 0
        x = self.emb(ids) + self.pos.weight.index_select(0, torch.arange(ids.shape[1]))
        x = torch.where(real[..., None], F.silu(self.mix(x)), torch.zeros_like(x))
        last = (real.sum(1) - 1).clamp(min=0)
        picked = x.gather(1, last[:, None, None].expand(-1, 1, x.shape[-1])).squeeze(1)
        mean = x.sum(1) / real.sum(1, keepdim=True).clamp(min=1)
        return self.head(torch.cat([picked, mean], -1))


class PackedLSTM(nn.Module):
    """An LSTM fed a PackedSequence straight from the batch; the classifier reads the last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, packed) -> torch.Tensor:
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


class MaskedEncoder(nn.Module):
    """nn.TransformerEncoder with a key padding mask given by the batch (rows padded to the batch's longest)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64, padding_idx=0)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.enc(self.emb(ids), src_key_padding_mask=~mask)
        return self.head((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))


# --------------------------------------------------------------------------------------------------
# LightningModules that configure their own optimization


class ParamGroupsModule(pl.LightningModule):
    """AdamW with two parameter groups: weight decay on matrices, none on biases and norms, and a second
    learning rate for the head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        decay = [p for n, p in self.body.named_parameters() if p.ndim > 1]
        no_decay = [p for n, p in self.body.named_parameters() if p.ndim <= 1]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                                  {"params": no_decay, "weight_decay": 0.0},
                                  {"params": self.head.parameters(), "lr": 1e-2}], lr=1e-3)


class RetainGraphModule(pl.LightningModule):
    """Manual optimization: two losses on one forward, the first backward with retain_graph=True."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = MultiTask()

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y, target = batch
        logits, reg = self.net(x)
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(logits, y), retain_graph=True)
        loss = F.smooth_l1_loss(reg, target)
        self.manual_backward(loss)
        opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class TwoOptimizerGAN(pl.LightningModule):
    """A small GAN: manual optimization with two optimizers (Adam for G, SGD-momentum for D) and a StepLR
    scheduler stepped each batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 64))
        self.d = nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))

    def training_step(self, batch, batch_idx):
        real = batch[0]
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 16)
        fake = self.g(z)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        d_loss = (F.binary_cross_entropy_with_logits(self.d(real), ones)
                  + F.binary_cross_entropy_with_logits(self.d(fake.detach()), zeros))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(self.d(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.lr_schedulers().step()
        return g_loss

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.g.parameters(), lr=2e-4, betas=(0.5, 0.999))
        opt_d = torch.optim.SGD(self.d.parameters(), lr=1e-2, momentum=0.9)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, 1, gamma=0.9)]


class TwoTowerCLIP(nn.Module):
    """A text tower (embedding, MLP, mean) and an image tower (two convs, pooled), projected to 64 and compared
    all-to-all under a learnable temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.text = _encoder(64)
        self.image = nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.GELU(),
                                   nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                   nn.Linear(64, 64))
        self.logit_scale = nn.Parameter(torch.tensor(2.659))

    def forward(self, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        t = F.normalize(self.text(ids).mean(1), dim=-1)
        i = F.normalize(self.image(pixels), dim=-1)
        return self.logit_scale.exp() * t @ i.t()


def clip_loss(model: nn.Module, batch) -> torch.Tensor:
    logits = model(*batch)
    target = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2
