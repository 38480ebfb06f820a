"""Plain-torch models for the held-out sweep (benchmarks/heldout_sweep.py): the classes users hit that no
realmodels case has: weight_norm / spectral_norm parametrizations, torch.utils.checkpoint with
use_reentrant True and False, nn.MultiheadAttention returning its weights, in-place activations and
updates, a model returning a tuple or a dict, a buffer updated every step."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint

VOCAB = 1000
DIM = 128


class WeightNormMLP(nn.Module):
    """Every Linear under parametrizations.weight_norm: the weight is recomputed from g and v each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(parametrizations.weight_norm(nn.Linear(64 if i == 0 else 256, 256))
                                    for i in range(3))
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


class SpectralNormCNN(nn.Module):
    """A GAN-discriminator style CNN: spectral_norm runs a power iteration and updates its u/v buffers in
    place in each training forward."""

    def __init__(self) -> None:
        super().__init__()
        sn = parametrizations.spectral_norm
        self.body = nn.Sequential(
            sn(nn.Conv2d(3, 32, 3, stride=2, padding=1)), nn.LeakyReLU(0.2),
            sn(nn.Conv2d(32, 64, 3, stride=2, padding=1)), nn.LeakyReLU(0.2),
            nn.Flatten(), sn(nn.Linear(64 * 8 * 8, 10)))

    def forward(self, x):
        return self.body(x)


class Block(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class CheckpointedMLP(nn.Module):
    """Four residual blocks, each run through torch.utils.checkpoint by the model itself."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(DIM, 10)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x.mean(1))


class MHAWeights(nn.Module):
    """nn.MultiheadAttention with need_weights=True (the slow path: attention weights materialised and
    averaged over heads), the weights used by the head."""

    def __init__(self, average: bool = True) -> None:
        super().__init__()
        self.average = average
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True, dropout=0.1)
        self.attn2 = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.head = nn.Linear(DIM + 64, 10)

    def forward(self, ids):
        x = self.embed(ids)
        y, weights = self.attn(x, x, x, need_weights=True, average_attn_weights=self.average)
        x = x + y
        y, _ = self.attn2(x, x, x, need_weights=False)
        x = x + y
        w = weights if self.average else weights.mean(1)
        return self.head(torch.cat([x.mean(1), w.mean(1)], -1))


class InplaceCNN(nn.Module):
    """ReLU(inplace=True), an in-place residual add_ and an in-place clamp_ on activations autograd keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(x))
        y.add_(x)
        y = F.hardtanh(y, 0.0, 6.0, inplace=True)
        y = F.silu(y, inplace=True)
        return self.head(y.mean((2, 3)))


class TupleOutput(nn.Module):
    """Returns (logits, hidden, aux) : the loss reads two of three outputs; the hidden state is dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, 10)
        self.aux = nn.Linear(DIM, 1)

    def forward(self, ids):
        h = self.body(self.embed(ids))
        return self.head(h.mean(1)), h, self.aux(h).squeeze(-1)


def tuple_loss(model: nn.Module, batch) -> torch.Tensor:
    logits, _, aux = model(batch[0])
    return F.cross_entropy(logits, batch[1]) + 0.01 * aux.pow(2).mean()


class DictOutput(nn.Module):
    """Returns a dict of two heads' outputs and a detached feature map."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Sequential(Block(), Block())
        self.cls = nn.Linear(DIM, 10)
        self.tok = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        h = self.body(self.embed(ids))
        return {"cls": self.cls(h.mean(1)), "tokens": self.tok(h), "features": h.detach()}


def dict_loss(model: nn.Module, batch) -> torch.Tensor:
    out = model(batch[0])
    return F.cross_entropy(out["cls"], batch[1]) + F.cross_entropy(out["tokens"].flatten(0, 1), batch[0].flatten())


class RunningBuffer(nn.Module):
    """A feature-normalising model whose buffers (a running mean and a step count, and a queue of past
    features, as MoCo keeps) are updated in place every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, 10)
        self.register_buffer("running_mean", torch.zeros(DIM))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("queue", torch.zeros(256, DIM))

    def forward(self, ids):
        h = self.body(self.embed(ids)).mean(1)
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
                self.steps += 1
                self.queue = torch.cat([h.detach(), self.queue[:-h.shape[0]]])
        logits = self.head(h - self.running_mean)
        return logits + 0.0 * (h @ self.queue.t()).mean()


class EmbeddingBagModel(nn.Module):
    """A recommender's bag of sparse features: nn.EmbeddingBag (mean and max) over offsets."""

    def __init__(self) -> None:
        super().__init__()
        self.mean_bag = nn.EmbeddingBag(VOCAB, 64, mode="mean")
        self.max_bag = nn.EmbeddingBag(VOCAB, 64, mode="max")
        self.head = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, ids):
        flat = ids.flatten()
        offsets = torch.arange(0, flat.numel(), ids.shape[1], device=ids.device)
        return self.head(torch.cat([self.mean_bag(flat, offsets), self.max_bag(flat, offsets)], -1))


class PackedBiLSTM(nn.Module):
    """A bidirectional LSTM over a packed, variable-length batch (pack_padded_sequence)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.rnn = nn.LSTM(64, 64, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(128, 10)

    def forward(self, ids):
        lengths = ids.shape[1] - 8 * (torch.arange(ids.shape[0]) % 4)
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(ids), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.head(out.mean(1))


class TinyUNet(nn.Module):
    """Down (strided conv, GroupNorm, max pool), up (ConvTranspose2d, bilinear interpolate, pixel shuffle),
    skip concatenations: a segmentation head scored per pixel."""

    def __init__(self) -> None:
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.SiLU())
        self.down2 = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GroupNorm(8, 64), nn.SiLU())
        self.mid = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.InstanceNorm2d(64, affine=True))
        self.up1 = nn.ConvTranspose2d(64, 64, 2, stride=2)
        self.up2 = nn.Conv2d(128, 4 * 32, 3, padding=1)
        self.shuffle = nn.PixelShuffle(2)
        self.out = nn.Conv2d(64, 10, 1)

    def forward(self, x):
        a = self.down1(x)
        b = self.down2(a)
        m = self.up1(self.mid(b))
        u = self.shuffle(self.up2(torch.cat([m, b], 1)))
        u = F.interpolate(u, size=a.shape[-2:], mode="bilinear", align_corners=False)
        return self.out(torch.cat([u, a], 1)).mean((2, 3))


class SpatialTransformer(nn.Module):
    """affine_grid + grid_sample (a spatial transformer), then a small CNN."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(3, 8, 5, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                                 nn.Linear(128, 6))
        self.body = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(4), nn.Flatten(),
                                  nn.Linear(512, 10))

    def forward(self, x):
        theta = self.loc(x).view(-1, 2, 3) + torch.eye(2, 3, device=x.device)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.body(F.grid_sample(x, grid, align_corners=False))


class PrototypeCdist(nn.Module):
    """Prototype classification: logits are minus the cdist to learned prototypes (p=2) plus an L1 term."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = Block()
        self.prototypes = nn.Parameter(torch.randn(10, DIM))

    def forward(self, ids):
        h = self.body(self.embed(ids))
        l2 = torch.cdist(h.mean(1), self.prototypes)
        l1 = torch.cdist(h, self.prototypes.expand(h.shape[0], -1, -1), p=1).mean(1)
        return -(l2 + 0.01 * l1)


class STFTClassifier(nn.Module):
    """Audio: torch.stft of the waveform (Hann window), log magnitude, Conv1d, GRU-free pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(256))
        self.conv = nn.Sequential(nn.Conv1d(129, 64, 3, padding=1), nn.ReLU(), nn.Conv1d(64, 64, 3, dilation=2))
        self.head = nn.Linear(64, 10)

    def forward(self, wave):
        spec = torch.stft(wave, 256, hop_length=64, window=self.window, return_complex=True)
        feats = torch.log1p(spec.abs())
        return self.head(self.conv(feats).amax(-1))


class OrthogonalRNN(nn.Module):
    """A recurrent cell whose hidden-to-hidden matrix is kept orthogonal by parametrizations.orthogonal
    (matrix_exp of a skew matrix each forward), unrolled over the sequence in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.inp = nn.Linear(64, 64)
        self.rec = parametrizations.orthogonal(nn.Linear(64, 64, bias=False))
        self.head = nn.Linear(64, 10)

    def forward(self, ids):
        x = self.inp(self.embed(ids))
        h = torch.zeros(x.shape[0], 64, device=x.device)
        for t in range(x.shape[1]):
            h = torch.tanh(x[:, t] + self.rec(h))
        return self.head(h)


class MaxUnpoolAutoencoder(nn.Module):
    """max_pool2d with indices and max_unpool2d (SegNet's decoder), scored by a reconstruction loss."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 32, 3, padding=1)
        self.dec = nn.Conv2d(32, 3, 3, padding=1)

    def forward(self, x):
        y, idx = F.max_pool2d(F.relu(self.enc(x)), 2, return_indices=True)
        return self.dec(F.max_unpool2d(y, idx, 2, output_size=x.shape[-2:]))


def reconstruction_loss(model: nn.Module, batch) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[0])
