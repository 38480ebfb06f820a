"""Models whose loss is not a per-sample mean, for the loss-semantics tests of MemoryPlanner (CPU only).

`TokenLM` is a tiny float64 language model on dict batches {"input_ids", "labels", "class_weights"}:
every sample is padded to the same length with labels -100 at the end (its own number of real
tokens), and the loss is cross-entropy averaged over the real tokens (`ignore_index=-100`, as every
LM's loss), optionally weighted by a per-batch `class_weights` tensor that travels whole. With
`reduction="sum"` the loss is the sum over real tokens instead. Each run's final weights are compared
with the same module trained without MemoryPlanner: equal weights mean the split batch trained as the
whole batch.
"""
from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB = 11
LENGTH = 7
SAMPLES = 48


def real_tokens(batch) -> torch.Tensor:
    """The labels that are not padding."""
    return (batch["labels"] != -100).sum()


def weighted_tokens(batch) -> torch.Tensor:
    """What the class-weighted token-mean loss averages over: the class weights of the real tokens
    (cross_entropy's mean with `weight=` divides by their sum, not by the count)."""
    labels = batch["labels"]
    return batch["class_weights"][labels[labels != -100]].sum()


class PaddedTokens(Dataset):
    """Deterministic token sequences; sample i has 1 + (i * 5) % LENGTH real tokens, then padding."""

    def __init__(self, length: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (length, LENGTH), generator=g)
        self.labels = torch.randint(0, VOCAB, (length, LENGTH), generator=g)
        for i in range(length):
            self.labels[i, 1 + (i * 5) % LENGTH:] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def collate(samples):
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    batch["class_weights"] = torch.linspace(0.5, 1.5, VOCAB, dtype=torch.float64)  # per batch: travels whole
    return batch


class TokenLM(pl.LightningModule):
    """Embedding -> tanh MLP -> vocabulary; SGD; token-mean (or token-sum) cross-entropy over real tokens.
    `logged` keeps what each optimizer step's training_step calls logged, as Lightning saw it."""

    def __init__(self, batch_size: int = 8, reduction: str = "mean", lr: float = 0.1) -> None:
        super().__init__()
        self.loader_batch = batch_size
        self.reduction = reduction
        self.lr = lr
        torch.manual_seed(3)
        self.embed = nn.Embedding(VOCAB, 8, dtype=torch.float64)
        self.hidden = nn.Linear(8, 8, dtype=torch.float64)
        self.head = nn.Linear(8, VOCAB, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        logits = self.head(torch.tanh(self.hidden(self.embed(batch["input_ids"]))))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1),
                               weight=batch["class_weights"], ignore_index=-100, reduction=self.reduction)
        self.log("train_loss", loss)
        self.log("samples", float(len(batch["input_ids"])), reduce_fx="sum")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(PaddedTokens(), batch_size=self.loader_batch, shuffle=False, collate_fn=collate)


def weights_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
