"""torch.nn's native attention fast paths in a training step: a frozen nn.MultiheadAttention or nn.TransformerEncoder
(eval mode, run under no_grad: a teacher, a frozen text encoder) runs `_native_multi_head_attention` /
`_transformer_encoder_layer_fwd` for real. The trace used to stay on the composite path, kept off by memplan's own
torch-function mode and its forward hooks (a 2-layer encoder teacher +12 %, an attention teacher -7.7 %); on a CPU
target it now takes the same path and the kernel probe measures the fast kernels' buffers. Against a real Trainer.fit
(memplan.truth)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak


class FrozenTeacher(nn.Module):
    """A trainable student matched (MSE) to a frozen teacher run in eval mode under no_grad."""

    def __init__(self, teacher: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = teacher
        self.embed = nn.Embedding(500, 64)
        if teacher == "attention":
            self.teacher = nn.MultiheadAttention(64, 4, batch_first=True)
        else:
            layer = nn.TransformerEncoderLayer(64, 4, 256, batch_first=True, dropout=0.0)
            self.teacher = nn.TransformerEncoder(layer, 2, enable_nested_tensor=teacher == "nested encoder")
        self.teacher.requires_grad_(False)
        self.student = nn.Linear(64, 64)
        self.head = nn.Linear(64, 5)

    def forward(self, ids, padding):
        x = self.embed(ids)
        with torch.no_grad():
            self.teacher.eval()
            if self.kind == "attention":
                target = self.teacher(x, x, x, need_weights=False)[0]
            else:
                target = self.teacher(x, src_key_padding_mask=padding if self.kind == "nested encoder" else None)
        s = self.student(x)
        return self.head(s), F.mse_loss(s, target)


def _batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([64, 60, 50, 40, 64, 30, 20, 64])
    padding = torch.arange(64)[None, :] >= lengths[:, None]
    return torch.randint(0, 500, (8, 64), generator=g), padding, torch.randint(0, 5, (8, 64), generator=g)


def _loss(model, batch):
    logits, distill = model(batch[0], batch[1])
    return F.cross_entropy(logits.flatten(0, 1), batch[2].flatten()) + distill


@pytest.mark.parametrize("teacher", ["attention", "encoder"])
def test_a_frozen_teacher_on_the_native_fast_path_matches_a_real_fit(teacher):
    truth = measure_cpu_peak(lambda: FrozenTeacher(teacher), _batch, loss=_loss)
    est = estimate(lambda: FrozenTeacher(teacher), _batch(), loss=_loss, device="cpu")
    assert abs(est.peak_allocated - truth) / truth < 0.0005, (est.peak_allocated, truth)
    assert not any("nested tensor" in n for n in est.notes)


def test_a_nested_tensor_conversion_is_traced_padded_and_named():
    """With a padding mask the real encoder converts to a nested tensor, which fake tensors cannot hold: the estimate
    still runs, on the padded batch, and its notes say so; the has_torch_function check is torch's own again after."""
    original = torch.overrides.has_torch_function
    est = estimate(lambda: FrozenTeacher("nested encoder"), _batch(), loss=_loss, device="cpu")
    assert any("nested tensor" in n and "approximate" in n for n in est.notes)
    assert torch.overrides.has_torch_function is original


def test_an_encoder_in_eval_mode_that_is_trained_gets_no_nested_note():
    """Eval mode (dropout off) with its weights trained: the real encoder keeps the padded batch, as the trace does."""
    def trained():
        model = FrozenTeacher("nested encoder")
        model.teacher.requires_grad_(True)
        model.forward = lambda ids, padding: (
            model.head(model.teacher.eval()(model.embed(ids), src_key_padding_mask=padding)), torch.zeros(()))
        return model

    est = estimate(trained, _batch(), loss=_loss, device="cpu")
    assert not any("nested tensor" in n for n in est.notes)


def test_a_cuda_target_keeps_the_composite_path():
    """No CUDA rule knows the fast kernels' buffers: a GPU target traces what it did before, and estimates."""
    original = torch.overrides.has_torch_function
    est = estimate(lambda: FrozenTeacher("encoder"), _batch(), loss=_loss, device="H100-80GB")
    assert est.peak_allocated > 0
    assert torch.overrides.has_torch_function is original
