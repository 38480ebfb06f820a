"""Value-dependent shapes: exact where the batch decides them, a named assumption where activations do."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.estimator.api import estimate
from memplan.estimator.errors import EstimateError
from memplan.truth import measure_cpu_peak
from memplan.estimator.values import ValueResolver


def relative_error(estimated: int, truth: int) -> float:
    return abs(estimated - truth) / truth


# --- activations decide: MoE routing ---------------------------------------------------------------
class TinyMoE(nn.Module):
    """Top-k routing with an eager loop over experts, as transformers' eager experts path runs it."""

    def __init__(self, d: int = 32, experts: int = 4, k: int = 2, hidden: int = 256) -> None:
        super().__init__()
        self.k, self.experts = k, experts
        self.embed = nn.Linear(16, d)
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, d) * 0.02)
        self.w_out = nn.Parameter(torch.randn(experts, d, hidden) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        weights, chosen = self.router(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            h = F.gelu(x[token] @ self.w_in[e].T) @ self.w_out[e].T
            out = out.index_add(0, token, h * weights[token, slot, None])
        return out


def moe() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(TinyMoE(), nn.Linear(32, 8))


def moe_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1024, 16, generator=g), torch.randint(0, 8, (1024,), generator=g)


def ce_loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize("mode", ["balanced", "sample"])
def test_moe_routing_is_resolved_and_named_in_the_notes(mode):
    est = estimate(moe, moe_batch(), loss=ce_loss, device="cpu", data_dependent=mode)
    truth = measure_cpu_peak(moe, moe_batch, loss=ce_loss)
    assert relative_error(est.peak_allocated, truth) < 0.03, (est.peak_allocated, truth)
    note = next(n for n in est.notes if "aten.topk" in n)
    assert f"(in 0; data_dependent={mode!r})" in note  # the module path: the TinyMoE is "0" in the Sequential


def test_moe_routing_in_strict_mode_names_op_module_and_fix():
    with pytest.raises(EstimateError) as caught:
        estimate(moe, moe_batch(), loss=ce_loss, device="cpu", data_dependent="error")
    message = str(caught.value)
    assert "aten.nonzero.default in 0 has" in message  # torch.where(cond) in the TinyMoE, path "0"
    assert "data_dependent='balanced'" in message


def test_balanced_topk_gives_every_choice_the_same_number_of_tokens():
    mode = FakeTensorMode()
    resolver = ValueResolver("balanced", mode)
    with mode:
        logits = torch.empty(96, 8)
        values, index = resolver.call(torch.ops.aten.topk.default, (logits, 2, -1), {})
    assert not isinstance(index, type(values))  # the routing is real, the scores stay fake
    assert index.shape == (96, 2)
    assert torch.bincount(index.flatten(), minlength=8).tolist() == [96 * 2 // 8] * 8
    assert all(len(set(row.tolist())) == 2 for row in index)  # each token picks distinct experts


def test_unknown_mode_lists_the_modes():
    with pytest.raises(EstimateError, match=r"data_dependent must be one of 'balanced', 'sample', 'error'"):
        estimate(moe, moe_batch(), loss=ce_loss, device="cpu", data_dependent="even")


# --- the batch decides: exact in every mode ----------------------------------------------------------
class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(500, 64)
        self.head = nn.Linear(64, 2)

    def forward(self, ids):
        return self.head(self.embed(ids))


def tagger() -> nn.Module:
    torch.manual_seed(0)
    return Tagger()


def tagger_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (16, 128), generator=g)
    lengths = 128 - 7 * torch.arange(16)
    mask = torch.arange(128)[None, :] < lengths[:, None]
    return {"ids": ids, "mask": mask, "labels": torch.randint(0, 2, (16, 128), generator=g)}


def masked_loss(model, batch):
    """ELECTRA-style: only the positions the batch's mask keeps enter the loss."""
    logits = model(batch["ids"])
    mask = batch["mask"]
    return F.cross_entropy(logits[mask], batch["labels"][mask])


def test_loss_masked_by_the_batch_is_exact_without_assumption():
    est = estimate(tagger, tagger_batch(), loss=masked_loss, device="cpu", data_dependent="error")
    truth = measure_cpu_peak(tagger, tagger_batch, loss=masked_loss)
    assert relative_error(est.peak_allocated, truth) < 0.001, (est.peak_allocated, truth)
    assert not any("data_dependent" in n for n in est.notes)


class Speech(nn.Module):
    def __init__(self, vocab: int = 40) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 32, kernel_size=8, stride=4)
        self.head = nn.Linear(32, vocab)

    def forward(self, audio):
        return self.head(self.conv(audio[:, None]).transpose(1, 2)).log_softmax(-1)


def speech() -> nn.Module:
    torch.manual_seed(0)
    return Speech()


def speech_batch():
    g = torch.Generator().manual_seed(0)
    audio = torch.randn(4, 4000, generator=g)
    target_lengths = torch.tensor([60, 31, 45, 12])
    targets = torch.randint(1, 40, (4, 60), generator=g)
    return {"audio": audio, "targets": targets, "target_lengths": target_lengths}


def ctc(model, batch):
    log_probs = model(batch["audio"]).transpose(0, 1)  # (time, batch, vocab)
    input_lengths = torch.full((log_probs.shape[1],), log_probs.shape[0], dtype=torch.long)
    return F.ctc_loss(log_probs, batch["targets"], input_lengths, batch["target_lengths"])


def test_ctc_loss_sized_by_the_batchs_target_lengths_is_exact():
    est = estimate(speech, speech_batch(), loss=ctc, device="cpu", data_dependent="error")
    truth = measure_cpu_peak(speech, speech_batch, loss=ctc)
    assert relative_error(est.peak_allocated, truth) < 0.001, (est.peak_allocated, truth)


# --- activations decide: checks and a Hungarian matcher -------------------------------------------------
def matched_loss(model, batch):
    """A set-prediction loss: refuse non-finite outputs, match predictions to targets with scipy."""
    from scipy.optimize import linear_sum_assignment

    predictions = model(batch[0])
    if not torch.isfinite(predictions).all():
        raise FloatingPointError("non-finite predictions")
    targets = batch[1]
    with torch.no_grad():
        cost = torch.cdist(predictions, targets)
    rows, cols = linear_sum_assignment(cost.cpu().numpy())
    return F.mse_loss(predictions[torch.as_tensor(rows)], targets[torch.as_tensor(cols)])


def matcher() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 4))


def matcher_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 16, generator=g), torch.rand(12, 4, generator=g)


def test_finiteness_check_and_hungarian_matcher_are_resolved():
    pytest.importorskip("scipy")
    est = estimate(matcher, matcher_batch(), loss=matched_loss, device="cpu")
    truth = measure_cpu_peak(matcher, matcher_batch, loss=matched_loss)
    assert relative_error(est.peak_allocated, truth) < 0.01, (est.peak_allocated, truth)
    assert any(".item()" in n and "True" in n for n in est.notes)
    assert any("numpy" in n for n in est.notes)
    with pytest.raises(EstimateError, match=r"data_dependent="):
        estimate(matcher, matcher_batch(), loss=matched_loss, device="cpu", data_dependent="error")


@pytest.mark.parametrize("mode", ["balanced", "sample"])
def test_checkpointed_moe_recomputes_the_same_routing(mode):
    """Recomputation in backward must see the routing the forward saw, or checkpoint's shape check fails."""
    est = estimate(moe, moe_batch(), loss=ce_loss, device="cpu", data_dependent=mode, checkpointing={TinyMoE})
    truth = measure_cpu_peak(moe, moe_batch, loss=ce_loss, checkpointing={TinyMoE})
    assert est.checkpointing
    assert relative_error(est.peak_allocated, truth) < 0.03, (est.peak_allocated, truth)


# --- random draws that decide structure ------------------------------------------------------------
class LayerDropStack(nn.Module):
    """LayerDrop as transformers' speech and time-series encoders write it: each layer skipped when a
    scalar draw falls under `layerdrop`; `survival` gates the last block the other way round (stochastic
    depth: dropped when the draw is over the survival probability); `bernoulli` a third way."""

    def __init__(self, layerdrop: float, survival: float = 0.8, layers: int = 6, width: int = 256) -> None:
        super().__init__()
        self.layerdrop, self.survival = layerdrop, survival
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers))
        self.gated = nn.Linear(width, width)
        self.coin = nn.Linear(width, width)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            x = layer(x)
        if not (self.training and torch.rand(1).item() > self.survival):
            x = self.gated(x)
        if not (self.training and torch.bernoulli(torch.tensor(self.layerdrop))):
            x = self.coin(x)
        return self.head(x)


def layerdrop_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(512, 256, generator=g), torch.randint(0, 10, (512,), generator=g)


def test_layerdrop_estimates_the_worst_case_whatever_the_seed():
    """`torch.rand([]) < layerdrop` runs for real in the trace: it used to drop layers by the caller's
    RNG state. A draw of one value is decided (its median), so no layer is dropped: every seed gives the
    same estimate, equal to a real step without LayerDrop, and the notes say so."""
    def build(layerdrop, survival):
        def make():
            torch.manual_seed(0)
            return LayerDropStack(layerdrop, survival)
        return make

    estimates = set()
    for seed in range(5):
        torch.manual_seed(seed)
        est = estimate(build(0.45, 0.8), layerdrop_batch(), loss=ce_loss, device="cpu", optimizer="adamw")
        estimates.add(est.peak_allocated)
        assert any("random draw of one value" in n and "no layer is dropped" in n for n in est.notes), est.notes
    assert len(estimates) == 1, estimates
    truth = measure_cpu_peak(build(0.0, 1.0), layerdrop_batch, loss=ce_loss, optimizer="adamw")
    assert relative_error(estimates.pop(), truth) < 1e-4


@pytest.mark.parametrize("call, expected", [
    (lambda: torch.rand([]), 0.5),
    (lambda: torch.rand(1, generator=torch.Generator().manual_seed(3)), 0.5),
    (lambda: torch.empty(1).uniform_(2.0, 4.0), 3.0),
    (lambda: torch.randn(1) * 1.0, 0.0),
    (lambda: torch.empty(1).normal_(5.0, 2.0), 5.0),
    (lambda: torch.bernoulli(torch.tensor(0.2)), 0.0),
    (lambda: torch.empty([]).bernoulli_(0.7), 1.0),
    (lambda: torch.randint(3, 8, (1,)).float(), 5.0),
    (lambda: torch.randint(10, ()).float(), 4.0),
])
def test_a_random_draw_of_one_value_takes_its_median(call, expected):
    """Each kind of draw, decided in the trace; the caller's RNG state is left as it was."""
    from memplan.estimator.allocator import ExactAllocatorModel
    from memplan.estimator.tracker import StorageTracker

    fake_mode = FakeTensorMode()
    values = ValueResolver("balanced", fake_mode)
    state = torch.get_rng_state()
    with fake_mode, StorageTracker(ExactAllocatorModel(), fake_mode, cpu_kernels=True, values=values):
        drawn = call()
    assert drawn.item() == pytest.approx(expected)
    assert torch.equal(torch.get_rng_state(), state)


def test_larger_random_draws_come_from_a_fixed_seed():
    """A random permutation or mask made real in the trace is the same whatever the caller's RNG state."""
    from memplan.estimator.allocator import ExactAllocatorModel
    from memplan.estimator.tracker import StorageTracker

    drawn = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        fake_mode = FakeTensorMode()
        values = ValueResolver("balanced", fake_mode)
        with fake_mode, StorageTracker(ExactAllocatorModel(), fake_mode, cpu_kernels=True, values=values):
            drawn.append((torch.randperm(16), torch.rand(8) < 0.5))
    assert torch.equal(drawn[0][0], drawn[1][0]) and torch.equal(drawn[0][1], drawn[1][1])
