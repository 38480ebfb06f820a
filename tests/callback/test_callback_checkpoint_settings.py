"""MemoryPlanner applies a plan's partial and per-op checkpointing, and training matches a run with the
same checkpointing applied by hand; a model that checkpoints itself is planned as it is."""
from __future__ import annotations

import dataclasses

import pytest
import pytorch_lightning as pl
import torch
from callback_sim import make_plan
from torch.utils.data import DataLoader, TensorDataset

from memplan.callback import MemoryPlanner
from memplan.planner.tracing import model_facts
from memplan.checkpoint_setting import Checkpointing
from memplan.estimator.checkpointing import _WRAPPED, apply_checkpointing
from memplan.plan import Plan

transformers = pytest.importorskip("transformers")


class TinyLlama(pl.LightningModule):
    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size = batch_size
        torch.manual_seed(0)
        self.lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32))  # use_cache left on, as a user has it
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.lm(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        return DataLoader(TensorDataset(torch.randint(0, 64, (16, 12), generator=g)), batch_size=self.batch_size)


def _plan(setting: str) -> Plan:
    return dataclasses.replace(make_plan(4, 1, checkpointing=True), checkpointing=Checkpointing.parse(setting))


def _wrapped(module: TinyLlama) -> list[int]:
    return [i for i, layer in enumerate(module.lm.model.layers) if getattr(layer, _WRAPPED, False)]


@pytest.mark.parametrize(("setting", "blocks"), [("blocks:2", [0, 1]), ("every:2", [1, 3]), ("op", [0, 1, 2, 3])])
def test_the_callback_applies_the_setting_and_trains_as_by_hand(make_trainer, setting, blocks):
    planned = TinyLlama()
    planner = MemoryPlanner(_plan(setting))
    make_trainer([planner], max_steps=3).fit(planned)
    assert _wrapped(planned) == blocks
    per_op = [layer.forward.keywords.get("_memplan_context") is not None
              for layer in planned.lm.model.layers if getattr(layer, _WRAPPED, False)]
    assert all(per_op) if setting == "op" else not any(per_op)
    assert planned.lm.config.use_cache is False

    by_hand = TinyLlama()
    by_hand.lm.config.use_cache = False
    apply_checkpointing(by_hand.lm, setting)
    make_trainer([], max_steps=3).fit(by_hand)
    assert len(planned.losses) == len(by_hand.losses) == 3
    assert planned.losses == pytest.approx(by_hand.losses, rel=1e-5, abs=1e-6)
    assert planned.losses[-1] != pytest.approx(planned.losses[0])  # it trained


def test_an_old_plan_file_reads_as_full_or_none():
    data = make_plan(4, 1, checkpointing=True).to_dict()
    assert data["checkpointing"] == "full"
    del data["checkpointing"]
    assert Plan.from_dict(data).checkpointing == Checkpointing.parse("full")
    data["gradient_checkpointing"] = False
    assert Plan.from_dict(data).checkpointing == Checkpointing.parse("none")
    op = _plan("op").to_dict()
    assert Plan.from_dict(op).checkpointing == Checkpointing.parse("op")
    with pytest.raises(ValueError, match="disagrees with gradient_checkpointing"):
        Plan.from_dict({**op, "gradient_checkpointing": False})


def test_a_model_that_checkpoints_itself_is_kept_and_said():
    module = TinyLlama()
    facts = model_facts(module, allow_checkpointing=True)
    assert (facts["repeated_blocks"], facts["user_checkpointing"], facts["allow_checkpointing"]) == (4, None, True)
    module.lm.gradient_checkpointing_enable()
    facts = model_facts(module, allow_checkpointing=True)
    assert facts["allow_checkpointing"] is False
    assert facts["user_checkpointing"] == "transformers' gradient_checkpointing on 4 modules"
    wrapped = TinyLlama()
    apply_checkpointing(wrapped.lm, "blocks:1")
    assert "memplan's wrapper" in model_facts(wrapped, allow_checkpointing=True)["user_checkpointing"]


def test_a_plan_made_by_the_callback_for_a_self_checkpointing_model_keeps_it(make_trainer):
    module = TinyLlama()
    module.lm.gradient_checkpointing_enable()
    seen = []

    def planner(request, estimator):
        seen.append(request)
        return make_plan(4, 1)

    make_trainer([MemoryPlanner(planner=planner)], max_steps=1).fit(module)
    assert seen[0].user_checkpointing and seen[0].allow_checkpointing is False and seen[0].repeated_blocks == 4


class CheckpointsInForward(pl.LightningModule):
    """Repeated blocks it checkpoints itself with torch.utils.checkpoint inside training_step: no mark on
    its modules, only the trace sees it."""

    def __init__(self, batch_size: int = 8):
        super().__init__()
        self.batch_size = batch_size
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                                              torch.nn.Linear(32, 16)) for _ in range(3))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x.pow(2).mean()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 16)), batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_checkpointing_inside_the_forward_is_found_by_the_trace_and_kept(make_trainer):
    module = CheckpointsInForward()
    assert model_facts(module, allow_checkpointing=True)["user_checkpointing"] is None  # no mark on the modules
    planner = MemoryPlanner()
    make_trainer([planner], max_steps=1).fit(module)
    assert planner.plan.user_checkpointing.startswith("torch.utils.checkpoint called")
    assert planner.plan.checkpointing == Checkpointing.parse("none")
    assert not any(getattr(block, _WRAPPED, False) for block in module.blocks)
