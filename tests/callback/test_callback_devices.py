"""MemoryPlanner on a model and batches that live on a device the estimator's trace is not on.

On a GPU the callback traces the user's own module and Lightning's batch, both on cuda:0, on fake CPU
tensors: to recognise how the loss reduces before it splits a batch after an OOM (the GPU campaign's
oom-retry probe failed there). CPU-only CI has no second device; here the SIMULATED device is "meta":
`MetaStrategy` keeps the model and every batch on it, so the real steps run (shapes only, no values) while
memplan traces on the CPU, and `SimulatedBudget` stands in for the GPU's memory running out."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from callback_sim import SimulatedBudget, make_plan, read_jsonl, tracing
from pytorch_lightning.accelerators import CPUAccelerator
from pytorch_lightning.strategies import SingleDeviceStrategy
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

from memplan.callback import MemoryPlanner
from memplan.callback.loss_reduction import LossWatcher
from memplan.demos import GPTLM
from memplan.estimator.api import estimate
from memplan.shapes import declared

TINY = dict(vocab_size=512, context=32, d_model=32, n_layers=2, n_heads=2, dropout=0.1)


class MetaStrategy(SingleDeviceStrategy):
    """SIMULATED device: the model and each batch on "meta" (Lightning's own bookkeeping stays on the CPU)."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"), accelerator=CPUAccelerator())

    def model_to_device(self) -> None:
        self.model.to("meta")

    def batch_to_device(self, batch, device=None, dataloader_idx=0):
        return super().batch_to_device(batch, torch.device("meta"), dataloader_idx)

    def teardown(self) -> None:
        self.lightning_module.cpu = lambda: self.lightning_module  # a meta tensor has no data to copy back
        super().teardown()


class OnMeta(pl.LightningModule):
    """A per-sample mean squared error (what a split weighs by samples), with the SIMULATED budget."""

    def __init__(self, budget: SimulatedBudget) -> None:
        super().__init__()
        self.batch_size = 8
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.budget = budget
        self.head = nn.Linear(16, 1)
        self.sizes: list[int] = []
        """The samples each real training_step got, with the device they were on."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if not tracing(self):
            self.sizes.append((x.shape[0], x.device.type))
        return F.mse_loss(self.head(self.budget(self.body(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g))
        return DataLoader(data, batch_size=self.batch_size)


def test_an_oom_on_another_device_is_retried_smaller_instead_of_refused(make_trainer):
    budget = SimulatedBudget(forward_limit=3)  # SIMULATED: more than 3 samples in a forward "run out of memory"
    module = OnMeta(budget)
    planner = MemoryPlanner(make_plan(8, 1), every_n_steps=2, grow=False)
    trainer = make_trainer([planner], max_steps=3, strategy=MetaStrategy(), accelerator="auto")
    trainer.fit(module)  # (without placing the batch on the trace's device: NothingFitsError)
    assert trainer.global_step == 3
    assert planner.exactness.reduction.kind == "mean_samples" and planner.exactness.can_split
    retries = [e for e in read_jsonl(planner.log_path) if e["event"] == "oom_retry"]
    assert [(e["failed_micro_batch_size"], e["micro_batch_size"]) for e in retries] == [(8, 4), (4, 2)]
    assert module.sizes[:3] == [(8, "meta"), (4, "meta"), (2, "meta")]
    assert module.sizes[3:] == [(2, "meta")] * 11  # the rest of step 0's batch, then two batches in 4 chunks


def test_the_loss_reduction_is_recognised_on_a_model_and_batch_on_another_device():
    """The callback's own trace (MemoryPlanner._recognise): a token-mean cross-entropy, as GPT-2 on the GPU."""
    with torch.device("meta"):
        model = GPTLM(**TINY)
    batch = tuple(t.to("meta") for t in GPTLM(**TINY).example_batch(2))
    watcher = LossWatcher()
    watcher.watch(batch, 2)
    with watcher:
        estimate(model, batch, device="cpu")
    reduction = watcher.reduction()
    assert reduction.kind == "mean_count", reduction.describe
    assert reduction.count.path == (("index", 1),) and reduction.count.ignore_index == -100


class _IndexOnItsDevice(TorchFunctionMode):
    """CUDA's index_select refuses an index on another device than its input; the meta kernel takes a CPU
    index, so this stands in for CUDA's device check (a checked rule, not a device)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.index_select, torch.Tensor.index_select):
            source, index = args[0], args[2] if len(args) > 2 else kwargs["index"]
            if index.device != source.device:
                raise RuntimeError(f"index_select: index on {index.device}, input on {source.device}")
        return func(*args, **kwargs)


def test_a_declared_max_shape_grows_a_batch_on_another_device_there():
    """MemoryPlanner(max_shape=) on a loader whose collate puts the batch on the GPU."""
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long, device="meta"), "mask": torch.ones(2, 3, device="meta")}
    with _IndexOnItsDevice():
        grown = declared(batch, 2, {"input_ids": (7,), "mask": (7,)})
    assert {k: (tuple(t.shape), t.device.type) for k, t in grown.batch.items()} == {
        "input_ids": ((2, 7), "meta"), "mask": ((2, 7), "meta")}
