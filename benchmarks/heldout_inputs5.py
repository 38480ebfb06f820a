"""Batches, configs and losses for the sweep5 held-out cases (benchmarks/heldout_cases5.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.realmodels_models import SEQ, VOCAB, _gen


def audio_cls_batch(batch_size: int, *, samples: int = 8000) -> dict:
    g = _gen()
    return {"input_values": torch.randn(batch_size, samples, generator=g),
            "labels": torch.randint(0, 4, (batch_size,), generator=g)}


def ast_batch(batch_size: int) -> dict:
    """(batch, max_length 64 frames, 32 mel bins) spectrogram patches."""
    g = _gen()
    return {"input_values": torch.randn(batch_size, 64, 32, generator=g),
            "labels": torch.randint(0, 4, (batch_size,), generator=g)}


def whisper_cls_batch(batch_size: int) -> dict:
    """16 mel bins x 2 * max_source_positions (64) frames."""
    g = _gen()
    return {"input_features": torch.randn(batch_size, 16, 128, generator=g),
            "labels": torch.randint(0, 4, (batch_size,), generator=g)}


def video_batch(batch_size: int) -> dict:
    """TimeSformer: (batch, frames 4, channels 3, 32, 32)."""
    g = _gen()
    return {"pixel_values": torch.randn(batch_size, 4, 3, 32, 32, generator=g),
            "labels": torch.randint(0, 10, (batch_size,), generator=g)}


def seg_batch(batch_size: int, *, size: int = 64) -> dict:
    g = _gen()
    return {"pixel_values": torch.randn(batch_size, 3, size, size, generator=g),
            "labels": torch.randint(0, 5, (batch_size, size, size), generator=g)}


def timesfm_batch(batch_size: int) -> dict:
    g = _gen()
    return {"past_values": list(torch.randn(batch_size, 64, generator=g)),
            "future_values": torch.randn(batch_size, 32, generator=g)}


def sr_batch(batch_size: int):
    """Low-res 16x16 inputs and the 32x32 targets of a x2 super-resolution model."""
    g = _gen()
    return torch.rand(batch_size, 3, 16, 16, generator=g), torch.rand(batch_size, 3, 32, 32, generator=g)


def sr_loss(model: nn.Module, batch) -> torch.Tensor:
    return F.l1_loss(model(pixel_values=batch[0]).reconstruction, batch[1])


def prophetnet_batch(batch_size: int) -> dict:
    g = _gen()
    source = torch.randint(3, VOCAB, (batch_size, SEQ), generator=g)
    return {"input_ids": source, "attention_mask": torch.ones_like(source),
            "labels": torch.randint(3, VOCAB, (batch_size, 32), generator=g)}


def padded_tokens(batch_size: int):
    """Token ids with trailing padding (id 0) of lengths SEQ - 8 * (i % 4), and 10-way labels."""
    g = _gen()
    ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    lengths = SEQ - 8 * (torch.arange(batch_size) % 4)
    ids = ids * (torch.arange(SEQ)[None, :] < lengths[:, None])
    return ids, torch.randint(0, 10, (batch_size,), generator=g)


def ctc_batch(batch_size: int):
    """(features (batch, 80 frames, 40), targets (batch, 20) padded, target lengths)."""
    g = _gen()
    feats = torch.randn(batch_size, 80, 40, generator=g)
    targets = torch.randint(1, 30, (batch_size, 20), generator=g)
    lengths = 20 - 3 * (torch.arange(batch_size) % 4)
    return feats, targets, lengths


def ctc_loss(model: nn.Module, batch) -> torch.Tensor:
    feats, targets, lengths = batch
    logp = model(feats).log_softmax(-1).transpose(0, 1)  # (T, N, C)
    in_len = torch.full((feats.shape[0],), logp.shape[0], dtype=torch.long)
    return F.ctc_loss(logp, targets, in_len, lengths, blank=0, zero_infinity=True)


def lm_tuple(batch_size: int):
    """(ids, next ids) for a plain-torch LM."""
    g = _gen()
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def adaptive_softmax_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(batch[0], batch[1])


def graph_batch(batch_size: int):
    """batch_size graphs of 32 nodes, 128 random edges each, node features 32, a label a graph."""
    g = _gen()
    nodes = 32 * batch_size
    feats = torch.randn(nodes, 32, generator=g)
    src = torch.randint(0, 32, (batch_size, 128), generator=g) + 32 * torch.arange(batch_size)[:, None]
    dst = torch.randint(0, 32, (batch_size, 128), generator=g) + 32 * torch.arange(batch_size)[:, None]
    graph = torch.arange(batch_size).repeat_interleave(32)
    return feats, torch.stack([src.flatten(), dst.flatten()]), graph, torch.randint(0, 10, (batch_size,), generator=g)


def graph_loss(model: nn.Module, batch) -> torch.Tensor:
    feats, edges, graph, labels = batch
    return F.cross_entropy(model(feats, edges, graph, labels.shape[0]), labels)


def ranking_batch(batch_size: int):
    """batch_size queries of 100 candidates with 32 features and graded relevance."""
    g = _gen()
    return torch.randn(batch_size, 100, 32, generator=g), torch.randint(0, 5, (batch_size, 100), generator=g).float()


def listmle_loss(model: nn.Module, batch) -> torch.Tensor:
    """ListMLE over the candidates sorted by relevance, plus a top-k hinge on the 10 best scores."""
    scores = model(batch[0])
    order = batch[1].argsort(dim=1, descending=True)
    s = scores.gather(1, order)
    rev_lse = torch.logcumsumexp(s.flip(1), dim=1).flip(1)
    top = scores.topk(10, dim=1).values
    return (rev_lse - s).sum(1).mean() + F.relu(1 - top[:, :1] + top[:, 1:]).mean()


def robust_loss(model: nn.Module, batch) -> torch.Tensor:
    """A torch.where-heavy loss: a hand-written Huber on logits vs one-hot, masked by the prediction's confidence."""
    logits = model(batch[0])
    target = F.one_hot(batch[1], logits.shape[-1]).float()
    diff = (logits - target).abs()
    huber = torch.where(diff < 1.0, 0.5 * diff ** 2, diff - 0.5)
    conf = logits.softmax(-1).max(-1, keepdim=True).values
    return torch.where(conf > 0.5, huber * 2.0, huber).mean() + F.cross_entropy(logits, batch[1], label_smoothing=0.1)


def sparse_batch(batch_size: int):
    """(flat ids, offsets, per-sample weights, labels): bags of 40 to 64 ids."""
    g = _gen()
    sizes = 64 - 8 * (torch.arange(batch_size) % 4)
    ids = torch.randint(0, 50000, (int(sizes.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
    return ids, offsets, torch.rand(ids.shape, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def sparse_loss(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0], batch[1], batch[2]), batch[3])


def seq2seq_tuple(batch_size: int):
    """(source ids with trailing padding 0, target ids): nn.Transformer's masks come from these."""
    g = _gen()
    src = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    lengths = SEQ - 8 * (torch.arange(batch_size) % 4)
    src = src * (torch.arange(SEQ)[None, :] < lengths[:, None])
    return src, torch.randint(1, VOCAB, (batch_size, 33), generator=g)


def seq2seq_loss(model: nn.Module, batch) -> torch.Tensor:
    src, tgt = batch
    logits = model(src, tgt[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1), label_smoothing=0.1)
