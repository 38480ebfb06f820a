"""CPU kernels with scratch of their own that the kernel probe measures (kernels/probe.py): nn.Bilinear's
_trilinear (products up to 4 x its weight, forward and backward), kthvalue (a copy of its input) and
masked_scatter's backward (the selection and zeros it concatenates, -20.8 % without): an estimate of a model whose
peak is inside one of them equals a real CPU step."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak


class BilinearHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bilinear, self.head = nn.Bilinear(32, 32, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.bilinear(x, x * 2))


class KthValuePool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 512)

    def forward(self, x):
        return torch.kthvalue(self.up(x), 100, dim=-1).values


class MaskedScatter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 512)

    def forward(self, x):
        h = self.up(x)
        return torch.zeros_like(h).masked_scatter(h > 0, h.repeat(1, 4))  # a source 4 x the mask


def _rows(n: int, width: int):
    def make():
        return torch.randn(n, width, generator=torch.Generator().manual_seed(0))
    return make


def _loss(model, x):
    return model(x).square().mean()


@pytest.mark.parametrize("build, make_batch", [(BilinearHead, _rows(8192, 32)), (KthValuePool, _rows(2048, 64)),
                                               (MaskedScatter, _rows(2048, 64))],
                         ids=["bilinear", "kthvalue", "masked-scatter"])
def test_a_peak_inside_a_probed_kernel_is_the_real_steps(build, make_batch):
    est = estimate(build, make_batch(), loss=_loss, optimizer="adamw", device="cpu")
    truth = measure_cpu_peak(build, make_batch, loss=_loss, optimizer="adamw")
    assert abs(est.peak_allocated / truth - 1) < 0.001, (est.peak_allocated, truth)


class MultiLabelHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 4096)

    def forward(self, x):
        return self.up(x)


def _labels():
    g = torch.Generator().manual_seed(0)
    return torch.randn(512, 32, generator=g), torch.rand(512, 4096, generator=g)


def _bce(model, batch):
    x, target = batch
    return nn.functional.binary_cross_entropy_with_logits(model(x), target)


def test_bce_with_logits_holds_its_log_sigmoid_and_elementwise_loss():
    """A multi-label head whose peak is the loss's forward: -1.6 % before the probe measured the composite."""
    est = estimate(MultiLabelHead, _labels(), loss=_bce, optimizer="sgd", device="cpu")
    truth = measure_cpu_peak(MultiLabelHead, _labels, loss=_bce, optimizer="sgd")
    assert est.peak_phase == "forward"
    assert abs(est.peak_allocated / truth - 1) < 0.001, (est.peak_allocated, truth)


class ImageTokens(nn.Module):
    """A multimodal decoder's input: image features scattered into the token embeddings where the batch's ids hold
    the image token (LLaVA's `inputs_embeds.masked_scatter(image_mask, image_features)`)."""

    IMAGE_TOKEN = 3

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.project = nn.Embedding(64, 256), nn.Linear(32, 256)

    def forward(self, batch):
        ids, patches = batch
        mask = (ids == self.IMAGE_TOKEN).unsqueeze(-1).expand(*ids.shape, 256)  # from the batch: real values
        return self.embed(ids).masked_scatter(mask, self.project(patches))


def _image_tokens(share: float):
    def make():
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(4, 64, (8, 512), generator=g)
        ids[torch.rand(8, 512, generator=g) < share] = ImageTokens.IMAGE_TOKEN
        return ids, torch.randn(int((ids == ImageTokens.IMAGE_TOKEN).sum()), 32, generator=g)
    return make


def _embeds_loss(model, batch):
    return model(batch).square().mean()


@pytest.mark.parametrize("share", [0.05, 0.5, 1.0])
def test_masked_scatter_backward_is_probed_under_the_batchs_own_mask(share):
    # Its scratch follows the mask's count of True (two int64 prefix sums of the mask's shape once one element is
    # selected, and the selection): probed under zeros, the step read 17 to 28 % under (5 % to 100 % image tokens).
    make = _image_tokens(share)
    est = estimate(ImageTokens, make(), loss=_embeds_loss, optimizer="sgd", device="cpu")
    truth = measure_cpu_peak(ImageTokens, make, loss=_embeds_loss, optimizer="sgd")
    assert est.peak_phase == "backward"
    assert abs(est.peak_allocated / truth - 1) < 0.001, (est.peak_allocated, truth)
    assert not any("no values of" in note for note in est.notes)  # the batch's mask: nothing stood in


def test_a_mask_from_an_activation_is_stood_in_half_true_and_said_so():
    est = estimate(MaskedScatter, _rows(2048, 64)(), loss=_loss, optimizer="adamw", device="cpu")
    assert any("no values of" in note and "half True" in note for note in est.notes), est.notes


def test_a_stood_in_mask_is_laid_out_as_the_traced_one_and_the_same_on_every_call():
    """The kernel's path depends on the mask's layout (an expanded or transposed mask is not contiguous): the stand-in
    keeps it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.estimator.kernels.probe import _stand_in_mask

    with FakeTensorMode():
        expanded = torch.empty(8, 512, 1, dtype=torch.bool).expand(8, 512, 256)
        transposed = torch.empty(256, 512, dtype=torch.bool).t()
    for fake in (expanded, transposed):
        stand_in = _stand_in_mask(fake)
        assert stand_in.shape == fake.shape and stand_in.stride() == fake.stride()
        assert 0.4 < stand_in.float().mean().item() < 0.6
        assert torch.equal(stand_in, _stand_in_mask(fake))


class BufferMask(nn.Module):
    """A fixed mask registered as a buffer (its value carried beside its fake: memplan.estimator.known_values)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 512)
        self.register_buffer("keep", (torch.arange(2048) % 3 == 0)[:, None].clone(), persistent=False)  # rows

    def forward(self, x):
        h = self.up(x)
        return torch.zeros_like(h).masked_scatter(self.keep, h)


def test_a_buffers_mask_is_probed_with_its_value_and_no_note():
    est = estimate(BufferMask, _rows(2048, 64)(), loss=_loss, optimizer="adamw", device="cpu")
    truth = measure_cpu_peak(BufferMask, _rows(2048, 64), loss=_loss, optimizer="adamw")
    assert not any("no values of" in note for note in est.notes), est.notes
    assert abs(est.peak_allocated / truth - 1) < 0.001, (est.peak_allocated, truth)


@pytest.mark.parametrize("weight, precision", [(False, "32-true"), (True, "32-true"), (False, "bf16-mixed")],
                         ids=["pos-weight", "pos-weight-and-weight", "pos-weight-bf16-mixed"])
def test_bce_with_logits_backward_with_pos_weight_runs_its_in_place_chain(weight, precision):
    """FunctionsManual's backward holds `t`, `t + 1` and the sigmoid (three logits' sizes) on real tensors; under the
    trace it took its out-of-place chain, whose temporaries all live to the end of the statement: +59.1 % on this
    head, whose peak is that backward, in each of these settings (memplan.estimator.cuda.composite now runs the real
    chain; under autocast the loss runs in float32 on cast copies)."""
    def bce(model, batch):
        x, target = batch
        return nn.functional.binary_cross_entropy_with_logits(
            model(x), target, weight=torch.full((4096,), 0.5) if weight else None, pos_weight=torch.full((4096,), 3.0))

    est = estimate(MultiLabelHead, _labels(), loss=bce, optimizer="sgd", device="cpu", precision=precision)
    truth = measure_cpu_peak(MultiLabelHead, _labels, loss=bce, optimizer="sgd", precision=precision)
    assert est.peak_phase == "backward"
    assert abs(est.peak_allocated / truth - 1) < 0.001, (est.peak_allocated, truth)


class LearnedFakeQuant(nn.Module):
    """Quantization-aware training with a learned scale (LSQ): its CPU backward holds per-element scale and
    zero-point gradients before summing them (-14.3 % before the probe measured it)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(512, 512))
        self.scale = nn.Parameter(torch.tensor([0.05]))
        self.register_buffer("zero_point", torch.zeros(1))

    def forward(self, x):
        return x @ torch._fake_quantize_learnable_per_tensor_affine(self.w, self.scale, self.zero_point, -128, 127, 1.0)


def test_learned_fake_quantizations_backward_scratch_is_probed():
    est = estimate(LearnedFakeQuant, _rows(64, 512)(), loss=_loss, optimizer="adamw", device="cpu")
    truth = measure_cpu_peak(LearnedFakeQuant, _rows(64, 512), loss=_loss, optimizer="adamw")
    assert est.peak_phase == "backward"
    assert abs(est.peak_allocated / truth - 1) < 0.001, (est.peak_allocated, truth)
