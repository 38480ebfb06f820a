"""Plain-torch models for the sweep5 held-out cases (benchmarks/heldout_cases5.py): training patterns the earlier
sweeps do not reach (nn.Transformer with masks, CTC, adaptive softmax, sparse embedding gradients, message passing
by index_add/scatter, stochastic depth, unfold/fold, hooks on activations, SDPA with a boolean mask and dropout)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.realmodels_models import SEQ, VOCAB


class Seq2SeqTransformer(nn.Module):
    """nn.Transformer (batch_first) with a causal target mask and source/target key padding masks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(1, SEQ, 64) * 0.02)
        self.tf = nn.Transformer(64, 4, 2, 2, 128, dropout=0.1, batch_first=True)
        self.out = nn.Linear(64, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        s = self.emb(src) + self.pos[:, :src.shape[1]]
        t = self.emb(tgt) + self.pos[:, :tgt.shape[1]]
        h = self.tf(s, t, tgt_mask=causal, src_key_padding_mask=src == 0, memory_key_padding_mask=src == 0,
                    tgt_is_causal=True)
        return self.out(h)


class SeqFirstMHA(nn.Module):
    """nn.MultiheadAttention, sequence-first, separate kdim/vdim, with a key padding mask and attention dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64, padding_idx=0)
        self.kv = nn.Linear(64, 48)
        self.attn = nn.MultiheadAttention(64, 4, dropout=0.1, kdim=48, vdim=48)
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).transpose(0, 1)  # (L, N, E)
        kv = self.kv(x)
        h, _ = self.attn(x, kv, kv, key_padding_mask=ids == 0, need_weights=False)
        return self.head(h.mean(0))


class ConvCTC(nn.Module):
    """Conv1d subsampling-free front end + bidirectional GRU, 30 CTC classes (blank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(40, 64, 5, padding=2)
        self.gru = nn.GRU(64, 64, num_layers=2, batch_first=True, bidirectional=True, dropout=0.1)
        self.out = nn.Linear(128, 30)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.conv(feats.transpose(1, 2))).transpose(1, 2)
        return self.out(self.gru(h)[0])


class LSTMProjAdaptiveSoftmax(nn.Module):
    """LSTM with proj_size and an AdaptiveLogSoftmaxWithLoss head (cutoffs 100, 400)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True, proj_size=64)
        self.head = nn.AdaptiveLogSoftmaxWithLoss(64, VOCAB, cutoffs=[100, 400], div_value=2.0)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.lstm(self.emb(ids))[0]
        return self.head(h.reshape(-1, 64), targets.reshape(-1)).loss


class SparseEmbeddingBag(nn.Module):
    """EmbeddingBag(sparse=True, mode="sum") with per-sample weights: its gradient is a sparse COO tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(50000, 64, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.bag(ids, offsets, per_sample_weights=weights))


class MessagePassing(nn.Module):
    """Three rounds of GNN message passing: gather by edge source, index_add into targets, degree-normalize by
    scatter_add, then a scatter_reduce("amax") readout per graph."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.msg = nn.ModuleList(nn.Linear(128, 64) for _ in range(3))
        self.out = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor, edges: torch.Tensor, graph: torch.Tensor, graphs: int) -> torch.Tensor:
        h = F.relu(self.inp(x))
        src, dst = edges
        deg = torch.zeros(h.shape[0]).scatter_add(0, dst, torch.ones(dst.shape[0])).clamp(min=1)
        for layer in self.msg:
            m = F.relu(layer(torch.cat([h[src], h[dst]], -1)))
            h = h + torch.zeros_like(h).index_add(0, dst, m) / deg[:, None]
        index = graph[:, None].expand(-1, h.shape[1])
        mx = torch.full((graphs, h.shape[1]), -1e4).scatter_reduce(0, index, h, "amax", include_self=False)
        mean = torch.zeros(graphs, h.shape[1]).index_add(0, graph, h) / 32
        return self.out(torch.cat([mx, mean], -1))


class Scorer(nn.Module):
    """A per-candidate MLP scorer (batch, candidates, features) -> (batch, candidates)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(), nn.Linear(128, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x).squeeze(-1)


class _DropPath(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = torch.rand(x.shape[0], 1, 1, 1, device=x.device) >= self.p
        return x * keep / (1 - self.p)


class _ShuffleBlock(nn.Module):
    """Grouped 1x1 conv, channel shuffle, depthwise 3x3, grouped 1x1; stochastic depth on the residual."""

    def __init__(self, ch: int, p: float) -> None:
        super().__init__()
        self.a = nn.Conv2d(ch, ch, 1, groups=4, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.dw = nn.Conv2d(ch, ch, 3, padding=1, groups=ch, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.b = nn.Conv2d(ch, ch, 1, groups=4, bias=False)
        self.drop = _DropPath(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, hh, ww = x.shape
        y = F.relu(self.bn1(self.a(x)))
        y = y.view(n, 4, c // 4, hh, ww).transpose(1, 2).reshape(n, c, hh, ww)
        y = self.b(self.bn2(self.dw(y)))
        return F.relu(x + self.drop(y))


class ShuffleNetDropPath(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.blocks = nn.Sequential(*[_ShuffleBlock(32, 0.1 * (i + 1)) for i in range(3)])
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class UnfoldFoldNet(nn.Module):
    """Patch ops by F.unfold / F.fold, InstanceNorm2d (affine), RReLU (random slopes saved), Dropout2d,
    AlphaDropout and PReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * 16, 64)
        self.back = nn.Linear(64, 8 * 16)
        self.norm = nn.InstanceNorm2d(8, affine=True)
        self.act = nn.RReLU()
        self.drop2d = nn.Dropout2d(0.1)
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.prelu = nn.PReLU(16)
        self.alpha = nn.AlphaDropout(0.1)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(x, 4, stride=4).transpose(1, 2)  # (N, 64, 48)
        h = self.back(F.selu(self.proj(patches))).transpose(1, 2)
        img = F.fold(h, (32, 32), 4, stride=4)  # (N, 8, 32, 32)
        y = self.drop2d(self.act(self.norm(img)))
        y = self.prelu(self.conv(y)).mean((2, 3))
        return self.head(self.alpha(F.selu(y)))


class HookedMLP(nn.Module):
    """Tensor.register_hook on activations inside forward: a gradient-scaling hook and a gradient-clamping one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 512)
        self.b = nn.Linear(512, 512)
        self.c = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.a(x))
        if h.requires_grad:
            h.register_hook(lambda g: g * 0.5)
        h2 = F.gelu(self.b(h))
        if h2.requires_grad:
            h2.register_hook(lambda g: g.clamp(-1e-2, 1e-2))
        return self.c(h2)


class SDPABoolMaskDropout(nn.Module):
    """F.scaled_dot_product_attention with a boolean padding mask and dropout_p 0.1 (CPU math path)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 128, padding_idx=0)
        self.qkv = nn.Linear(128, 384)
        self.o = nn.Linear(128, 128)
        self.head = nn.Linear(128, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        n, seq, _ = x.shape
        q, k, v = self.qkv(x).view(n, seq, 3, 4, 32).permute(2, 0, 3, 1, 4)
        mask = (ids != 0)[:, None, None, :]
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
        return self.head(self.o(h.transpose(1, 2).reshape(n, seq, 128)).mean(1))


class EinsumBilinear(nn.Module):
    """Einsum chains (a low-rank bilinear interaction and a tensor contraction) plus nn.Bilinear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.u = nn.Parameter(torch.randn(64, 16, 8) * 0.05)
        self.w = nn.Parameter(torch.randn(8, 16, 64) * 0.05)
        self.bil = nn.Bilinear(64, 64, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)  # (N, L, 64)
        a = torch.einsum("nld,dhr->nlhr", x, self.u)
        s = torch.einsum("nlhr,nmhr->nhlm", a, a).softmax(-1)
        y = torch.einsum("nhlm,nmd,rhe->nle", s, x, self.w)
        pooled = y.mean(1)
        return self.head(torch.tanh(self.bil(pooled, x.mean(1))))


class ComplexLinear(nn.Module):
    """Complex-valued weights on an rfft of the sequence: complex matmul, abs and angle in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.w = nn.Parameter(torch.randn(64, 64, dtype=torch.cfloat) * 0.05)
        self.head = nn.Linear(128, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        f = torch.fft.rfft(self.emb(ids), dim=1)  # (N, 33, 64) complex
        z = f @ self.w
        feats = torch.cat([z.abs().mean(1), torch.angle(z).mean(1)], -1)
        return self.head(feats)


class ConvTranspose3dAE(nn.Module):
    """3D conv encoder and ConvTranspose3d decoder, GroupNorm, trilinear interpolation; the loss reconstructs."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(3, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                                 nn.Conv3d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(8, 32), nn.SiLU())
        self.dec = nn.Sequential(nn.ConvTranspose3d(32, 16, 4, stride=2, padding=1), nn.SiLU(),
                                 nn.ConvTranspose3d(16, 3, 4, stride=2, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dec(self.enc(x))
        return F.interpolate(y, size=x.shape[2:], mode="trilinear", align_corners=False)


def volume_batch(batch_size: int):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, 8, 32, 32, generator=g),)


def reconstruction_loss(model: nn.Module, batch) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[0])


class PixelUnshuffleNet(nn.Module):
    """pixel_unshuffle down, LocalResponseNorm, AdaptiveMaxPool2d, channels_last memory format on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(12, 32, 3, padding=1)
        self.lrn = nn.LocalResponseNorm(5)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1, bias=False)
        self.head = nn.Linear(64 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pixel_unshuffle(x.contiguous(memory_format=torch.channels_last), 2)
        y = F.hardswish(self.lrn(self.conv(x)))
        y = F.adaptive_max_pool2d(F.mish(self.conv2(y)), 2)
        return self.head(y.flatten(1))


class SparseAdjacencyGCN(nn.Module):
    """A GCN whose normalized adjacency is a sparse COO tensor built from the batch: torch.sparse.mm each layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 64), nn.Linear(64, 64)])
        self.out = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, edges: torch.Tensor, graph: torch.Tensor, graphs: int) -> torch.Tensor:
        n = x.shape[0]
        adj = torch.sparse_coo_tensor(edges, torch.ones(edges.shape[1]), (n, n)).coalesce()
        h = x
        for layer in self.layers:
            h = F.relu(torch.sparse.mm(adj, layer(h)) / 4.0)
        return self.out(torch.zeros(graphs, h.shape[1]).index_add(0, graph, h) / 32)


class QuantileMedianHead(nn.Module):
    """Robust pooling over the sequence: torch.quantile (sort inside), median and kthvalue, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.proj = nn.Linear(64, 64)
        self.head = nn.Linear(256, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.emb(ids))
        q = torch.quantile(h, torch.tensor([0.25, 0.75]), dim=1)  # (2, N, 64)
        return self.head(torch.cat([q[0], q[1], h.median(1).values, h.kthvalue(5, dim=1).values], -1))


class DirichletHead(nn.Module):
    """Evidential classification: a Dirichlet's log-likelihood (lgamma, digamma in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.mlp(x)) + 1.0


def dirichlet_loss(model: nn.Module, batch) -> torch.Tensor:
    alpha = model(batch[0])
    dist = torch.distributions.Dirichlet(alpha)
    target = F.one_hot(batch[1], 10).float() * 0.9 + 0.01
    return -dist.log_prob(target / target.sum(-1, keepdim=True)).mean() + torch.special.digamma(alpha).mean()


class UniqueTokens(nn.Module):
    """torch.unique(return_inverse) over the batch's ids: embeds each distinct id once, then gathers back."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        uniq, inverse = torch.unique(ids, return_inverse=True)
        table = self.mlp(self.emb(uniq))
        return self.head(table[inverse].mean(1))
