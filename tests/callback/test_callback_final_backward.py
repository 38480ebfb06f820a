"""Every chunk's backward runs inside training_step, the last one included, and Lightning's one
backward only hands the finished gradients to the parameters (memplan.callback.chunking). So an OOM
in the backward of a batch's last (or only) chunk, which used to be Lightning's synchronised backward
and ended the job, is retried smaller on the same samples, on one process and under DDP; the handoff
copies no gradient; users' backward hooks run once per batch and see the whole batch's gradient. The
SIMULATED device is callback_sim's SimulatedBudget; weights must equal plain full-batch SGD."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from callback_sim import (
    IndexedData, Regression, SimulatedBudget, TightenAt, build_net, make_plan, read_jsonl, run_net, simulated_free,
)
from pytorch_lightning.plugins import MixedPrecision
from test_callback_chunking import assert_trained_like_full_batches
from test_callback_ddp import check_trained_like_one_process, retries, shared_logs

from memplan.hardware import readings
from memplan.callback import MemoryPlanner, carrier


class Watched(Regression):
    """Counts its `self.log` calls and backward hooks, keeps the loss each batch returned and the
    whole batch's loss computed apart, the gradient `on_after_backward` saw on the first batch, and
    at each optimizer step whether an unused parameter got a gradient."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.unused = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))  # no forward uses it
        self.log_calls = 0
        self.backward_hooks = {"on_before_backward": 0, "on_after_backward": 0}
        self.returned: list[float] = []
        self.expected: list[float] = []
        self.unused_grads: list[torch.Tensor | None] = []
        self.first_grads: dict[str, torch.Tensor] | None = None

    def log(self, *args, **kwargs) -> None:
        self.log_calls += 1
        super().log(*args, **kwargs)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        x, y, _ = batch
        with torch.no_grad():
            self.expected.append(F.mse_loss(run_net(self.net, x), y).item())

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.returned.append(outputs["loss"].item())

    def on_before_backward(self, loss) -> None:
        self.backward_hooks["on_before_backward"] += 1

    def on_after_backward(self) -> None:
        self.backward_hooks["on_after_backward"] += 1
        if self.first_grads is None:
            self.first_grads = {name: p.grad.clone() for name, p in self.net.named_parameters()}

    def on_before_optimizer_step(self, optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        self.unused_grads.append(self.unused.grad)


def whole_batch_grads(samples: list[int]) -> dict[str, torch.Tensor]:
    """Plain torch: the gradient of the mean loss over `samples` at the initial weights."""
    data, net = IndexedData(), build_net()
    F.mse_loss(run_net(net, data.x[samples]), data.y[samples]).backward()
    return {name: p.grad for name, p in net.named_parameters()}


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_an_oom_in_the_only_chunks_backward_is_retried_smaller_on_the_same_samples(make_trainer, precision):
    # micro-batch 8 = the loaded batch: one chunk, whose backward was Lightning's before the carrier.
    # SIMULATED: a backward of more than 5 samples fails after the head's gradient was accumulated
    budget = SimulatedBudget(backward_limit=5)
    module = Watched(batch_size=8, budget=budget)
    planner = MemoryPlanner(make_plan(8, 1, precision=precision), every_n_steps=10, grow=False)
    # Lightning turns Trainer(precision="16-mixed") into bf16-mixed on CPU; the plugin keeps fp16
    # autocast and its GradScaler (scale 2**16: exact on the float64 layers, which autocast leaves be)
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    plugins = [MixedPrecision(precision, "cpu", scaler)] if scaler is not None else []
    trainer = make_trainer([planner], max_steps=3, plugins=plugins)
    trainer.fit(module)
    assert trainer.precision == precision
    if scaler is not None:
        assert scaler.get_scale() == 2.0**16  # never lowered: no step saw an inf
    events = read_jsonl(planner.log_path)
    assert retries(events) == [(0, "backward", 8, 4)]
    assert not [e for e in events if e["event"] == "fatal"]
    # the failed chunk's forward ran twice (training_step records forwards), its gradient counts once;
    # under 16-mixed the GradScaler scaled every chunk's backward alike and unscaled once
    assert module.step_samples[0].count(0) == 2 and module.step_samples[1].count(8) == 1
    assert_trained_like_full_batches(module, 8, steps=3, forwarded_twice=True)
    # the returned loss is the whole batch's; logged once per batch (the failed chunk's log dropped)
    torch.testing.assert_close(module.returned, module.expected, rtol=1e-12, atol=0)
    assert module.log_calls == 3
    # users' backward hooks ran once per batch, and saw the whole first batch's gradient (scaled by
    # the GradScaler under 16-mixed, as without MemoryPlanner: Lightning unscales at the step)
    assert module.backward_hooks == {"on_before_backward": 3, "on_after_backward": 3}
    expected = whole_batch_grads(list(range(8)))
    scale = 2.0**16 if scaler is not None else 1.0
    for name, grad in module.first_grads.items():
        torch.testing.assert_close(grad, expected[name] * scale, rtol=1e-12, atol=0, msg=name)
    # the handoff gave no parameter without a gradient one
    assert module.unused_grads == [None, None, None]


def test_chunks_with_accumulation_keep_every_gradient_when_a_backward_fails(make_trainer):
    # the loader's 8 as chunks of 4, 2 batches a step: Lightning zeroes after the first batch's
    # training_step and backwards the second under no gradient sync
    budget = SimulatedBudget(backward_limit=3)
    module = Watched(batch_size=8, budget=budget, with_attr=False)
    planner = MemoryPlanner(make_plan(4, 4), every_n_steps=10, grow=False)
    trainer = make_trainer([planner], max_steps=3)
    trainer.fit(module)
    assert retries(read_jsonl(planner.log_path)) == [(0, "backward", 4, 2)]  # the first chunk; then 2 fits
    assert_trained_like_full_batches(module, 16, steps=3, forwarded_twice=True)
    assert module.log_calls == 6 and module.unused_grads == [None, None, None]
    assert module.backward_hooks == {"on_before_backward": 6, "on_after_backward": 6}


class Handoffs:
    """Records what each carrier hands over (memplan.callback.carrier.Handoff): the gradients'
    buffers, per batch."""

    def __init__(self, monkeypatch) -> None:
        self.pointers: list[set[int]] = []
        original = carrier.Handoff.__init__

        def record(handoff, grads):
            self.pointers.append({g.data_ptr() for g in grads})
            original(handoff, grads)

        monkeypatch.setattr(carrier.Handoff, "__init__", record)


class GradPointers(Regression):
    """Records the buffers of its parameters' gradients after Lightning's backward."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.after_backward: list[set[int]] = []

    def on_after_backward(self) -> None:
        self.after_backward.append({p.grad.data_ptr() for p in self.net.parameters()})


def test_the_handoff_moves_each_gradient_without_copying_it(make_trainer, monkeypatch):
    # A copy would hold every gradient twice at Lightning's backward: as much extra memory as the
    # model's gradients. The buffers the carrier hands over must be the parameters' gradients after it.
    handoffs = Handoffs(monkeypatch)
    module = GradPointers(batch_size=8, with_attr=False)
    planner = MemoryPlanner(make_plan(4, 2), every_n_steps=10, grow=False)  # 2 chunks a batch: guarded
    trainer = make_trainer([planner], max_steps=3)
    trainer.fit(module)
    assert len(handoffs.pointers) == 3 and handoffs.pointers == module.after_backward
    assert_trained_like_full_batches(module, 8, steps=3)


@pytest.mark.ddp_scenarios("final")
@pytest.mark.slow
def test_an_oom_in_one_ranks_only_backward_is_retried_there_without_a_hang(ddp_runs):
    out, logs = shared_logs(ddp_runs, "final")  # a scenario of the shared 2-rank launch (tests/callback/conftest.py)
    assert retries(logs[1]) == [(0, "backward", 8, 4)] and not retries(logs[0])
    assert not [e for log in logs for e in log if e["event"] == "fatal"]
    # step 0: rank 0 ran one chunk of 8, rank 1 two chunks of 4 after the failed 8; DDP paired them
    check_trained_like_one_process(out, steps=6)  # rank 0's weights: plain SGD on both ranks' samples
    for name, value in torch.load(out / "weights_rank1.pt").items():
        torch.testing.assert_close(value, torch.load(out / "weights.pt")[name], rtol=0, atol=1e-12, msg=name)
    # each rank logged (sync_dist=True, a collective) once per batch, the failed chunk's log dropped
    assert [json.loads((out / f"log_calls_rank{r}.json").read_text()) for r in (0, 1)] == [6, 6]


# --- the guard: unguarded once a reading shows the margin free, guarded again after a change or OOM ---

def test_a_rank_with_the_margin_free_leaves_the_backward_to_lightning(make_trainer, monkeypatch):
    monkeypatch.setattr(readings, "read_memory", simulated_free(0.10))  # above the 5 % margin, as plans leave
    handoffs = Handoffs(monkeypatch)
    module = Regression(batch_size=8)
    planner = MemoryPlanner(make_plan(8, 1), every_n_steps=1, grow=False)
    trainer = make_trainer([planner], max_steps=4)
    trainer.fit(module)
    samples = [e for e in read_jsonl(planner.log_path) if e["event"] == "sample"]
    # each sample line says how the rank ran since the previous one: guarded until the first reading
    assert [(e["step"], e["guarded"]) for e in samples] == [(1, True), (2, False), (3, False), (4, False)]
    assert len(handoffs.pointers) == 1  # only the guarded batch went through a carrier
    assert_trained_like_full_batches(module, 8, steps=4)


@pytest.mark.parametrize(("free", "guard", "retried"), [
    (0.60, "always", True),   # plenty of room, but guard="always"
    (None, "auto", True),     # a device whose free memory cannot be read stays guarded
    (0.10, "auto", False),    # the margin free: unguarded, Lightning's backward, not retried
])
def test_a_backward_oom_after_the_first_reading_is_retried_while_the_rank_is_guarded(
        make_trainer, monkeypatch, caplog, free, guard, retried):
    monkeypatch.setattr(readings, "read_memory", simulated_free(free))
    budget = SimulatedBudget()
    module = Regression(batch_size=8, budget=budget)
    planner = MemoryPlanner(make_plan(8, 1), every_n_steps=1, grow=False, guard=guard)
    trainer = make_trainer([planner, TightenAt(budget, step=2, limit=5)], max_steps=4)
    if not retried:
        with pytest.raises(torch.OutOfMemoryError, match="SIMULATED out of memory in backward"):
            trainer.fit(module)
        fatal, end = read_jsonl(planner.log_path)[-2:]
        assert end["event"] == "end" and end["status"].startswith("failed: OutOfMemoryError")
        assert fatal["event"] == "fatal" and fatal["step"] == 2 and "ran unguarded" in fatal["where"]
        assert "guard='always'" in caplog.text
        return
    trainer.fit(module)
    assert retries(read_jsonl(planner.log_path)) == [(2, "backward", 8, 4)]
    assert_trained_like_full_batches(module, 8, steps=4, forwarded_twice=True)


def test_a_forward_oom_while_unguarded_is_retried_freed_and_guards_the_rank_again(make_trainer, monkeypatch):
    monkeypatch.setattr(readings, "read_memory", simulated_free(0.60))
    budget = SimulatedBudget()
    module = Regression(batch_size=8, budget=budget)
    planner = MemoryPlanner(make_plan(8, 1), every_n_steps=2, grow=False)
    trainer = make_trainer([planner, TightenAt(budget, step=2, limit=5, phase="forward")], max_steps=4)
    trainer.fit(module)
    events = read_jsonl(planner.log_path)
    assert retries(events) == [(2, "forward", 8, 4)]
    # the failed forward's tensors were freed before the retry ran (not kept by its traceback)
    assert budget.freed_before_retry == [True]
    # step 0 guarded (no reading yet), unguarded from the first step's reading until step 2's forward failed
    assert [(e["step"], e["guarded"]) for e in events if e["event"] == "sample"] == [(1, True), (2, False), (4, True)]
    assert_trained_like_full_batches(module, 8, steps=4, forwarded_twice=True)


@pytest.mark.parametrize(("loader", "micro", "accumulate", "failing_call"), [
    (8, 4, 1, 2),   # the second chunk of the first batch: the first chunk's gradients exist
    (8, 8, 2, 2),   # the second batch of an accumulation window: the first batch's gradients exist
])
def test_a_forward_oom_after_gradients_exist_freezes_nothing(make_trainer, loader, micro, accumulate, failing_call):
    # A failed forward added to no gradient: its retry must give every parameter its gradient
    budget = SimulatedBudget(fail_forward_calls=(failing_call,))
    module = Regression(batch_size=loader, budget=budget, with_attr=micro == loader)
    planner = MemoryPlanner(make_plan(micro, loader // micro * accumulate), every_n_steps=10, grow=False)
    trainer = make_trainer([planner], max_steps=2)
    trainer.fit(module)
    assert retries(read_jsonl(planner.log_path)) == [(0, "forward", micro, micro // 2)]  # in the first step
    assert budget.freed_before_retry == [True]
    assert_trained_like_full_batches(module, loader * accumulate, steps=2)
