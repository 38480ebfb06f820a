"""The fake copy of a user's module: modules copied, weights fake, user state shared, original untouched."""
from __future__ import annotations

import threading

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

from memplan.estimator.api import estimate
from memplan.estimator.fake import fake_model, new_fake_mode
from memplan.truth import measure_cpu_peak

torchmetrics = pytest.importorskip("torchmetrics")


class Holder(pl.LightningModule):
    """A LightningModule holding what deepcopy cannot copy (or should not): an open file, a lock, a
    generator, a lambda, a torchmetrics metric; it appends to a list and logs in training_step."""

    def __init__(self, path, metric: str = "accuracy"):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 32)
        self.body = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.heads = nn.ModuleDict({"a": nn.Linear(32, 50)})
        self.heads["a"].weight = self.embed.weight  # tied
        self.again = self.body[0]  # a module reused in two places
        self.register_buffer("scale", torch.ones(32), persistent=False)
        self.norm = parametrizations.weight_norm(nn.Linear(32, 32))
        self.file = open(path, "w")  # noqa: SIM115
        self.lock = threading.Lock()
        self.numbers = (i for i in range(10**6))
        self.transform = lambda x: x * 2
        # an accuracy's update needs values (bincount); a mean squared error's does not
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=50)
        self.metric = self.accuracy if metric == "accuracy" else torchmetrics.MeanSquaredError()
        self.outputs: list[float] = []
        self.shortcut = {"first": self.body[0]}  # an attribute that references a submodule
        self.hooked = 0
        self.body[1].register_forward_hook(self._count)

    def _count(self, module, args, output):
        self.hooked += 1

    def forward(self, tokens):
        x = self.embed(tokens) * self.scale
        x = self.shortcut["first"](x).relu()
        x = self.again(x).relu()
        x = self.norm(self.body[1](x))
        return self.heads["a"](self.transform(x))

    def training_step(self, batch, batch_idx):
        with self.lock:
            logits = self(batch[0])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())
        if self.metric is self.accuracy:
            self.metric(logits.flatten(0, 1), batch[1].flatten())
        else:
            self.metric(logits.detach().softmax(-1), F.one_hot(batch[1], 50).float())
        self.outputs.append(1.0)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def holder_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 50, (4, 16), generator=g), torch.randint(0, 50, (4, 16), generator=g)


def snapshot(module: nn.Module) -> dict:
    """What a user would check is unchanged: each module's attributes (by identity, containers by
    content), parameters and buffers (identity and values), and hooks."""
    state = {}
    for name, m in module.named_modules(remove_duplicate=False):
        attrs = {}
        for key, value in vars(m).items():
            if isinstance(value, (list, dict, set)):
                attrs[key] = (id(value), repr(value) if key != "_modules" else tuple(map(id, value.values())))
            else:
                attrs[key] = id(value)
        state[name] = attrs
    state["params"] = [(n, id(p), p.detach().clone(), p.grad) for n, p in module.named_parameters()]
    state["buffers"] = [(n, id(b), b.clone(), None) for n, b in module.named_buffers()]
    return state


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if key in ("params", "buffers"):
            for old, new in zip(before[key], after[key], strict=True):
                assert old[:2] == new[:2] and torch.equal(old[2], new[2]) and new[-1] is None
        else:
            assert before[key] == after[key], key


@pytest.mark.parametrize("metric", ["accuracy", "mse"])
def test_a_module_holding_unpicklable_state_is_estimated_and_left_unchanged(tmp_path, metric):
    model = Holder(tmp_path / "log.txt", metric)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False)
    model.trainer = trainer
    before = snapshot(model)
    est = estimate(model, holder_batch(), device="cpu")
    assert_same(before, snapshot(model))
    assert model.outputs == [] and model.hooked == 0 and next(model.numbers) == 0
    assert not model.file.closed and not model.lock.locked()
    assert model.accuracy._update_count == 0 and model.accuracy.tp.sum() == 0
    assert model.metric._update_count == 0
    if metric == "accuracy":
        return  # its update was skipped on fakes: the real one's bincount is not in the estimate
    # the estimate is the real step's peak (a fresh model: the real run trains it)
    truth = measure_cpu_peak(lambda: Holder(tmp_path / "truth.txt", metric), holder_batch)
    assert abs(est.peak_allocated - truth) / truth < 0.005, (est.peak_allocated, truth)


def test_copy_keeps_ties_reuse_and_references_and_shares_user_objects(tmp_path):
    model = Holder(tmp_path / "log.txt")
    copy = fake_model(model, new_fake_mode(), device=torch.device("cpu"), param_dtype=torch.float32)
    assert copy.heads["a"].weight is copy.embed.weight and copy.heads["a"].weight is not model.embed.weight
    assert copy.again is copy.body[0] and copy.shortcut["first"] is copy.body[0]
    assert len(list(copy.parameters())) == len(list(model.parameters()))
    assert copy.file is model.file and copy.lock is model.lock and copy.numbers is model.numbers
    assert copy.transform is model.transform
    assert copy.outputs is not model.outputs and copy.outputs == model.outputs
    assert "scale" in copy._non_persistent_buffers_set and "scale" not in copy.state_dict()
    # the forward hook was a bound method of the original: it now counts on the copy
    hook = next(iter(copy.body[1]._forward_hooks.values()))
    assert hook.__self__ is copy
    # a parametrized module stays parametrized, its original weight a fake of the copy
    assert copy.norm.parametrizations.weight.original0 is not model.norm.parametrizations.weight.original0
    assert type(copy.norm) is type(model.norm)
    # the metric's states are fakes on the trace device, and its update wrapper updates the copy
    assert type(copy.accuracy.tp).__name__ == "FakeTensor" and copy.accuracy is not model.accuracy
    assert copy.accuracy.update.__closure__ is not None and all(
        c.cell_contents is not model.accuracy for c in copy.accuracy.update.__closure__)


def test_a_parameter_attribute_reaches_configure_optimizers():
    class NoDecay(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.LayerNorm(8)
            self.b.weight.no_decay = True

        def forward(self, x):
            return self.b(self.a(x)).sum()

    seen = []

    def optimizer(params):
        params = list(params)
        seen.extend(getattr(p, "no_decay", False) for p in params)
        return torch.optim.SGD(params, lr=0.1)

    estimate(NoDecay(), (torch.randn(4, 8),), optimizer=optimizer, device="cpu")
    assert seen == [False, False, True, False]


class WeightNormConv(nn.Module):
    """wav2vec2's positional conv: a weight-normed Conv1d (a parametrized class with its own __setstate__)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = parametrizations.weight_norm(nn.Conv1d(16, 16, 5, padding=2), dim=2)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(F.gelu(self.conv(x)).mean(-1))


def test_a_parametrized_convolution_is_copied_and_estimated():
    batch = lambda: (torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3]))  # noqa: E731
    loss = lambda model, b: F.cross_entropy(model(b[0]), b[1])  # noqa: E731
    est = estimate(WeightNormConv, batch(), loss=loss, device="cpu")
    truth = measure_cpu_peak(WeightNormConv, batch, loss=loss)
    assert abs(est.peak_allocated - truth) / truth < 0.01, (est.peak_allocated, truth)
