"""Plan files know the model and the GPU they were made for: another model is refused, another GPU warned."""
from __future__ import annotations

import json

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from memplan.callback.apply import plan_device_mismatch, plan_model_mismatch
from memplan.demos import MLP, RandomVectors
from memplan.estimator.fake import fake_model, new_fake_mode
from memplan.plan import Plan, model_class_name, model_fingerprint

SMALL = dict(in_features=20, hidden=8, depth=2, num_classes=3)


def plan_for(module, **overrides) -> Plan:
    fields = dict(gpu_name="cpu", gpus=(), nodes=1, world_size=1, micro_batch_size=4, accumulate_grad_batches=2,
                  global_batch_size=8, precision="32-true", gradient_checkpointing=False, strategy="auto",
                  predicted_peak_bytes=1, device_budget_bytes=2, host_bytes_per_rank=3,
                  model_class=model_class_name(module), model_fingerprint=model_fingerprint(module))
    return Plan(**{**fields, **overrides})


def test_the_fingerprint_is_the_same_for_the_fake_model_planned_and_the_real_one_trained():
    fake = fake_model(lambda: MLP(**SMALL), new_fake_mode(), device=torch.device("cpu"), param_dtype=torch.float32)
    real = MLP(**SMALL)
    assert model_fingerprint(fake) == model_fingerprint(real)
    assert model_fingerprint(real.to(torch.bfloat16)) == model_fingerprint(MLP(**SMALL))  # dtypes do not count
    assert model_fingerprint(MLP(**{**SMALL, "hidden": 16})) != model_fingerprint(real)
    assert model_fingerprint(MLP(**{**SMALL, "depth": 3})) != model_fingerprint(real)


def test_a_plan_for_another_model_is_named_as_such():
    plan = plan_for(MLP(**SMALL))
    assert plan_model_mismatch(plan, MLP(**SMALL)) is None
    message = plan_model_mismatch(plan, MLP(**{**SMALL, "hidden": 64}))
    assert "the plan was made for memplan.demos.MLP" in message and "Re-plan" in message
    assert plan_model_mismatch(plan_for(MLP(**SMALL), model_fingerprint=None), torch.nn.Linear(2, 2)) is None


def test_a_plan_for_another_device_is_a_warning_text():
    assert plan_device_mismatch(plan_for(MLP(**SMALL)), torch.device("cpu")) is None
    text = plan_device_mismatch(plan_for(MLP(**SMALL), gpu_name="H100-80GB"), torch.device("cpu"))
    assert text == "the plan is for H100-80GB, this run is on cpu: its memory figures are for the GPU"


def test_the_callback_refuses_a_plan_file_for_another_model(tmp_path):
    from memplan.callback import MemoryPlanner

    path = tmp_path / "other.plan.json"
    path.write_text(json.dumps(plan_for(MLP(**{**SMALL, "hidden": 64})).to_dict()))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[MemoryPlanner(plan=str(path))])
    data = RandomVectors(batch_size=4, in_features=20, num_classes=3, num_samples=16)
    with pytest.raises(MisconfigurationException, match=r"MemoryPlanner\(plan=.*\): the plan was made for "
                                                        r"memplan.demos.MLP .* not this memplan.demos.MLP"):
        trainer.fit(MLP(**SMALL), datamodule=data)


def test_a_config_tells_a_plan_for_another_model(tmp_path):
    import yaml

    from memplan.config import load_config

    path = tmp_path / "config.yaml"
    raw = {"model": {"class_path": "memplan.demos.MLP", "init_args": SMALL},
           "data": {"class_path": "memplan.demos.RandomVectors", "init_args": {"in_features": 20, "num_classes": 3}}}
    path.write_text(yaml.safe_dump(raw))
    loaded = load_config(path)
    assert loaded.plan_mismatch(plan_for(MLP(**SMALL))) is None
    message = loaded.plan_mismatch(plan_for(MLP(**{**SMALL, "depth": 4})), plan_name="--plan p.json")
    assert message.startswith("--plan p.json was made for memplan.demos.MLP, not this config's memplan.demos.MLP")
