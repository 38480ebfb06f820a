"""Bundled LightningModules for examples, configs and tests (as Lightning ships lightning.pytorch.demos).

Pure torch, no downloads. Each has `example_batch(batch_size)`, a deterministic batch of real tensors
shaped exactly as its `training_step` receives it.
"""
from __future__ import annotations

import math

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn


class _Demo(pl.LightningModule):
    lr: float = 1e-3

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class MLP(_Demo):
    """The seeds' MLP: 1000 -> 4 x 100 -> 10, ReLU."""

    def __init__(self, in_features: int = 1000, hidden: int = 100, depth: int = 4, num_classes: int = 10):
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def example_batch(self, batch_size: int):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch_size, self.hparams.in_features, generator=g)
        return x, torch.randint(0, self.hparams.num_classes, (batch_size,), generator=g)


class ImageCNN(_Demo):
    """A CNN with BatchNorm for 1 x 50 x 180 images (captcha-like), 4 conv blocks and a classifier."""

    def __init__(self, channels: int = 32, num_classes: int = 36, height: int = 50, width: int = 180):
        super().__init__()
        self.save_hyperparameters()
        blocks, c_in = [], 1
        for i in range(4):
            c_out = channels * 2 ** min(i, 2)
            blocks += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)]
            c_in = c_out
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(c_in, num_classes))

    def forward(self, x):
        return self.head(self.features(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def example_batch(self, batch_size: int):
        g = torch.Generator().manual_seed(0)
        hp = self.hparams
        x = torch.randn(batch_size, 1, hp.height, hp.width, generator=g)
        return x, torch.randint(0, hp.num_classes, (batch_size,), generator=g)


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(_Demo):
    """ResNet-18 layout (BasicBlocks [2, 2, 2, 2], widths 64..512) for image classification."""

    def __init__(self, num_classes: int = 1000, image_size: int = 224, blocks: tuple[int, ...] = (2, 2, 2, 2)):
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        layers, c_in = [], 64
        for i, n in enumerate(blocks):
            c_out = 64 * 2**i
            layers += [_BasicBlock(c_in if j == 0 else c_out, c_out, 2 if (j == 0 and i > 0) else 1) for j in range(n)]
            c_in = c_out
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def example_batch(self, batch_size: int):
        g = torch.Generator().manual_seed(0)
        size = self.hparams.image_size
        x = torch.randn(batch_size, 3, size, size, generator=g)
        return x, torch.randint(0, self.hparams.num_classes, (batch_size,), generator=g)


class _GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"), nn.Linear(4 * d_model, d_model))
        self.dropout = dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPTLM(_Demo):
    """A GPT-2-class causal LM (defaults: GPT-2 small, 124M parameters, context 1024), tied embeddings."""

    def __init__(self, vocab_size: int = 50257, context: int = 1024, d_model: int = 768, n_layers: int = 12,
                 n_heads: int = 12, dropout: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_GPTBlock(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def example_batch(self, batch_size: int):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.hparams.vocab_size, (batch_size, self.hparams.context + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


DEMOS: dict[str, type[_Demo]] = {"mlp": MLP, "cnn": ImageCNN, "resnet": ResNet, "gpt2-small": GPTLM}
