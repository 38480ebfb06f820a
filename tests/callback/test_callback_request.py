"""`memplan suggest` and MemoryPlanner ask the planner the same question: one request_for
(memplan.planner.assemble) builds both sides' PlanRequest, so the same model, batch and settings give the
same request, apart from what the callback cannot change (its Trainer's devices and strategy)."""
from __future__ import annotations

import dataclasses
import textwrap

import pytest

from memplan.callback import MemoryPlanner
from memplan.commands import planning
from memplan.config import load_config
from memplan.demos import GPTLM, RandomTokens

MODEL = dict(vocab_size=64, context=16, d_model=32, n_layers=2, n_heads=2, dropout=0.0)
DATA = dict(batch_size=4, vocab_size=64, context=16)


class Captured(Exception):
    """Raised by the stand-in planner with the request it was given: nothing is traced."""


def _capture(request, estimator):
    raise Captured(request)


def test_suggest_and_the_callback_build_the_same_request(make_trainer, tmp_path, monkeypatch):
    module = GPTLM(**MODEL)
    trainer = make_trainer([MemoryPlanner(planner=_capture, margin=0.1)], max_steps=1)
    with pytest.raises(Captured) as asked:
        trainer.fit(module, datamodule=RandomTokens(**DATA))
    callback = asked.value.args[0]

    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(f"""
        trainer: {{devices: 1}}
        model: {{class_path: memplan.demos.GPTLM, init_args: {MODEL}}}
        data: {{class_path: memplan.demos.RandomTokens, init_args: {DATA}}}
    """))
    monkeypatch.setattr(planning, "make_plan", _capture)
    hardware = planning.Hardware(devices=callback.devices, estimate_device="cpu", host_available_bytes=None)
    with pytest.raises(Captured) as asked:
        planning.plan_config(load_config(path), hardware, precisions=("32-true",), margin=callback.margin)
    suggest = asked.value.args[0]

    # what the model and its batch say, read the same way on both sides
    assert (suggest.repeated_blocks, suggest.tokens_per_sample, suggest.allow_checkpointing) == (2, 16, True)
    assert suggest.optimizer_state_bytes > 0 and suggest.parameter_count == callback.parameter_count
    # and all else equal but what the callback's Trainer fixes (its devices, its strategy), the host RAM
    # limit, which on CPU ranks the callback does not apply (their device budget is host RAM already), and
    # the words each side's user knows the settings by
    assert (callback.all_devices, callback.strategies, callback.host_load) == (True, ("ddp",), None)
    assert "MemoryPlanner(allow_checkpointing=True)" in callback.words.allow_checkpointing
    assert "trainer.callbacks[MemoryPlanner].init_args.allow_checkpointing: true" in suggest.words.allow_checkpointing
    assert dataclasses.replace(callback, all_devices=False, strategies=suggest.strategies,
                               host_load=suggest.host_load, words=suggest.words) == suggest


def test_the_callback_s_nofit_names_its_own_settings(make_trainer):
    """NoFit rendered with MemoryPlanner's words: the Trainer's precision, not suggest's flags nor
    PlanRequest's field names."""
    from memplan.planner import NoFit, make_plan
    from memplan.units import GiB
    from tests.test_planner import SimulatedStep

    huge = SimulatedStep(params_bytes=4096 * GiB)  # over any host's RAM, the CPU ranks' device budget

    def planner(request, estimator):
        return make_plan(request, lambda fsdp=None, **setting: huge(**setting))

    with pytest.raises(NoFit) as caught:
        make_trainer([MemoryPlanner(planner=planner)], max_steps=1).fit(GPTLM(**MODEL), datamodule=RandomTokens(**DATA))
    message = str(caught.value)
    assert "Running the Trainer at precision='bf16-mixed' or '16-mixed' would lower what DDP needs." in message
    assert "precisions=(" not in message and "--precision" not in message
