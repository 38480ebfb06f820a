"""MemoryPlanner under `lightning.pytorch` (the unified `lightning` package) as well as
`pytorch_lightning`: one MemoryPlanner subclasses both packages' Callback, and its refusals are both
packages' MisconfigurationException (memplan.callback.framework). The SIMULATED device is
callback_sim's SimulatedBudget; weights must equal plain full-batch SGD."""
from __future__ import annotations

import pytest
from callback_sim import RegressionSteps, SimulatedBudget, make_plan, read_jsonl
from test_callback_chunking import assert_trained_like_full_batches
from test_callback_ddp import check_trained_like_one_process, retries, shared_logs

from memplan.callback import MemoryPlanner

L = pytest.importorskip("lightning.pytorch")  # a dev dependency: installed in CI


class LRegression(RegressionSteps, L.LightningModule):
    """callback_sim's model as a lightning.pytorch LightningModule."""


def lightning_trainer(tmp_path, callbacks, **overrides) -> L.Trainer:
    options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=tmp_path, max_steps=3, log_every_n_steps=1)
    return L.Trainer(callbacks=callbacks, **{**options, **overrides})


def test_micro_batches_and_an_oom_retry_train_like_full_batches_under_lightning_pytorch(tmp_path):
    budget = SimulatedBudget(backward_limit=3)  # SIMULATED: backwards of more than 3 samples fail
    module = LRegression(batch_size=8, budget=budget, with_attr=False)
    planner = MemoryPlanner(make_plan(4, 4), every_n_steps=10, grow=False)  # the loader's 8 as chunks of 4
    assert isinstance(planner, L.Callback)
    lightning_trainer(tmp_path, [planner]).fit(module)
    retries = [(e["phase"], e["failed_micro_batch_size"], e["micro_batch_size"])
               for e in read_jsonl(planner.log_path) if e["event"] == "oom_retry"]
    assert retries == [("backward", 4, 2)]
    assert_trained_like_full_batches(module, 16, steps=3, forwarded_twice=True)


def test_refusals_are_lightning_pytorch_misconfiguration_exceptions(tmp_path):
    trainer = lightning_trainer(tmp_path, [MemoryPlanner(make_plan(4, 1)), L.callbacks.GradientAccumulationScheduler({0: 2})])
    with pytest.raises(L.utilities.exceptions.MisconfigurationException, match="remove the GradientAccumulationScheduler"):
        trainer.fit(LRegression())
    module = LRegression()
    module.net["out"].weight.register_hook(lambda grad: grad)
    with pytest.raises(L.utilities.exceptions.MisconfigurationException, match="gradient hooks"):
        lightning_trainer(tmp_path, [MemoryPlanner(make_plan(8, 1))]).fit(module)


@pytest.mark.ddp_scenarios("lightning")
@pytest.mark.slow
def test_an_oom_in_one_ranks_backward_is_retried_under_lightning_pytorch_ddp(ddp_runs):
    out, logs = shared_logs(ddp_runs, "lightning")  # a scenario of the shared 2-rank launch (tests/callback/conftest.py)
    assert retries(logs[1]) == [(0, "backward", 8, 4)] and not retries(logs[0])
    check_trained_like_one_process(out, steps=4)
