"""Apply: a plan (object or file) or a plan made now from an estimate, set on the running Trainer."""
from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
from callback_sim import IndexedData, Regression, make_plan
from pytorch_lightning.callbacks import GradientAccumulationScheduler
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader

from memplan.callback import MemoryPlanner
from memplan.callback.apply import enable_checkpointing
from memplan.callback.checks import check_can_adjust, guard_blocker
from memplan.hardware import host_info
from memplan.plan import Plan
from memplan.planner import NoFit, PlanRequest


def test_a_plan_sets_the_batch_size_attribute_accumulation_and_checkpointing(make_trainer):
    module = Regression(batch_size=32)
    planner = MemoryPlanner(make_plan(4, 3, checkpointing=True))
    trainer = make_trainer([planner], max_steps=2)
    trainer.fit(module)
    assert module.batch_size == 4 and trainer.accumulate_grad_batches == 3
    assert {len(s) for s in module.seen} == {4}  # the loader was built with the new size: no chunking
    assert all(block._memplan_checkpointed for block in module.net["blocks"])
    assert planner.plan.micro_batch_size == 4
    assert (planner.layout.loader_batch_size, planner.layout.micro_batch_size, planner.layout.global_batch_size) == (4, 4, 12)


def test_a_plan_file_is_read_and_the_datamodule_batch_size_set(make_trainer, tmp_path):
    class Data(pl.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 16

        def train_dataloader(self):
            return DataLoader(IndexedData(), batch_size=self.batch_size)

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(make_plan(2, 5).to_dict()))
    module, data = Regression(with_attr=False), Data()
    trainer = make_trainer([MemoryPlanner(str(path))], max_steps=1)
    trainer.fit(module, datamodule=data)
    assert data.batch_size == 2 and trainer.accumulate_grad_batches == 5
    assert {len(s) for s in module.seen} == {2}


def test_a_plan_for_another_precision_or_world_size_warns_and_keeps_the_global_batch(make_trainer):
    plan = make_plan(4, 2, world_size=2, precision="bf16-mixed")  # global batch 16 on 2 ranks
    module = Regression(batch_size=8)
    trainer = make_trainer([MemoryPlanner(plan)], max_steps=1)
    with pytest.warns(UserWarning) as caught:
        trainer.fit(module)
    messages = [str(w.message) for w in caught if "MemoryPlanner" in str(w.message)]
    assert any("precision='bf16-mixed'" in m and "'32-true'" in m for m in messages)
    assert any("2 ranks, the Trainer runs 1 rank(s)" in m and "Trainer(num_nodes=1, devices=2)" in m for m in messages)
    assert module.batch_size == 4 and trainer.accumulate_grad_batches == 4  # 4 x 1 x 4 = 16


def test_a_mismatching_plan_is_an_error_when_strict(make_trainer):
    trainer = make_trainer([MemoryPlanner(make_plan(4, 2, precision="16-mixed"), strict=True)], max_steps=1)
    with pytest.raises(MisconfigurationException, match=r"strict=True.*Trainer\(precision='16-mixed'\)"):
        trainer.fit(Regression())


def test_a_missing_plan_file_names_the_command_that_writes_one(make_trainer, tmp_path):
    trainer = make_trainer([MemoryPlanner(tmp_path / "nope.json")], max_steps=1)
    with pytest.raises(MisconfigurationException, match="memplan suggest"):
        trainer.fit(Regression())


def test_without_a_plan_the_planner_gets_host_budgets_and_a_working_cpu_estimator(make_trainer):
    calls = []

    def stand_in_planner(request: PlanRequest, estimator) -> Plan:  # the test's own planner
        estimates = {size: estimator(micro_batch_size=size, precision="32-true", checkpointing=False, world_size=1)
                     for size in (2, 8)}
        calls.append((request, estimates))
        return make_plan(4, request.global_batch_size // 4)

    module = Regression(batch_size=8)
    planner = MemoryPlanner(planner=stand_in_planner)
    trainer = make_trainer([planner], max_steps=1, accumulate_grad_batches=2)
    trainer.fit(module)
    ((request, estimates),) = calls
    assert request.global_batch_size == 16 and request.nodes == 1 and request.precisions == ("32-true",)
    assert request.margin == 0.10 and request.allow_checkpointing  # plans keep twice the runtime margin
    (budget,) = request.devices
    assert budget.name == "cpu" and budget.cuda_index is None
    assert budget.total_bytes <= host_info().total_bytes and 0 < budget.free_bytes <= budget.total_bytes
    assert estimates[2].device == "cpu" and estimates[2].batch_size == 2 and estimates[8].batch_size == 8
    assert estimates[8].activations > estimates[2].activations
    assert module.batch_size == 4 and trainer.accumulate_grad_batches == 4
    assert planner.plan.micro_batch_size == 4


def test_without_a_plan_memplans_planner_plans_on_the_host_and_the_plan_is_applied(make_trainer):
    module = Regression(batch_size=8)
    planner = MemoryPlanner()
    trainer = make_trainer([planner], max_steps=2, accumulate_grad_batches=3)
    trainer.fit(module)
    plan = planner.plan
    assert plan.global_batch_size == 24 and plan.world_size == 1 and plan.precision == "32-true"
    assert plan.micro_batch_size == 24  # a tiny model: the whole batch fits in host RAM
    assert module.batch_size == plan.micro_batch_size and trainer.accumulate_grad_batches == 1
    assert {len(s) for s in module.seen} == {24}


def test_a_given_global_batch_size_reaches_the_planner(make_trainer):
    seen = []
    planner = MemoryPlanner(global_batch_size=32, planner=lambda r, e: seen.append(r) or make_plan(8, 4))
    make_trainer([planner], max_steps=1).fit(Regression(batch_size=8))
    assert seen[0].global_batch_size == 32


def test_a_planner_that_finds_nothing_ends_the_fit_with_its_own_error(make_trainer):
    def nothing_fits(request, estimator):
        raise NoFit("Nothing fits: a test planner", ddp_needed_bytes_per_gpu=2, fsdp_needed_bytes_per_gpu=1,
                    budget_bytes_per_gpu=0)

    with pytest.raises(NoFit, match="a test planner"):
        make_trainer([MemoryPlanner(planner=nothing_fits)], max_steps=1).fit(Regression())


def test_a_precision_the_planner_does_not_search_is_refused_with_the_fix(make_trainer):
    trainer = make_trainer([MemoryPlanner()], max_steps=1, precision="bf16-true")
    with pytest.raises(MisconfigurationException, match=r"the Trainer runs 'bf16-true'.*pass plan="):
        trainer.fit(Regression())


def test_checkpointing_uses_the_models_own_switch_where_it_has_one():
    class HasSwitch(nn.Module):  # the shape of transformers' PreTrainedModel switch
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
            self.kwargs = None

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.kwargs = gradient_checkpointing_kwargs

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = HasSwitch()
            self.head = nn.Linear(2, 1)

    model = Outer()
    assert enable_checkpointing(model) == ["backbone"]
    assert model.backbone.kwargs == {"use_reentrant": False}
    assert not getattr(model.backbone.layers[0], "_memplan_checkpointed", False)


def test_checkpointing_a_transformers_model_through_its_switch():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.ModuleDict({"lm": transformers.GPT2LMHeadModel(config)})
        assert enable_checkpointing(model) == ["lm"]
        assert model["lm"].is_gradient_checkpointing


def test_setup_refuses_what_it_cannot_do_with_the_fix(make_trainer):
    trainer = make_trainer([MemoryPlanner(make_plan(4, 1)), GradientAccumulationScheduler({0: 2})])
    with pytest.raises(MisconfigurationException, match="remove the GradientAccumulationScheduler"):
        trainer.fit(Regression())

    class Manual(Regression):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            self.optimizers().zero_grad()
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            self.optimizers().step()

    # adjusting is declined with the reason (tests/callback/test_callback_manual.py), the plan applied
    # (exact=False: the plan's smaller batch, which without accumulation changes each optimizer step's,
    # is allowed; tests/callback/test_callback_manual.py has the default's refusal)
    with pytest.warns(UserWarning, match=r"does not adjust micro-batches under manual optimization.*adjust=False"):
        make_trainer([MemoryPlanner(make_plan(4, 1), exact=False)], max_steps=1).fit(Manual())
    module = Manual()
    make_trainer([MemoryPlanner(make_plan(4, 1), adjust=False, exact=False)], max_steps=1).fit(module)
    assert module.batch_size == 4
    # without adjusting, a batch the loader will not shrink still runs as micro-batches inside
    # training_step, which needs what adjusting needs; the fix is a loader that yields the micro-batch
    with pytest.raises(MisconfigurationException, match=r"under manual optimization training_step runs its own backwards"):
        make_trainer([MemoryPlanner(make_plan(4, 2), adjust=False)], max_steps=1).fit(Manual(with_attr=False))


def test_gradient_hooks_on_parameters_are_refused_with_the_fix(make_trainer):
    # micro-batches hand their gradients over in one backward: a hook would run per micro-batch and again
    module = Regression()
    module.net["out"].weight.register_hook(lambda grad: grad * 0.5)
    with pytest.raises(MisconfigurationException, match=r"gradient hooks .* net\.out\.weight would run .*adjust=False"):
        make_trainer([MemoryPlanner(make_plan(8, 1))], max_steps=1).fit(module)
    # watching only, with a loader that yields the micro-batch: nothing runs inside training_step
    make_trainer([MemoryPlanner(make_plan(8, 1), adjust=False)], max_steps=1).fit(module)
    assert "training_step" not in module.__dict__


def test_ddp_settings_a_guarded_step_cannot_work_with_are_named():
    def trainer(**ddp_kwargs):  # only what the checks read: the strategy, with no process group
        return SimpleNamespace(strategy=DDPStrategy(**ddp_kwargs))

    with pytest.raises(MisconfigurationException, match=r"static_graph=True .* skips the all-reduce"):
        check_can_adjust(trainer(static_graph=True), Regression())
    check_can_adjust(trainer(), Regression())
    assert guard_blocker(trainer(), "always") is None
    assert "gradient_as_bucket_view=True" in guard_blocker(trainer(gradient_as_bucket_view=True), "auto")
    with pytest.raises(MisconfigurationException, match=r"guard='always'\) cannot guard backwards"):
        guard_blocker(trainer(gradient_as_bucket_view=True), "always")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"margin": 1.5}, r"margin=\.\.\.\) is a fraction"),
    ({"margin": "0.1"}, r"margin=\.\.\.\) is a fraction of device memory, a number; got '0.1'"),
    ({"grow_margin": "0.3"}, r"grow_margin=\.\.\.\) is a fraction of device memory, a number; got '0.3'"),
    ({"log_dir": 123}, r"log_dir=\.\.\.\) must be a folder path"),
    ({"every_n_steps": 0}, r"every_n_steps=\.\.\.\) must be a positive int"),
    ({"grow_margin": 0.01}, r"grow_margin=\.\.\.\) must be in \(margin, 1\]"),
    ({"plan": 3}, r"plan=\.\.\.\) must be a memplan Plan or a plan file path"),
    ({"guard": "sometimes"}, r"guard=\.\.\.\) must be 'auto' or 'always'"),
])
def test_arguments_are_checked_at_once(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryPlanner(**kwargs)


def test_checkpointing_is_refused_where_the_model_has_nothing_to_checkpoint(make_trainer):
    class Flat(Regression):
        def __init__(self):
            super().__init__()
            self.net["blocks"] = nn.Identity()

    with pytest.raises(MisconfigurationException, match="cannot turn checkpointing on"):
        make_trainer([MemoryPlanner(make_plan(4, 1, checkpointing=True))], max_steps=1).fit(Flat())


def test_a_loader_passed_to_fit_keeps_its_batch_and_runs_as_chunks(make_trainer):
    module = Regression(batch_size=8)  # has the attribute, but fit gets the loader: setting it would do nothing
    trainer = make_trainer([MemoryPlanner(make_plan(4, 4))], max_steps=2)
    trainer.fit(module, DataLoader(IndexedData(), batch_size=8))
    assert module.batch_size == 8 and trainer.accumulate_grad_batches == 2  # 16 = 8 x 1 x 2
    assert {len(s) for s in module.seen} == {4}


def test_a_loader_that_ignores_the_batch_size_attribute_is_noticed_at_fit_start(make_trainer, caplog):
    # the attribute says 8, the loader yields 16 whatever it says: MemoryPlanner keeps the loader's 16 and
    # splits it (before, it set the attribute to 4 and raised the accumulation, so each step took 2 x 16)
    class FixedLoader(Regression):
        def train_dataloader(self):
            return DataLoader(IndexedData(), batch_size=16)

    module = FixedLoader(batch_size=8)
    planner = MemoryPlanner(make_plan(4, 4))
    trainer = make_trainer([planner], max_steps=1)
    with caplog.at_level(logging.INFO):
        trainer.fit(module)
    assert "does not take its batch size from `batch_size` (it yields batches of 16 whatever" in caplog.text
    assert module.batch_size == 8 and trainer.accumulate_grad_batches == 1
    assert planner.layout.loader_batch_size == 16 and {len(s) for s in module.seen} == {4}
    with pytest.raises(MisconfigurationException, match="global batch of 8 is not a multiple of the loader batch 16"):
        make_trainer([MemoryPlanner(make_plan(4, 2))], max_steps=1).fit(FixedLoader(batch_size=8))


def test_a_callback_reused_for_another_fit_starts_afresh(make_trainer):
    # a fit under manual optimization declines adjusting for itself only: the settings stay as given, and
    # the next fit (another model, automatic optimization) adjusts and retries an OOM
    from callback_sim import SimulatedBudget
    from gan_sim import TinyGAN

    planner = MemoryPlanner(make_plan(16, 1), exact=False)
    with pytest.warns(UserWarning, match="does not adjust micro-batches under manual optimization"):
        make_trainer([planner], max_steps=2).fit(TinyGAN(batch_size=16))
    assert planner.settings.adjust is True and planner.layout.micro_batch_size == 16
    budget = SimulatedBudget(forward_limit=3)  # SIMULATED: more than 3 samples in a forward run out of memory
    make_trainer([planner], max_steps=2).fit(Regression(batch_size=8, budget=budget))
    assert budget.raised >= 1 and planner.layout.global_batch_size == 16 and planner.exactness.can_split
    with pytest.raises(dataclasses.FrozenInstanceError):
        planner.settings.adjust = False


def test_a_plan_path_that_is_not_a_file_is_refused_by_name(tmp_path):
    # a FIFO (or /dev/zero) as plan= is refused, never read until memory runs out
    import os

    from memplan.callback.apply import load_plan

    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    with pytest.raises(MisconfigurationException, match=r"MemoryPlanner\(plan=.*is a FIFO.*not a regular file"):
        load_plan(fifo)
    with pytest.raises(MisconfigurationException, match="not a regular file"):
        load_plan("/dev/zero")


TRACED: list[int] = []
"""The batch size of every training_step memplan's planning traces ran (on its fake copy of the module)."""


class CountsTraces(Regression):
    def training_step(self, batch, batch_idx):
        from callback_sim import tracing

        if tracing(self):
            TRACED.append(len(batch[0]))
        return super().training_step(batch, batch_idx)


def test_planning_runs_training_step_as_few_times_as_the_plan_needs(make_trainer):
    # the loader's batch of 8 fits whole with room to spare: one trace (two steps: the second with the optimizer's
    # state) is the plan; before, the search traced micro-batches 1 and 4 as well (6 runs of training_step)
    TRACED.clear()
    module = CountsTraces(batch_size=8)
    planner = MemoryPlanner(grow=False)
    make_trainer([planner], max_steps=2).fit(module)
    assert TRACED == [8, 8]
    assert (planner.plan.micro_batch_size, planner.plan.gradient_checkpointing) == (8, False)
    assert len(module.seen) == 2  # the training itself ran as without MemoryPlanner
