"""Plain-torch models and losses for the sweep-4 held-out cases (benchmarks/heldout_cases4.py), continued from
heldout_models4.py: video Conv3d, dilated convolutions with pixel shuffle and fractional pooling, a Fourier neural
operator with complex weights, an embedding with max_norm, boolean-mask token pruning, a scripted function, learned
fake quantization, cumulative ops, a VAE, bicubic and antialiased resizing, and a torch.func Jacobian penalty."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.heldout_models4 import DIM, VOCAB
from benchmarks.realmodels_models import _gen


class VideoConv3d(nn.Module):
    """Conv3d + ConvTranspose3d + MaxPool3d on a (B, 3, 8, 32, 32) clip."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
                                 nn.Conv3d(16, 32, 3, padding=1), nn.ReLU())
        self.dec = nn.ConvTranspose3d(32, 8, 2, stride=2)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.dec(self.enc(x)).mean((2, 3, 4)))


def video_batch(batch_size: int):
    g = _gen()
    return torch.randn(batch_size, 3, 8, 32, 32, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


class DilatedCNN(nn.Module):
    """Dilated 3x3 convolutions (dilation 2 and 4), a pixel shuffle and a fractional max pool."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 32, 3, padding=2, dilation=2)
        self.c2 = nn.Conv2d(32, 64, 3, padding=4, dilation=4)
        self.shuffle = nn.PixelShuffle(2)
        self.pool = nn.FractionalMaxPool2d(3, output_ratio=0.5)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.shuffle(F.relu(self.c2(F.relu(self.c1(x)))))
        return self.head(self.pool(x).mean((2, 3)))


class FNO(nn.Module):
    """A 2-d Fourier neural operator layer: rfft2, complex weights (cfloat parameters) on the low modes, irfft2."""

    def __init__(self, width: int = 32, modes: int = 8) -> None:
        super().__init__()
        self.modes = modes
        self.lift = nn.Conv2d(3, width, 1)
        self.w = nn.Parameter(torch.randn(width, width, modes, modes, dtype=torch.cfloat) / width)
        self.skip = nn.Conv2d(width, width, 1)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = self.lift(x)
        xf = torch.fft.rfft2(x)
        out = torch.zeros_like(xf)
        m = self.modes
        out[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, :m, :m], self.w)
        x = F.gelu(torch.fft.irfft2(out, s=x.shape[-2:]) + self.skip(x))
        return self.head(x.mean((2, 3)))


class MaxNormEmbedding(nn.Module):
    """nn.Embedding(max_norm=1.0): each forward renormalises the looked-up rows of the weight in place."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, max_norm=1.0)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, 10))

    def forward(self, ids):
        return self.mlp(self.embed(ids).mean(1))


class BooleanMaskSelect(nn.Module):
    """Token pruning by activation value: keeps the tokens whose gate is positive (h[mask], a data-dependent
    count), runs the MLP on those only, and scatters them back (index_put)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.gate = nn.Linear(DIM, 1)
        self.mlp = nn.Sequential(nn.Linear(DIM, 8 * DIM), nn.GELU(), nn.Linear(8 * DIM, DIM))
        self.head = nn.Linear(DIM, 10)

    def forward(self, ids):
        h = self.embed(ids)
        keep = self.gate(h).squeeze(-1) > 0
        out = h.clone()
        out[keep] = h[keep] + self.mlp(h[keep])
        return self.head(out.mean(1))


def _fused_gelu_gate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * 0.5 * b * (1.0 + torch.tanh(0.79788456 * (b + 0.044715 * b * b * b)))


class JitScripted(nn.Module):
    """A torch.jit.script function (a GeGLU gate) inside an eager model, and a scripted submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, 8 * DIM)
        self.down = torch.jit.script(nn.Sequential(nn.Linear(4 * DIM, DIM), nn.LayerNorm(DIM)))
        self.head = nn.Linear(DIM, 10)
        self.gate = torch.jit.script(_fused_gelu_gate)

    def forward(self, ids):
        a, b = self.up(self.embed(ids)).chunk(2, -1)
        return self.head(self.down(self.gate(a, b)).mean(1))


class QATLinear(nn.Module):
    """Quantization-aware training: learnable-scale fake quantization of weights and activations
    (torch._fake_quantize_learnable_per_tensor_affine, LSQ)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64 if i == 0 else 256, 256) for i in range(3))
        self.scales = nn.Parameter(torch.full((6,), 0.05))
        self.zero = nn.Parameter(torch.zeros(6), requires_grad=False)
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        fq = torch._fake_quantize_learnable_per_tensor_affine
        for i, layer in enumerate(self.layers):
            w = fq(layer.weight, self.scales[2 * i:2 * i + 1], self.zero[2 * i:2 * i + 1], -128, 127, 1.0)
            x = fq(F.relu(F.linear(x, w, layer.bias)), self.scales[2 * i + 1:2 * i + 2],
                   self.zero[2 * i + 1:2 * i + 2], 0, 255, 1.0)
        return self.head(x)


class CumulativeOps(nn.Module):
    """cumprod (its backward divides or, with zeros, runs a slower formula), logcumsumexp and cummax over the
    sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, 3 * DIM)
        self.head = nn.Linear(DIM, 10)

    def forward(self, ids):
        a, b, c = self.proj(self.embed(ids)).chunk(3, -1)
        decay = torch.sigmoid(a).cumprod(1)
        x = decay * torch.logcumsumexp(b, 1) + torch.cummax(c, 1).values
        return self.head(x.mean(1))


class VAE(nn.Module):
    """A VAE with rsample from a Normal (torch.distributions) and a hard Gumbel-softmax discrete code."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 48))
        self.dec = nn.Sequential(nn.Linear(16 + 16, 256), nn.ReLU(), nn.Linear(256, 64))

    def forward(self, x):
        h = self.enc(x)
        mu, logvar, logits = h[:, :16], h[:, 16:32], h[:, 32:]
        q = torch.distributions.Normal(mu, (0.5 * logvar).exp())
        z = q.rsample()
        code = F.gumbel_softmax(logits, tau=0.5, hard=True)
        kl = torch.distributions.kl_divergence(q, torch.distributions.Normal(0.0, 1.0)).sum(-1).mean()
        return self.dec(torch.cat([z, code], -1)), kl


def vae_loss(model: nn.Module, batch) -> torch.Tensor:
    recon, kl = model(batch[0])
    return F.mse_loss(recon, batch[0]) + kl


class Upsampler(nn.Module):
    """Bicubic and antialiased bilinear resizing (down then up) between convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.c1(x))
        x = F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True)
        x = F.interpolate(F.relu(self.c2(x)), scale_factor=3.0, mode="bicubic", align_corners=False)
        return self.head(x.mean((2, 3)))


def jacobian_loss(model: nn.Module, batch) -> torch.Tensor:
    """Cross entropy + a Jacobian-norm regulariser computed with torch.func (vmap over jacrev)."""
    from torch.func import functional_call, jacrev, vmap

    x, y = batch
    params = dict(model.named_parameters())
    f = lambda xi: functional_call(model, params, (xi[None],))[0]  # noqa: E731
    jac = vmap(jacrev(f))(x[:8])
    return F.cross_entropy(model(x), y) + 1e-3 * jac.pow(2).sum() / 8
