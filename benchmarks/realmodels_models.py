"""benchmarks.realmodels' models and batches: transformers builders from config classes, plain-torch models, and
the fixed-seed batches they train on (benchmarks.realmodels_cases puts them together into cases)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.zoo import SEED

VOCAB = 1000
SEQ = 64

def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


# --------------------------------------------------------------------------------------------------
# builders and batches


def _hf(model_class: str, config_class: str, attn: str | None = "sdpa", **config) -> nn.Module:
    import transformers

    if attn is not None:
        config["attn_implementation"] = attn
    cfg = getattr(transformers, config_class)(**config)
    return getattr(transformers, model_class)(cfg).train()


def hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def lm_batch(batch_size: int, *, seq_len: int = SEQ, vocab: int = VOCAB) -> dict:
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=_gen())
    return {"input_ids": ids, "labels": ids}


def cls_batch(batch_size: int, *, seq_len: int = SEQ, vocab: int = VOCAB, labels: int = 4) -> dict:
    """Padded: row i keeps seq_len - 4 * (i % 4) tokens, so the attention mask is not all ones."""
    g = _gen()
    ids = torch.randint(1, vocab, (batch_size, seq_len), generator=g)
    lengths = seq_len - 4 * (torch.arange(batch_size) % 4)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask,
            "labels": torch.randint(0, labels, (batch_size,), generator=g)}


def electra_batch(batch_size: int) -> dict:
    """Replaced-token detection: the loss keeps only the positions the batch's attention mask keeps."""
    batch = cls_batch(batch_size)
    batch["labels"] = torch.randint(0, 2, batch["input_ids"].shape, generator=_gen())
    return batch


def seq2seq_batch(batch_size: int, *, vocab: int = VOCAB, source_len: int = SEQ, target_len: int = 32) -> dict:
    g = _gen()
    source = torch.randint(3, vocab, (batch_size, source_len), generator=g)
    return {"input_ids": source, "attention_mask": torch.ones_like(source),
            "labels": torch.randint(3, vocab, (batch_size, target_len), generator=g)}


def speech_ctc_batch(batch_size: int, *, samples: int = 8000, vocab: int = 32) -> dict:
    """Labels padded with -100: the CTC target lengths come from the batch."""
    g = _gen()
    labels = torch.randint(1, vocab, (batch_size, 24), generator=g)
    for i in range(batch_size):
        labels[i, 24 - 4 * (i % 4):] = -100
    return {"input_values": torch.randn(batch_size, samples, generator=g), "labels": labels}


def whisper_batch(batch_size: int) -> dict:
    g = _gen()
    return {"input_features": torch.randn(batch_size, 16, 200, generator=g),
            "labels": torch.randint(3, VOCAB, (batch_size, 16), generator=g)}


def image_batch(batch_size: int, *, size: int = 32, labels: int = 10) -> dict:
    g = _gen()
    return {"pixel_values": torch.randn(batch_size, 3, size, size, generator=g),
            "labels": torch.randint(0, labels, (batch_size,), generator=g)}


def clip_batch(batch_size: int) -> dict:
    g = _gen()
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, 16), generator=g),
            "pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g), "return_loss": True}


def detr_batch(batch_size: int) -> dict:
    g = _gen()
    labels = [{"class_labels": torch.randint(0, 5, (n,), generator=g),
               "boxes": torch.rand(n, 4, generator=g) * 0.4 + 0.3} for n in (3 + i % 3 for i in range(batch_size))]
    return {"pixel_values": torch.randn(batch_size, 3, 64, 64, generator=g), "labels": labels}


def plain_batch(batch_size: int, *, features: int = 64, classes: int = 10):
    g = _gen()
    return torch.randn(batch_size, features, generator=g), torch.randint(0, classes, (batch_size,), generator=g)


def plain_loss(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def token_batch(batch_size: int):
    g = _gen()
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g), torch.randint(0, 10, (batch_size,), generator=g)


# --------------------------------------------------------------------------------------------------
# plain torch models


class RNNClassifier(nn.Module):
    def __init__(self, cell: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell](64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return self.head(out[:, -1])


class TransformerClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, 10)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(1))


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channel_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class MlpMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 128, 4, stride=4)
        self.blocks = nn.Sequential(*(MixerBlock(64, 128) for _ in range(3)))
        self.head = nn.Linear(128, 10)

    def forward(self, pixel_values, labels):
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)
        return F.cross_entropy(self.head(self.blocks(x).mean(1)), labels)


class TopKMoE(nn.Module):
    """A plain-torch mixture of experts (Switch/GShard style top-2 router, eager loop over experts)."""

    def __init__(self, dim: int = 128, experts: int = 8, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.embed = nn.Embedding(VOCAB, dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(experts))
        self.head = nn.Linear(dim, 10)

    def forward(self, ids):
        x = self.embed(ids).flatten(0, 1)
        weights, chosen = self.router(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return self.head(out.view(*ids.shape, -1).mean(1))


def plain_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def plain_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10))


def image_tuple(batch_size: int):
    b = image_batch(batch_size)
    return b["pixel_values"], b["labels"]


def mixer_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch)

