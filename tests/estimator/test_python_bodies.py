"""torch.nn.functional's Python functions run their bodies under the trace's own torch-function mode
(memplan.compat.torch.python_bodies_beside). A call handed whole to a mode runs with that mode popped, so the
`linear` inside F.multi_head_attention_forward never reached the rule that follows ATen's in-place bias add
(estimator/cuda/composite.py): a batch-first nn.MultiheadAttention under autocast counted its in-projection's output
twice (+4.7 % self-attention, +9.7 % cross-attention over a long memory). Against a real Trainer.fit (memplan.truth)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak


class Attention(nn.Module):
    """Batch-first attention whose peak is its in-projection: self-attention (one packed projection) or queries
    from the first 8 positions over the whole sequence (separate query and key/value projections)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.embed = nn.Embedding(500, 64)
        self.attention = nn.MultiheadAttention(64, 4, batch_first=True)
        self.head = nn.Linear(64, 5)

    def forward(self, ids):
        x = self.embed(ids)
        query = x if self.kind == "self" else x[:, :8]
        return self.head(self.attention(query, x, x, need_weights=False)[0])


def _batch(length: int, rows: int = 8):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 500, (rows, length), generator=g), torch.randint(0, 5, (rows, length), generator=g)


def _loss(model, batch):
    out = model(batch[0])
    return F.cross_entropy(out.flatten(0, 1), batch[1][:, :out.shape[1]].flatten())


@pytest.mark.parametrize("kind, length", [("self", 128), ("cross", 256)])
def test_batch_first_attention_under_autocast_matches_a_real_fit(kind, length):
    truth = measure_cpu_peak(lambda: Attention(kind), lambda: _batch(length), loss=_loss, precision="bf16-mixed")
    est = estimate(lambda: Attention(kind), _batch(length), loss=_loss, device="cpu", precision="bf16-mixed")
    assert abs(est.peak_allocated - truth) / truth < 0.0005, (est.peak_allocated, truth)


class MixerBlock(nn.Module):
    """MLP-Mixer's token mixing: a Linear over the sequence of a transposed activation (a non-contiguous input)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.tokens = nn.Linear(128, 128)
        self.channels = nn.Linear(64, 64)

    def forward(self, x):
        mixed = self.tokens(self.norm(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(F.gelu(mixed))


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(500, 64)
        self.blocks = nn.ModuleList([MixerBlock() for _ in range(3)])
        self.head = nn.Linear(64, 5)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_checkpointed_blocks_recomputed_in_the_backward_follow_the_real_bias_add():
    batch = lambda: _batch(128, rows=16)  # noqa: E731
    truth = measure_cpu_peak(Mixer, batch, loss=_loss, precision="bf16-mixed", checkpointing=[MixerBlock])
    est = estimate(Mixer, batch(), loss=_loss, device="cpu", precision="bf16-mixed", checkpointing=[MixerBlock])
    assert abs(est.peak_allocated - truth) / truth < 0.0005, (est.peak_allocated, truth)


def test_torchs_checks_are_its_own_again_after_an_estimate():
    import torch._tensor
    import torch.autograd
    import torch.functional

    modules = (F, torch.functional, torch._tensor, torch.autograd)
    checks = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
    before = {(m.__name__, name): getattr(m, name) for m in modules for name in checks if hasattr(m, name)}
    estimate(lambda: Attention("self"), _batch(16), loss=_loss, device="cpu", precision="bf16-mixed")
    assert {(m.__name__, name): getattr(m, name) for m in modules for name in checks if hasattr(m, name)} == before
