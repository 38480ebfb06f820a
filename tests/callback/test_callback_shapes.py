"""Plan for the heaviest batch, not the first (memplan.shapes): a long-tail dataset whose first
batch is short and whose longest batch is 8x longer, on a SIMULATED device budget (a forward of more than
TOKENS tokens runs out of memory) and a SIMULATED planner that fits the budget to the batch it is given."""
from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from callback_sim import IndexedData, Regression, make_plan, read_jsonl, tracing
from torch import nn
from torch.utils.data import DataLoader, Dataset

from memplan.callback import MemoryPlanner
from memplan.shapes import by_lengths, declared, scan

VOCAB, BATCH, TOKENS = 16, 8, 256
LENGTHS = [8, 16, 12, 24, 16, 64, 20, 8]  # per batch: the first is short, the sixth 8x longer


class LongTail(Dataset):
    """Batch b's samples have LENGTHS[b] tokens (a bucketing sampler's output, in order)."""

    def __len__(self) -> int:
        return BATCH * len(LENGTHS)

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (LENGTHS[i // BATCH],), generator=g)
        return {"input_ids": ids, "labels": ids.roll(-1)}


class Budget(nn.Module):
    """SIMULATED device memory: a forward of more than TOKENS tokens runs out of it."""

    def __init__(self) -> None:
        super().__init__()
        self.ooms = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch._subclasses.fake_tensor.FakeTensor) and x.shape[0] * x.shape[1] > TOKENS:
            self.ooms += 1
            raise torch.OutOfMemoryError(f"SIMULATED: {x.shape[0] * x.shape[1]} tokens > {TOKENS}")
        return x


class TokenModel(pl.LightningModule):
    def __init__(self, budget: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8, dtype=torch.float64)
        self.head = nn.Linear(8, VOCAB, dtype=torch.float64)
        self.budget = Budget() if budget else nn.Identity()
        self.tokens_seen = 0

    def training_step(self, batch, batch_idx):
        hidden = self.embed(self.budget(batch["input_ids"]))
        if not tracing(self):
            self.tokens_seen += batch["input_ids"].numel()
        return F.cross_entropy(self.head(hidden).reshape(-1, VOCAB), batch["labels"].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(LongTail(), batch_size=BATCH)


def simulated_planner(request, estimate):
    """SIMULATED: the micro-batch that keeps a forward within TOKENS for the batch memplan plans with (its
    length read off the traced batch's bytes: input_ids and labels, int64)."""
    length = estimate(micro_batch_size=1, precision="32-true", checkpointing=False, world_size=1).batch // 16
    micro = max(m for m in (1, 2, 4, 8) if m * length <= TOKENS)
    return make_plan(micro, BATCH // micro)


def fit(make_trainer, module, planner=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([planner] if planner else [], max_steps=len(LENGTHS), log_every_n_steps=1).fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_the_scan_finds_the_heaviest_batch_and_leaves_the_rngs_as_they_were():
    loader = TokenModel().train_dataloader()
    state = torch.random.get_rng_state()
    found = scan(loader, lambda b: len(b["input_ids"]), max_batches=100, seconds=60)
    assert found.batch["input_ids"].shape == (BATCH, 64) and found.complete and found.scanned == len(LENGTHS)
    assert "8.00x the first batch's" in found.describe()
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_long_tail_dataset_trains_without_an_oom_when_planned_for_its_heaviest_batch(make_trainer):
    whole = fit(make_trainer, TokenModel(budget=False))
    module = TokenModel()
    planner = MemoryPlanner(planner=simulated_planner, grow=False)
    weights = fit(make_trainer, module, planner)
    assert module.budget.ooms == 0 and planner.plan.micro_batch_size == 4  # 4 x 64 tokens fit
    assert module.tokens_seen == BATCH * sum(LENGTHS)  # every sample once
    for name, value in whole.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-10, atol=1e-12, msg=name)
    # planned from the first (short) batch, as before: the long batch runs out of memory mid-run
    first_only = TokenModel()
    fit(make_trainer, first_only, MemoryPlanner(planner=simulated_planner, grow=False, scan_batches=0))
    assert first_only.budget.ooms >= 1


def test_a_batch_heavier_than_the_scan_saw_runs_as_smaller_chunks_before_it_runs(make_trainer):
    # the scan reads 3 batches (longest 16 tokens): micro 8 planned; the 64-token batch is cut to chunks of 2
    module = TokenModel()
    planner = MemoryPlanner(planner=simulated_planner, grow=False, scan_batches=3)
    fit(make_trainer, module, planner)
    assert planner.plan.micro_batch_size == 8 and module.budget.ooms == 0
    summary = [e for e in read_jsonl(planner.log_path) if e["event"] == "summary"][-1]
    assert summary["heavier_batches"] == 3  # the batches of 24, 64 and 20 tokens ran as chunks of 4, 2, 4
    assert module.tokens_seen == BATCH * sum(LENGTHS)


class Measured(LongTail):
    """LongTail telling each sample's length, as bucketing datasets do."""

    @property
    def lengths(self) -> list[int]:
        return [LENGTHS[i // BATCH] for i in range(len(self))]


class MeasuredModel(TokenModel):
    def train_dataloader(self):
        return DataLoader(Measured(), batch_size=BATCH)


def test_the_longest_samples_by_the_datasets_lengths_make_the_batch_planned_for():
    loader = MeasuredModel().train_dataloader()
    state = torch.random.get_rng_state()
    found = by_lengths(loader, lambda b: len(b["input_ids"]))
    assert found.batch["input_ids"].shape == (BATCH, 64) and found.from_lengths == BATCH * len(LENGTHS)
    assert "8 longest of 64 samples by the dataset's `lengths`" in found.describe()
    assert "8.00x the first batch's" in found.describe()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert by_lengths(TokenModel().train_dataloader(), lambda b: len(b["input_ids"])) is None  # no lengths: scan


def test_a_dataset_with_lengths_is_planned_for_its_longest_samples_whatever_the_scan_would_read(make_trainer):
    # a scan of 3 batches (longest 16 tokens) would plan micro 8; the dataset's lengths say 64: micro 4, no split
    module = MeasuredModel()
    planner = MemoryPlanner(planner=simulated_planner, grow=False, scan_batches=3)
    fit(make_trainer, module, planner)
    assert planner.plan.micro_batch_size == 4 and module.budget.ooms == 0
    summary = [e for e in read_jsonl(planner.log_path) if e["event"] == "summary"][-1]
    assert summary["heavier_batches"] == 0
    assert module.tokens_seen == BATCH * sum(LENGTHS)


def test_a_declared_max_shape_grows_the_named_tensors_by_repeating_their_values():
    batch = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]]), "scale": torch.tensor(2.0), "ids": ["a", "b"]}
    found = declared(batch, 2, {"input_ids": (7,)})
    assert found.batch["input_ids"].tolist() == [[1, 2, 3, 1, 2, 3, 1], [4, 5, 6, 4, 5, 6, 4]]
    assert found.batch["scale"] is batch["scale"] and found.batch["ids"] == ["a", "b"]
    assert "declared max_shape: per-sample tensors (2, 7), 2.33x the first batch's" in found.describe()
    with pytest.raises(ValueError, match=r"no per-sample tensor 'labels' in the batch \(its per-sample tensors: "
                                         r"batch\['input_ids'\]\)"):
        declared(batch, 2, {"labels": (7,)})
    with pytest.raises(ValueError, match=r"'input_ids' declares a per-sample shape \(7, 2\), but batch\['input_ids'\] "
                                         "has 1 dimension"):
        declared(batch, 2, {"input_ids": (7, 2)})


def test_a_declared_max_shape_is_planned_for_without_reading_the_loader(make_trainer):
    module = TokenModel()
    planner = MemoryPlanner(planner=simulated_planner, grow=False, max_shape={"input_ids": (64,), "labels": (64,)})
    fit(make_trainer, module, planner)
    assert planner.plan.micro_batch_size == 4 and module.budget.ooms == 0
    summary = [e for e in read_jsonl(planner.log_path) if e["event"] == "summary"][-1]
    assert summary["heavier_batches"] == 0 and module.tokens_seen == BATCH * sum(LENGTHS)


def test_a_max_shape_that_is_not_a_mapping_of_shapes_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"MemoryPlanner\(max_shape=...\) maps a batch field to the per-sample shape"):
        MemoryPlanner(max_shape={"input_ids": 2048})


def test_a_max_shape_the_model_cannot_take_names_max_shape_and_the_fix(make_trainer):
    """Regression's features are (6,) a sample: 32 is not their shape. The op error named the batch and a `loss=`,
    which MemoryPlanner has no argument for."""
    from memplan.callback.framework import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=r"^MemoryPlanner\(max_shape=\{0: \(32,\)\}\) grew the batch "
                       r"to shapes the model cannot take: the model could not run .*per-sample shape"):
        make_trainer([MemoryPlanner(max_shape={0: (32,)})], max_steps=1).fit(Regression())


class Shuffled(Regression):
    def train_dataloader(self):
        return DataLoader(IndexedData(), batch_size=8, shuffle=True)


def test_planning_at_fit_start_leaves_the_data_order_as_it_was(make_trainer):
    # the scan (and any batch read to plan) draws from torch's generator, as a DataLoader iterator does:
    # restored, so the shuffled order the training sees is the one it sees without MemoryPlanner
    orders = []
    for callbacks in ([], [MemoryPlanner(grow=False)]):
        pl.seed_everything(0)
        module = Shuffled()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_trainer(callbacks, max_steps=4).fit(module)
        orders.append(module.seen)
    assert orders[0] == orders[1] and len(orders[0]) == 4
