"""Plain-torch models, losses and optimizers for the sweep4 held-out cases (benchmarks/heldout_sweep.py):
custom autograd Functions saving views, a gradient penalty (double backward), InfoNCE over a big similarity
matrix, focal loss, EMA weights as buffers, one weight tied across three modules, channels_last, nested and
mixed checkpointing, backward calls inside the loss, WGAN weight clipping in place on parameter views, and
optimizers outside memplan's named ones (Lion, Adafactor, SGD with foreach=False)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks.realmodels_models import _gen

VOCAB = 1000
DIM = 128


class _SplitGate(torch.autograd.Function):
    """y = a * sigmoid(b) for (a, b) = x.chunk(2, -1): saves the two chunks (views of x) and x.t() (a view)."""

    @staticmethod
    def forward(ctx, x):
        a, b = x.chunk(2, -1)
        ctx.save_for_backward(a, b)
        return a * torch.sigmoid(b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        s = torch.sigmoid(b)
        return torch.cat([grad * s, grad * a * s * (1 - s)], -1)


class CustomFunctionViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Linear(DIM, 2 * DIM) for _ in range(3))
        self.head = nn.Linear(DIM, 10)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + _SplitGate.apply(layer(x))
        return self.head(x.mean(1))


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))

    def forward(self, x):
        return self.net(x)


def gradient_penalty_loss(model: nn.Module, batch) -> torch.Tensor:
    """Cross entropy + WGAN-GP style penalty on d(logits)/d(input): a create_graph grad, so backward is a double
    backward."""
    x, y = batch
    x = x.clone().requires_grad_(True)
    out = model(x)
    (g,) = torch.autograd.grad(out.logsumexp(-1).sum(), x, create_graph=True)
    return F.cross_entropy(out, y) + ((g.norm(2, dim=1) - 1) ** 2).mean()


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 128))
        self.k = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 128))
        self.logit_scale = nn.Parameter(torch.tensor(2.6))

    def forward(self, x):
        return F.normalize(self.q(x), dim=-1), F.normalize(self.k(x.flip(0).roll(1, -1)), dim=-1)


def info_nce_loss(model: nn.Module, batch) -> torch.Tensor:
    """Symmetric InfoNCE over the batch x batch similarity matrix, with label smoothing."""
    q, k = model(batch[0])
    sim = q @ k.t() * model.logit_scale.exp()
    target = torch.arange(sim.shape[0])
    return (F.cross_entropy(sim, target, label_smoothing=0.1) + F.cross_entropy(sim.t(), target)) / 2


def contrastive_batch(batch_size: int):
    g = _gen()
    return torch.randn(batch_size, 64, generator=g), torch.zeros(batch_size, dtype=torch.long)


class SegNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.Conv2d(32, 8, 1))

    def forward(self, x):
        return self.body(x)


def seg_batch(batch_size: int):
    g = _gen()
    return torch.randn(batch_size, 3, 32, 32, generator=g), torch.randint(0, 8, (batch_size, 32, 32), generator=g)


def focal_loss(model: nn.Module, batch) -> torch.Tensor:
    """Per-pixel focal loss (gamma 2): log_softmax, gather, exp, pow."""
    logits = model(batch[0])
    logp = F.log_softmax(logits, 1).gather(1, batch[1][:, None]).squeeze(1)
    return (-(1 - logp.exp()) ** 2 * logp).mean()


class EMAModel(nn.Module):
    """A transformer-ish MLP that keeps an EMA of its weights as buffers, updated in place (torch._foreach_lerp_)
    under no_grad in every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.head = nn.Linear(DIM, 10)
        for i, p in enumerate(self.parameters()):
            self.register_buffer(f"ema{i}", p.detach().clone())

    def forward(self, ids):
        if self.training:
            with torch.no_grad():
                ema = [getattr(self, f"ema{i}") for i in range(len(list(self.parameters())))]
                torch._foreach_lerp_(ema, [p.detach() for p in self.parameters()], 0.01)
        x = self.embed(ids)
        return self.head((x + self.mlp(x)).mean(1))


class TiedThree(nn.Module):
    """One (VOCAB, DIM) matrix used by the input embedding, the LM head and an auxiliary bag-of-words head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.TransformerEncoderLayer(DIM, 4, 256, batch_first=True, dropout=0.0)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.aux = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.aux.weight = self.embed.weight

    def forward(self, ids):
        h = self.block(self.embed(ids))
        return self.head(h), self.aux(h.mean(1))


def tied_loss(model: nn.Module, batch) -> torch.Tensor:
    ids, _ = batch
    logits, bow = model(ids)
    bag = torch.zeros(ids.shape[0], VOCAB).scatter_(1, ids, 1.0)
    return (F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            + F.binary_cross_entropy_with_logits(bow, bag))


class ChannelsLastCNN(nn.Module):
    """Weights and input in channels_last (NHWC) memory format."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.Conv2d(64, 64, 3, padding=1, groups=8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.body(x.contiguous(memory_format=torch.channels_last))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class NestedCheckpoint(nn.Module):
    """An outer non-reentrant checkpoint around two inner non-reentrant ones, then a reentrant one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.a, self.b, self.c = _Block(), _Block(), _Block()
        self.head = nn.Linear(DIM, 10)

    def _outer(self, x):
        x = checkpoint(self.a, x, use_reentrant=False)
        return checkpoint(self.b, x, use_reentrant=False)

    def forward(self, ids):
        x = self.embed(ids)
        x = checkpoint(self._outer, x, use_reentrant=False)
        x = checkpoint(self.c, x, use_reentrant=True)
        return self.head(x.mean(1))


class BackwardInLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.net(x)


def microbatch_loss(model: nn.Module, batch) -> torch.Tensor:
    """Gradient accumulation inside one step: backward on each of the first 3 micro-batches in the loss, the 4th's
    loss returned for the loop's own backward."""
    xs, ys = batch[0].chunk(4), batch[1].chunk(4)
    for x, y in zip(xs[:-1], ys[:-1]):
        (F.cross_entropy(model(x), y) / 4).backward()
    return F.cross_entropy(model(xs[-1]), ys[-1]) / 4


class ClippedCritic(nn.Module):
    """WGAN weight clipping: every training forward clamps each weight's first half of rows in place, through a
    view of the parameter, under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.LeakyReLU(0.2), nn.Linear(256, 256), nn.LeakyReLU(0.2),
                                 nn.Linear(256, 10))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                for m in self.net:
                    if isinstance(m, nn.Linear):
                        m.weight[: m.weight.shape[0] // 2].clamp_(-0.05, 0.05)
        return self.net(x)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023), a for-loop implementation: one momentum buffer a parameter."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = m.mul(b1).add_(p.grad, alpha=1 - b1).sign_()
                p.add_(update, alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


OPTIMIZERS = {
    "lion": lambda params: Lion(params, lr=1e-4),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
    "sgd-momentum-for-loop": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False),
}
"""Optimizers the sweep4 cases use besides benchmarks.zoo.OPTIMIZERS (registered there by heldout_sweep)."""


# ---- second batch: kernels and autograd paths the first batch does not reach
