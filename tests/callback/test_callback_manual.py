"""Manual optimization (automatic_optimization=False): the estimate traces the user's own
training_step, with its manual_backward and both optimizers' steps; MemoryPlanner plans, applies and
watches, and says what it does not adjust; the global batch is what each optimizer step sees."""
from __future__ import annotations

import pytest
import torch
from gan_sim import TinyGAN
from callback_sim import make_plan

import memplan
from memplan.callback import MemoryPlanner
from memplan.callback.framework import MisconfigurationException


def test_the_estimate_traces_the_manual_step_with_every_optimizer():
    module = TinyGAN()
    batch = next(iter(module.train_dataloader()))
    estimate = memplan.estimate(module, batch)
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    generator_bytes = sum(p.numel() * p.element_size() for p in module.generator.parameters())
    assert estimate.parameters >= param_bytes
    # Adam keeps two moments per parameter of both models: both optimizers' states were traced (the
    # first optimizer alone would hold 2 x the generator's)
    assert estimate.optimizer_state >= 2 * param_bytes > 2 * generator_bytes
    assert estimate.peak_allocated >= estimate.parameters + estimate.optimizer_state
    assert estimate.batch_size == 16


def test_a_module_with_one_optimizer_gets_it_alone_from_self_optimizers():
    # Lightning's `self.optimizers()` returns a lone optimizer itself (not a one-item list): the common
    # single-optimizer manual step `opt = self.optimizers(); opt.zero_grad(); ...; opt.step()` estimates
    class OneOptimizer(TinyGAN):
        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            (real,) = batch
            opt.zero_grad()
            self.manual_backward(self.discriminator(real).square().mean())
            opt.step()

        def configure_optimizers(self):
            return torch.optim.Adam(self.discriminator.parameters())

    module = OneOptimizer()
    estimate = memplan.estimate(module, next(iter(module.train_dataloader())))
    param_bytes = sum(p.numel() * p.element_size() for p in module.discriminator.parameters())
    assert estimate.optimizer_state >= 2 * param_bytes  # Adam's two moments: the step was traced


def test_a_trainer_attribute_the_estimate_cannot_stand_in_for_is_named():
    class ReadsTrainer(TinyGAN):
        def training_step(self, batch, batch_idx):
            if self.trainer.fit_loop is not None:
                return super().training_step(batch, batch_idx)

    module = ReadsTrainer()
    with pytest.raises(memplan.EstimateError, match=r"self\.trainer\.fit_loop"):
        memplan.estimate(module, next(iter(module.train_dataloader())))


def test_planning_applying_and_watching_work_and_adjusting_is_declined_with_a_warning(make_trainer):
    module = TinyGAN(batch_size=16)
    planner = MemoryPlanner()  # adjust=True by default: declined, with the reason
    with pytest.warns(UserWarning, match="does not adjust micro-batches under manual optimization"):
        make_trainer([planner], max_steps=4, log_every_n_steps=1).fit(module)
    assert planner.plan is not None and planner.plan.global_batch_size == 16
    assert planner.layout.accumulate_grad_batches == 1 and planner.layout.global_batch_size == 16
    assert module.step_batches == [16] * 4  # max_steps counts both optimizers' steps: 2 batches
    samples = [line for line in planner.log_path.read_text().splitlines() if '"sample"' in line]
    assert samples  # watched


def test_a_plan_that_accumulates_is_refused_by_default_and_applied_without_accumulation_when_allowed(make_trainer):
    # Lightning accumulates nothing under manual optimization: the plan's 8 x 4 would make each optimizer
    # step see 8 samples instead of the 16 the user's loader gives
    with pytest.raises(MisconfigurationException, match=r"from 16 to 8: under manual optimization Lightning "
                                                        r"accumulates nothing.*MemoryPlanner\(exact=False\)"):
        make_trainer([MemoryPlanner(make_plan(8, 4), adjust=False)], max_steps=2).fit(TinyGAN(batch_size=16))
    module = TinyGAN(batch_size=16)
    planner = MemoryPlanner(make_plan(8, 4), adjust=False, exact=False)  # global batch 32: 8 x 4 batches
    with pytest.warns(UserWarning, match="which Lightning does not accumulate under manual optimization: each "
                                         "optimizer step sees one loaded batch per rank, 8 x 1 rank"):
        make_trainer([planner], max_steps=2).fit(module)
    assert module.batch_size == 8 and set(module.step_batches) == {8}
    assert planner.layout.global_batch_size == 8 and planner.layout.accumulate_grad_batches == 1


def test_a_plan_that_splits_batches_is_refused_with_the_fix(make_trainer):
    # a plan keeping the global batch of 64 as 16 x 4 would shrink each optimizer step's batch to 16: refused
    module = TinyGAN(batch_size=16, with_attr=False)  # the loader keeps 16: chunks of 8 would be needed
    with pytest.raises(MisconfigurationException, match="under manual optimization training_step runs its own "
                                                        "backwards and optimizer steps, so a batch cannot be split"):
        make_trainer([MemoryPlanner(make_plan(8, 2), adjust=False)], max_steps=2).fit(module)
    module = TinyGAN(batch_size=16)
    with pytest.raises(MisconfigurationException, match=r"exact=False"):
        make_trainer([MemoryPlanner(make_plan(8, 2), adjust=False)], max_steps=2).fit(module)
    assert module.batch_size == 16  # the user's batch untouched
