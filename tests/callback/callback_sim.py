"""Models, data and a SIMULATED device memory for the MemoryPlanner tests (CPU only).

`SimulatedBudget` stands in for a GPU running out of memory: it raises `torch.OutOfMemoryError` (the
exception a CUDA OOM raises) when a forward, or a backward, sees more samples than the budget set for
this rank. Nothing here measures memory; the tests check what MemoryPlanner does when the error comes.

`Regression` is a float64 MLP trained with plain SGD on a fixed dataset, so a run's final weights can
be compared exactly with `reference_weights`, the same training written in plain torch: equal
weights mean every sample of every global batch was counted once, at the right scale.

The scenario runner of the 2-rank drivers (run_scenarios, check_scenario_ran, ...) is scenario_runner.py's,
importable from here too.
"""
from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.loggers import Logger
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from scenario_runner import (  # noqa: F401  (re-exported: the drivers and tests import them from here)
    check_scenario_ran,
    end_finished_rank,
    run_scenarios,
    scenario_output,
    this_rank,
)
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.data import DataLoader, Dataset

from memplan.hardware import readings
from memplan.plan import Plan
from memplan.units import GiB

IN_FEATURES = 6
SAMPLES = 96


def make_plan(micro: int, accumulate: int, *, checkpointing: bool = False, world_size: int = 1,
              precision: str = "32-true") -> Plan:
    """A plan as `memplan suggest` would write it, for a CPU run."""
    return Plan(gpu_name="cpu", gpus=(), nodes=1, world_size=world_size, micro_batch_size=micro,
                accumulate_grad_batches=accumulate, global_batch_size=micro * accumulate * world_size,
                precision=precision, gradient_checkpointing=checkpointing,
                strategy="ddp" if world_size > 1 else "auto", predicted_peak_bytes=1 << 20,
                device_budget_bytes=1 << 30, host_bytes_per_rank=0)


def tracing(module: nn.Module) -> bool:
    """Whether `module` is memplan's fake copy, tracing a step (its parameters are fake tensors)."""
    return isinstance(next(module.parameters()), FakeTensor)


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, limit: int) -> torch.Tensor:
        ctx.limit = limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if grad.shape[0] > ctx.limit:
            raise torch.OutOfMemoryError(f"SIMULATED out of memory in backward: {grad.shape[0]} samples > {ctx.limit}")
        return grad, None


class SimulatedBudget(nn.Module):
    """SIMULATED device memory: raise torch.OutOfMemoryError past `forward_limit` / `backward_limit`
    samples, or in the forward calls numbered in `fail_forward_calls` (from 1), on the ranks listed
    (every rank when `ranks` is None). `freed_before_retry` tells, for each forward after a failed
    one, whether the failed forward's input had been freed by then."""

    def __init__(self, forward_limit: int | None = None, backward_limit: int | None = None,
                 ranks: tuple[int, ...] | None = None, fail_forward_calls: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.forward_limit, self.backward_limit, self.ranks = forward_limit, backward_limit, ranks
        self.fail_forward_calls = set(fail_forward_calls)
        self.raised = 0
        self.calls = 0
        self.freed_before_retry: list[bool] = []
        self._failed_input: weakref.ref | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ranks is not None and this_rank() not in self.ranks:
            return x
        if isinstance(x, FakeTensor):  # memplan tracing the step: no device memory is used, none runs out
            return x
        self.calls += 1
        if self._failed_input is not None:
            self.freed_before_retry.append(self._failed_input() is None)
            self._failed_input = None
        over = self.forward_limit is not None and x.shape[0] > self.forward_limit
        if over or self.calls in self.fail_forward_calls:
            self.raised += 1
            self._failed_input = weakref.ref(x)
            raise torch.OutOfMemoryError(f"SIMULATED out of memory in forward call {self.calls}: {x.shape[0]} samples"
                                         + (f" > {self.forward_limit}" if over else ""))
        if self.backward_limit is not None:
            return _RaiseInBackward.apply(x, self.backward_limit)
        return x


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class IndexedData(Dataset):
    """Deterministic regression samples; each yields (x, y, index) so tests can see which were used."""

    def __init__(self, length: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(length, IN_FEATURES, generator=g, dtype=torch.float64)
        self.y = torch.randn(length, 1, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def build_net(width: int = 16, depth: int = 3, budget: SimulatedBudget | None = None) -> nn.Module:
    torch.manual_seed(1)
    blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
    return nn.ModuleDict({
        "inp": nn.Linear(IN_FEATURES, width, dtype=torch.float64), "blocks": blocks,
        "budget": budget or SimulatedBudget(), "out": nn.Linear(width, 1, dtype=torch.float64),
    })


def run_net(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # the budget sits between the blocks and the head: a backward OOM there comes after the head's
    # gradients have been accumulated and before the blocks'
    return net["out"](net["budget"](net["blocks"](net["inp"](x))))


class RegressionSteps:
    """float64 MLP, SGD, mean squared error. `seen` lists the sample indices of each training_step
    call. A mixin, so the same model is a LightningModule of either Lightning package."""

    def __init__(self, batch_size: int = 8, lr: float = 0.05, budget: SimulatedBudget | None = None,
                 with_attr: bool = True) -> None:
        super().__init__()
        if with_attr:
            self.batch_size = batch_size
        self._loader_batch = batch_size
        self.lr = lr
        self.net = build_net(budget=budget)
        self.seen: list[list[int]] = []
        self.step_samples: list[list[int]] = []
        self._pending: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        loss = F.mse_loss(run_net(self.net, x), y)
        if not tracing(self):  # memplan's traces run training_step on a fake copy: they train nothing
            self.seen.append(index.tolist())
            self._pending.extend(index.tolist())
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        self.step_samples.append(sorted(self._pending))
        self._pending = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(IndexedData(), batch_size=getattr(self, "batch_size", self._loader_batch), shuffle=False)


class Regression(RegressionSteps, pl.LightningModule):
    """RegressionSteps as a pytorch_lightning LightningModule."""


def consecutive_batches(global_batch: int, steps: int) -> list[list[int]]:
    """The samples of each optimizer step of a single-process run (the loader does not shuffle)."""
    return [list(range(step * global_batch, (step + 1) * global_batch)) for step in range(steps)]


def ddp_batches(per_rank_batch: int, world_size: int, steps: int) -> list[list[int]]:
    """The samples of each optimizer step under Lightning DDP: it gives each rank a shuffling
    DistributedSampler (seed 0, reshuffled each epoch); step k takes each rank's k-th batch."""
    from torch.utils.data import DistributedSampler

    per_epoch = SAMPLES // world_size // per_rank_batch  # the tests use sizes that divide evenly
    batches = []
    for step in range(steps):
        epoch, k = divmod(step, per_epoch)
        batch = []
        for rank in range(world_size):
            sampler = DistributedSampler(IndexedData(), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            batch += list(sampler)[k * per_rank_batch:(k + 1) * per_rank_batch]
        batches.append(sorted(batch))
    return batches


def reference_weights(batches: list[list[int]], lr: float = 0.05) -> dict[str, torch.Tensor]:
    """The same training in plain torch: one SGD step on the mean loss of each batch of sample indices."""
    data = IndexedData()
    net = build_net()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for batch in batches:
        x, y = data.x[batch], data.y[batch]
        opt.zero_grad()
        F.mse_loss(run_net(net, x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def weights_of(module: Regression) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


class RecordingLogger(Logger):
    """A Lightning logger that keeps what it is given (from rank 0, as every Lightning logger) and
    writes it to `<save_dir>/metrics.json` at the end."""

    def __init__(self, save_dir: str | Path) -> None:
        super().__init__()
        self._save_dir = str(save_dir)
        self.metrics: list[dict[str, Any]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        return None

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append({"step": step, **metrics})

    @rank_zero_only
    def finalize(self, status: str) -> None:
        Path(self._save_dir).mkdir(parents=True, exist_ok=True)
        (Path(self._save_dir) / "metrics.json").write_text(json.dumps(self.metrics))


def simulated_free(fraction: float | None):
    """SIMULATED readings for readings.read_memory: `fraction` of a 16 GiB device free at every check
    (None: a device whose free memory cannot be read)."""

    def read(device: torch.device, *, new_interval: bool = True) -> readings.MemoryReading:
        total = 16 * GiB
        if fraction is None:
            return readings.MemoryReading(process_bytes=2 * GiB, device_total_bytes=total)
        return readings.MemoryReading(process_bytes=2 * GiB, device_used_bytes=int(total * (1 - fraction)),
                                     device_total_bytes=total, peak_bytes=2 * GiB, headroom_bytes=int(total * fraction))

    return read


class TightenAt(pl.Callback):
    """SIMULATED inputs that grow: from optimizer step `step` on, backwards of more than `limit`
    samples (or forwards, with `phase="forward"`) run out of memory."""

    def __init__(self, budget: SimulatedBudget, step: int, limit: int, phase: str = "backward") -> None:
        self.budget, self.step, self.limit, self.phase = budget, step, limit, phase

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            setattr(self.budget, f"{self.phase}_limit", self.limit)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class ShardedRegression(Regression):
    """Regression under ModelParallelStrategy: fully_shard in configure_model on each block, then the module
    (the root, whose forward training_step calls)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.net["blocks"]:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_net(self.net, x)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        loss = F.mse_loss(self(x), y)
        if not tracing(self):
            self.seen.append(index.tolist())
            self._pending.extend(index.tolist())
        self.log("train_loss", loss)
        return loss


class CausalLM(pl.LightningModule):
    """A tiny Llama from its config class, held as self.model and sharded the usual FSDP2 way."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        import transformers

        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(config)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 64, (64, 16), generator=g)
        return torch.utils.data.DataLoader([{"input_ids": i, "labels": i} for i in ids], batch_size=8)

