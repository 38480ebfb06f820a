"""memplan.estimate(device="cpu") against real CPU execution of the same step (torch.profiler truth): optimizers,
the breakdown, a LightningModule, the two loop orders, models built by a callable, checkpointing.

Kernel scratch: test_estimate_cpu_kernels.py; model structures: test_estimate_cpu_models.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from cpu_steps import ce_loss, mlp, mlp_batch, relative_error

from memplan.demos import GPTLM, MLP
from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak
from memplan.units import MiB


def tiny_gpt() -> GPTLM:
    torch.manual_seed(0)
    return GPTLM(vocab_size=512, context=64, d_model=64, n_layers=3, n_heads=4, dropout=0.1)


def gpt_batch():
    return GPTLM.example_batch(tiny_gpt(), 4)


@pytest.mark.parametrize("optimizer", ["sgd", "sgd-momentum", "adam", "adamw", "rmsprop", "adagrad"])
def test_mlp_peak_matches_real_cpu_step(optimizer):
    est = estimate(mlp, mlp_batch(), loss=ce_loss, optimizer=optimizer, device="cpu")
    truth = measure_cpu_peak(mlp, mlp_batch, loss=ce_loss, optimizer=optimizer)
    assert relative_error(est.peak_allocated, truth) < 0.01, (est.peak_allocated, truth)


def test_breakdown_adds_up_to_the_peak_and_counts_weights_exactly():
    est = estimate(mlp, mlp_batch(), loss=ce_loss, optimizer="adamw", device="cpu")
    parts = (est.parameters + est.gradients + est.optimizer_state + est.activations
             + est.temporaries + est.batch + est.workspaces)
    assert parts == est.peak_allocated
    n_params = sum(p.numel() for p in mlp().parameters())
    assert est.num_parameters == n_params
    assert est.parameters == 4 * n_params
    # AdamW keeps exp_avg and exp_avg_sq (fp32 each) plus a 4-byte step counter per parameter tensor
    assert est.optimizer_state == 8 * n_params + 4 * 6
    assert est.batch == 256 * 1000 * 4 + 256 * 8
    assert est.peak_reserved == est.device_total == est.peak_allocated  # CPU: no allocator cache, no context


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_lightning_module_matches_real_cpu_step(precision, checkpointing):
    # A bf16 matmul allocates a scratch inside the kernel, where no fake tensor sees it, whose size
    # depends on the CPU (35-210 KiB on AMD EPYC, 128 KiB on an AMX Xeon: 4 % of this 3 MB model): the
    # kernel probe runs each bf16 matmul shape once for real to count it.
    est = estimate(tiny_gpt, gpt_batch(), precision=precision, checkpointing=checkpointing, device="cpu")
    truth = measure_cpu_peak(tiny_gpt, gpt_batch, precision=precision, checkpointing=checkpointing)
    assert relative_error(est.peak_allocated, truth) < 0.01, (est.peak_allocated, truth)


def test_checkpointing_cuts_saved_activations():
    plain = estimate(tiny_gpt, gpt_batch(), device="cpu")
    ckpt = estimate(tiny_gpt, gpt_batch(), checkpointing=True, device="cpu")
    assert ckpt.forward_activations < plain.forward_activations / 2
    assert "checkpointed 3 blocks" in ckpt.notes


class _ForwardPeak(nn.Module):
    """A step whose peak is in the forward, by construction: a no-grad 16x fan-out of the batch (16 MiB,
    freed before the forward ends, saved by nothing) dwarfs everything the backward holds (a 4 MiB weight
    gradient beside the 4 MiB weight, 1 MiB activations)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1024, 1024)

    def forward(self, x):
        with torch.no_grad():
            scale = x.repeat(1, 16).abs().amax()
        return (self.fc(x) * scale).mean()


def test_lightning_zeroes_grads_after_forward_so_forward_peak_holds_last_grads():
    make_batch = lambda: (torch.randn(256, 1024),)  # noqa: E731  (fresh tensors: allocated inside the truth)
    loss = lambda m, b: m(b[0])  # noqa: E731
    n_params = sum(p.numel() for p in _ForwardPeak().parameters())
    lightning = estimate(_ForwardPeak, make_batch(), loss=loss, optimizer="sgd", device="cpu")
    plain = estimate(_ForwardPeak, make_batch(), loss=loss, optimizer="sgd", device="cpu", loop="torch")
    assert lightning.peak_phase == plain.peak_phase == "forward"  # the property below holds only there
    # Lightning's closure runs zero_grad between forward and backward: the last step's gradients are
    # alive at the forward's peak; a plain loop zeroed them after its last step.
    assert lightning.gradients == 4 * n_params and plain.gradients == 0
    # (less the 4-byte loss of the last step, which a plain loop's `loss` variable holds until the forward returns)
    assert lightning.peak_allocated - plain.peak_allocated == 4 * n_params - 4
    # ... and both orders are what the real loops do: a Trainer.fit, and a plain loop.
    fit = measure_cpu_peak(_ForwardPeak, make_batch, loss=loss, optimizer="sgd", loop="lightning")
    loop = measure_cpu_peak(_ForwardPeak, make_batch, loss=loss, optimizer="sgd", loop="torch")
    assert relative_error(lightning.peak_allocated, fit) < 0.001, (lightning.peak_allocated, fit)
    assert relative_error(plain.peak_allocated, loop) < 0.001, (plain.peak_allocated, loop)


@pytest.mark.parametrize("loop", ["torch-zero-after-forward", "torch-keep-grads"])
def test_plain_loops_that_hold_gradients_through_the_forward(loop):
    """A plain loop that zeroes between forward and backward (as many Fabric scripts do), or that keeps its
    gradients allocated (zero_grad(set_to_none=False)), has the last step's gradients alive at a forward peak,
    as Lightning's order does; loop="torch" has none. Each estimate is what that real plain loop peaks at."""
    make_batch = lambda: (torch.randn(256, 1024),)  # noqa: E731
    loss = lambda m, b: m(b[0])  # noqa: E731
    n_params = sum(p.numel() for p in _ForwardPeak().parameters())
    plain = estimate(_ForwardPeak, make_batch(), loss=loss, optimizer="sgd", device="cpu", loop="torch")
    held = estimate(_ForwardPeak, make_batch(), loss=loss, optimizer="sgd", device="cpu", loop=loop)
    assert plain.peak_phase == held.peak_phase == "forward"
    assert plain.gradients == 0 and held.gradients == 4 * n_params
    assert held.peak_allocated - plain.peak_allocated == 4 * n_params
    said = "between forward and backward" if loop == "torch-zero-after-forward" else "set_to_none=False"
    assert any(said in n for n in held.notes), held.notes
    truth = measure_cpu_peak(_ForwardPeak, make_batch, loss=loss, optimizer="sgd", loop=loop)
    assert relative_error(held.peak_allocated, truth) < 0.001, (held.peak_allocated, truth)


def test_configure_optimizers_is_the_default_optimizer():
    class SGDModel(MLP):
        def configure_optimizers(self):
            return {"optimizer": torch.optim.SGD(self.parameters(), lr=0.1)}

    model = SGDModel()
    batch = model.example_batch(64)
    sgd = estimate(SGDModel, batch, device="cpu")
    adamw = estimate(MLP, batch, device="cpu")
    assert sgd.optimizer_state == 0
    assert adamw.optimizer_state > 2 * 4 * adamw.num_parameters - 1


def test_no_weight_is_allocated_for_a_model_built_by_a_callable():
    # 8 GiB of fp32 weights: the estimate must count them without allocating them.
    build = lambda: nn.Sequential(nn.Linear(32768, 65536, bias=False))  # noqa: E731
    batch = (torch.randn(2, 32768),)
    est = estimate(build, batch, loss=lambda m, b: m(b[0]).sum(), optimizer="sgd", device="cpu")
    assert est.parameters == 32768 * 65536 * 4


def test_real_model_is_left_untouched():
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    estimate(model, mlp_batch(), loss=ce_loss, device="cpu")
    for k, v in model.state_dict().items():
        assert type(v) is torch.Tensor and torch.equal(v, before[k])
    assert all(p.grad is None for p in model.parameters())


def test_meta_device_model_is_estimated():
    with torch.device("meta"):
        model = mlp()
    est = estimate(model, mlp_batch(), loss=ce_loss, device="cpu")
    truth = measure_cpu_peak(mlp, mlp_batch, loss=ce_loss)
    assert relative_error(est.peak_allocated, truth) < 0.01


def test_ddp_adds_one_gradient_copy_in_buckets():
    single = estimate(mlp, mlp_batch(), loss=ce_loss, device="cpu")
    ddp = estimate(mlp, mlp_batch(), loss=ce_loss, device="cpu", strategy="ddp", world_size=4)
    assert ddp.gradients - single.gradients == pytest.approx(4 * single.num_parameters, abs=0)
    assert ddp.peak_allocated - single.peak_allocated == 4 * single.num_parameters
    assert ddp.world_size == 4


def test_estimate_prints_a_breakdown_table_with_the_rules_of_thumb():
    text = str(estimate(mlp, mlp_batch(), loss=ce_loss, device="cpu"))
    for word in ("parameters", "optimizer state", "activations", "peak allocated", "rule of thumb", "4 x model size"):
        assert word in text
    assert estimate(mlp, mlp_batch(), loss=ce_loss, device="cpu").to_dict()["peak_allocated"] > 3 * MiB


@pytest.mark.parametrize("loop", ["lightning", "torch"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_both_loop_orders_match_real_cpu_steps(loop, optimizer):
    est = estimate(mlp, mlp_batch(), loss=ce_loss, optimizer=optimizer, device="cpu", loop=loop)
    truth = measure_cpu_peak(mlp, mlp_batch, loss=ce_loss, optimizer=optimizer, loop=loop)
    assert relative_error(est.peak_allocated, truth) < 1e-4, (est.peak_allocated, truth)
    if loop == "torch":
        assert any("plain PyTorch loop" in note for note in est.notes)
        if optimizer == "sgd":  # the peak is no longer in a forward holding the last step's gradients
            lightning = estimate(mlp, mlp_batch(), loss=ce_loss, optimizer=optimizer, device="cpu")
            assert lightning.peak_phase == "forward" and est.peak_phase == "backward"
            assert est.peak_allocated < lightning.peak_allocated


@pytest.mark.parametrize("checkpointing", [False, True])
def test_torch_loop_order_matches_a_real_lightning_module_step(checkpointing, monkeypatch):
    est = estimate(tiny_gpt, gpt_batch(), checkpointing=checkpointing, device="cpu", loop="torch")
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # as in the Lightning-order test above
    truth = measure_cpu_peak(tiny_gpt, gpt_batch, checkpointing=checkpointing, loop="torch")
    assert relative_error(est.peak_allocated, truth) < 0.01, (est.peak_allocated, truth)


def transformer_encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)  # deep-copies `layer` 3 times


def transformer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Transformer(64, 4, 2, 2, 128, dropout=0.0, batch_first=True)


@pytest.mark.parametrize("build, loss", [
    (transformer_encoder, lambda m, b: m(b[0]).square().mean()),
    (transformer, lambda m, b: m(b[0], b[0]).square().mean()),
])
def test_layers_deep_copied_while_a_callable_builds_the_model_are_counted_once(build, loss, monkeypatch):
    def make_batch():  # made inside the measured run, as the estimate counts it
        return (torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(0)),)

    by_callable = estimate(build, make_batch(), loss=loss, device="cpu")
    assert by_callable.peak_allocated == estimate(build(), make_batch(), loss=loss, device="cpu").peak_allocated
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # see the Lightning-module test above
    truth = measure_cpu_peak(build, make_batch, loss=loss)
    assert relative_error(by_callable.peak_allocated, truth) < 0.001, (by_callable.peak_allocated, truth)


class _Deep(nn.Module):
    """24 small checkpointed blocks: each keeps a 5 KiB copy of the CPU RNG state until its backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(24))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("loop", ["lightning", "torch"])
def test_checkpointing_counts_the_rng_state_each_block_saves(loop, monkeypatch):
    def make_batch():  # made inside the measured run, as the estimate counts it
        g = torch.Generator().manual_seed(0)
        return torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)

    loss = lambda m, b: F.mse_loss(m(b[0]), b[1])  # noqa: E731
    est = estimate(_Deep, make_batch(), loss=loss, checkpointing=True, optimizer="sgd", device="cpu", loop=loop)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    truth = measure_cpu_peak(_Deep, make_batch, loss=loss, checkpointing=True, optimizer="sgd", loop=loop)
    assert relative_error(est.peak_allocated, truth) < 0.001, (est.peak_allocated, truth)
    assert torch.get_rng_state is torch.random.get_rng_state  # put back after the trace
