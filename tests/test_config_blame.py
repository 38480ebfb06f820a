"""A model that fails to build or to run a step on config values that do not fit together is reported
against those keys, as the user wrote them, with the fix (memplan.config.blame), not as an aten error."""
from __future__ import annotations

import sys
import textwrap
import types

import pytest
import pytorch_lightning as pl
import torch

from memplan.config import ConfigError, load_config
from memplan.config.blame import blame, int_values

GPT = """
trainer: {devices: 1}
model:
  class_path: memplan.demos.GPTLM
  init_args: {vocab_size: 128, context: 16, d_model: 100, n_layers: 1, n_heads: 3}
data:
  class_path: memplan.demos.RandomTokens
  init_args: {batch_size: 2, vocab_size: 128, context: 16}
memplan: {global_batch_size: 4}
"""


def load(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return load_config(path)


def test_heads_that_do_not_divide_the_width_are_named_not_the_aten_view(tmp_path):
    loaded = load(tmp_path, GPT)
    with pytest.raises(ConfigError) as caught:
        loaded.estimate(2, device="cpu")
    message = str(caught.value)
    assert caught.value.key == "model.init_args.n_heads"
    assert message.startswith("model.init_args.n_heads (3) does not divide model.init_args.d_model (100): "
                              "memplan.demos.GPTLM's training step failed: the op aten.view")
    assert message.endswith("set model.init_args.n_heads to a divisor of 100 (2, 4, 5) or model.init_args.d_model "
                            "to a multiple of 3")
    assert "\n" not in message


@pytest.fixture
def hf_module(monkeypatch):
    """`memplan_test_hf.HFCausalLM(config: dict)`: a transformers Llama built from a config mapping."""
    transformers = pytest.importorskip("transformers")
    module = types.ModuleType("memplan_test_hf")

    class HFCausalLM(pl.LightningModule):
        def __init__(self, config: dict):
            super().__init__()
            self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            return self.model(input_ids=tokens, labels=targets).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    HFCausalLM.__module__ = module.__name__
    module.HFCausalLM = HFCausalLM
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_a_transformers_config_is_named_by_its_nested_key(tmp_path, hf_module):
    loaded = load(tmp_path, """
        trainer: {devices: 1}
        model:
          class_path: memplan_test_hf.HFCausalLM
          init_args:
            config: {vocab_size: 128, hidden_size: 100, intermediate_size: 64, num_hidden_layers: 1,
                     num_attention_heads: 3, num_key_value_heads: 3}
        data:
          class_path: memplan.demos.RandomTokens
          init_args: {batch_size: 2, vocab_size: 128, context: 16}
        memplan: {global_batch_size: 4}
        """)
    with pytest.raises(ConfigError) as caught:
        loaded.estimate(2, device="cpu")
    assert caught.value.key == "model.init_args.config.num_attention_heads"
    assert str(caught.value).startswith("model.init_args.config.num_attention_heads (3) does not divide "
                                        "model.init_args.config.hidden_size (100): memplan_test_hf.HFCausalLM")
    assert "set model.init_args.config.num_attention_heads to a divisor of 100" in str(caught.value)


def test_values_are_blamed_only_on_evidence():
    values = list(int_values({"init_args": {"width": 100, "heads": 3, "layers": 16, "batch": 2}}, "model"))
    assert values[0] == ("model.init_args.width", 100)
    view = "the op aten.view.default(float32[2, 16, 100]) failed (RuntimeError: shape '[2, 16, 3, 33]' is invalid)"
    assert blame(view, values).keys == ("model.init_args.heads", "model.init_args.width")
    # the same numbers, without a quotient or words about dividing: no blame
    assert blame("RuntimeError: expected 3 dims, got a tensor of [2, 16, 100]", values) is None
    assert blame("index 7 is out of bounds", values) is None
    small = [("data.init_args.batch_size", 2), ("model.init_args.num_classes", 3)]
    assert blame("Expected input batch_size (2) to match target batch_size (3) at dim 1", small, by_name=False) is None
    named = blame("RuntimeError: the width must be even", values)
    assert named is not None and named.keys == ("model.init_args.width",)


def test_a_failure_is_blamed_from_its_fields_not_its_wording():
    """memplan.config reads what failed from the EstimateError's fields: a message worded otherwise (no
    'batch:' or 'model:' prefix, no 'raised ') is blamed all the same."""
    from memplan.config.blame import estimate_blame
    from memplan.estimator import EstimateError

    raw = {"model": {"init_args": {"d_model": 100, "n_heads": 3}}, "data": {"init_args": {"batch_size": 2}}}
    common = dict(raw=raw, model_class="pkg.Model", init_args=raw["model"]["init_args"], batch_spec_key=None)
    batch = EstimateError("worded any way", argument="batch", detail="the training step could not take this batch "
                          "(KeyError: 'y')")
    found = estimate_blame(batch, **common)
    assert found.key == "data"
    assert str(found) == ("data and model.init_args do not work together: pkg.Model's training step failed on a batch "
                          "from data: the training step could not take this batch (KeyError: 'y'); check "
                          "model.init_args (the model's own sizes) and that data.init_args agree with it")
    spec_key = "trainer.callbacks[1].init_args.suggest.batch_spec"  # where the config writes its batch_spec
    found = estimate_blame(batch, **{**common, "batch_spec_key": spec_key})
    assert found.key == spec_key and str(found).startswith(f"{spec_key} and model.init_args do not work together")
    assert f"that {spec_key} describes the batch exactly" in str(found)
    built = EstimateError("worded any way", argument="model", stage="build", detail="worded any way",
                          cause="ValueError: the hidden size (100) is not a multiple of the heads (3)")
    found = estimate_blame(built, **common)
    assert found.key == "model.init_args.n_heads" and "does not divide model.init_args.d_model (100)" in str(found)
    assert estimate_blame(EstimateError("loss: worded any way", argument="loss", detail="x"), **common) is None
