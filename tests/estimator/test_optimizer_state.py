"""The optimizer-state lower bound known before any trace (memplan/estimator/optimizer_state.py):
exact for elementwise optimizers, 0 where the state is not elementwise, never above what a real
trace of the step counts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import memplan
from memplan.demos import GPTLM
from memplan.estimator.fake import fake_model, new_fake_mode
from memplan.estimator.optimizer_state import elementwise_state_bytes


def tiny_gpt() -> GPTLM:
    return GPTLM(vocab_size=131, context=16, d_model=32, n_layers=2, n_heads=2, dropout=0.0)


def fake_gpt() -> GPTLM:
    return fake_model(tiny_gpt, new_fake_mode(), device=torch.device("cpu"), param_dtype=torch.float32)


def param_bytes(model: nn.Module, trained_only: bool = True) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trained_only)


OPTIMIZERS = {  # name: (optimizer, elementwise state per parameter byte)
    "sgd": ("sgd", 0),
    "sgd-momentum": ("sgd-momentum", 1),
    "adamw": ("adamw", 2),
    "adagrad": ("adagrad", 1),
    "rmsprop": ("rmsprop", 1),
    "adam-amsgrad": (lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True), 3),
    "adafactor": (lambda ps: torch.optim.Adafactor(ps, lr=1e-3), 0),  # factored rows/columns on matrices
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_bound_is_the_elementwise_state_and_never_above_a_traced_step(name):
    optimizer, per_byte = OPTIMIZERS[name]
    bound = elementwise_state_bytes(fake_gpt(), optimizer)
    assert bound == per_byte * param_bytes(tiny_gpt())
    est = memplan.estimate(tiny_gpt, tiny_gpt().example_batch(2), optimizer=optimizer, device="cpu")
    assert bound <= est.optimizer_state


def test_a_lightning_modules_own_configure_optimizers_is_read_on_its_fake_parameters():
    assert elementwise_state_bytes(fake_gpt(), None) == 2 * param_bytes(tiny_gpt())  # GPTLM: AdamW


class HalfTrained(GPTLM):
    """Frozen embeddings; configure_optimizers steps the blocks only (momentum SGD)."""

    def __init__(self):
        super().__init__(vocab_size=131, context=16, d_model=32, n_layers=2, n_heads=2, dropout=0.0)
        for p in self.tok.parameters():
            p.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.blocks.parameters(), lr=0.1, momentum=0.9)


def test_only_the_parameters_the_optimizer_steps_count():
    model = HalfTrained()
    assert any(not p.requires_grad for p in model.parameters())
    assert elementwise_state_bytes(model, None) == param_bytes(model.blocks)
    # the config's optimizer gets every parameter that requires grad: frozen ones keep no state
    assert elementwise_state_bytes(model, "adamw") == 2 * param_bytes(model)


def test_an_optimizer_the_probe_cannot_build_is_no_bound_not_an_error():
    def broken(params):
        raise RuntimeError("needs a CUDA device")

    class NeedsATrainer(GPTLM):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3 * self.trainer.num_devices)

    assert elementwise_state_bytes(tiny_gpt(), broken) == 0
    model = NeedsATrainer(vocab_size=131, context=16, d_model=32, n_layers=2, n_heads=2)
    assert elementwise_state_bytes(model, None) == 0


class GroupOptions(GPTLM):
    """Momentum on the vectors only: the matrices' group keeps no momentum buffer."""

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.ndim >= 2]
        vectors = [p for p in self.parameters() if p.ndim < 2]
        return torch.optim.SGD([{"params": matrices, "momentum": 0.0}, {"params": vectors}], lr=0.1, momentum=0.9)


class ArgumentsNotInDefaults(torch.optim.SGD):
    """A user's optimizer whose constructor takes what its defaults do not name."""

    def __init__(self, params, lr=0.1, use_momentum=True):
        super().__init__(params, lr=lr, momentum=0.9 if use_momentum else 0.0)


class OwnOptimizer(GPTLM):
    def configure_optimizers(self):
        return ArgumentsNotInDefaults(self.parameters(), use_momentum=False)


@pytest.mark.parametrize("model_class", [GroupOptions, OwnOptimizer], ids=lambda c: c.__name__)
def test_each_groups_own_options_are_probed_on_the_optimizer_as_built(model_class):
    """Found in review: rebuilding the optimizer from its class and defaults counted momentum for a
    group (or a constructor) without it, above the traced step."""
    def build():
        return model_class(vocab_size=131, context=16, d_model=32, n_layers=2, n_heads=2, dropout=0.0)

    fake = fake_model(build, new_fake_mode(), device=torch.device("cpu"), param_dtype=torch.float32)
    bound = elementwise_state_bytes(fake, None)
    est = memplan.estimate(build, build().example_batch(2), device="cpu")
    assert bound <= est.optimizer_state
    vectors = sum(p.numel() * 4 for p in build().parameters() if p.ndim < 2)
    assert bound == (vectors if model_class is GroupOptions else 0)
