"""memplan.config loading a config: the example batch (a datamodule batch resized, or a batch spec), the global
batch, loader hints and optimizer it plans for, the YAML read as LightningCLI's parser reads it, overrides, a 7B
model built only fake, and the heaviest batch of a datamodule whose batch shapes vary (a fixed-shape loader is
scanned only briefly)."""
from __future__ import annotations

import sys
import textwrap
import types

import psutil
import pytorch_lightning as pl
import torch
from config_files import (
    MLP_CONFIG,
    load_text,
    raises_config_error,
    user_module,  # noqa: F401  (a fixture)
)
from torch._subclasses.fake_tensor import FakeTensor

from memplan.demos import RandomVectors
from memplan.estimator.fake import fake_model, new_fake_mode


# --- loading -----------------------------------------------------------------------------------------
def test_example_batch_is_one_datamodule_batch_resized(tmp_path):
    loaded = load_text(tmp_path, MLP_CONFIG)
    dm = RandomVectors(batch_size=4, in_features=20, num_classes=3, num_samples=64)
    dm.setup("fit")
    x_true, y_true = next(iter(dm.train_dataloader()))

    x, y = loaded.example_batch(4)
    assert torch.equal(x, x_true) and torch.equal(y, y_true)
    x3, y3 = loaded.example_batch(3)
    assert torch.equal(x3, x_true[:3]) and torch.equal(y3, y_true[:3])
    x6, _ = loaded.example_batch(6)
    assert torch.equal(x6[4:], x_true[:2])
    assert loaded.data_batch_size == 4 and loaded.batch_size_arg == ("data", "batch_size")
    assert loaded.model.cls.__name__ == "MLP" and loaded.trainer == {"devices": 2, "max_steps": 10}
    assert loaded.raw["seed_everything"] == 7 and loaded.path.name == "config.yaml"


def test_example_batch_from_batch_spec_dict_tuple_and_single_tensor(tmp_path):
    loaded = load_text(tmp_path, """
        model: {class_path: memplan.demos.GPTLM}
        memplan:
          batch_spec:
            input: {shape: [16], dtype: int64, high: 100}
            mask: {shape: [16], dtype: bool}
            pixels: {shape: [3, 4], dtype: bfloat16, low: -1, high: 1}
    """)
    batch = loaded.example_batch(5)
    assert batch["input"].shape == (5, 16) and batch["input"].dtype == torch.int64
    assert 0 <= batch["input"].min() and batch["input"].max() < 100
    assert batch["mask"].dtype == torch.bool and batch["pixels"].dtype == torch.bfloat16
    assert -1 <= batch["pixels"].min() and batch["pixels"].max() < 1
    assert torch.equal(loaded.example_batch(5)["input"], batch["input"])  # deterministic

    pair = load_text(tmp_path, """
        model: {class_path: memplan.demos.MLP}
        memplan: {batch_spec: [{shape: [1000]}, {shape: [], dtype: int64, high: 10}]}
    """).example_batch(3)
    assert isinstance(pair, tuple) and pair[0].shape == (3, 1000) and pair[1].shape == (3,)
    single = load_text(tmp_path, "model: {class_path: memplan.demos.MLP}\nmemplan: {batch_spec: {shape: [7]}}\n")
    assert single.example_batch(2).shape == (2, 7)


def test_batch_spec_is_preferred_over_the_datamodule_and_estimates(tmp_path):
    spec = "memplan:\n  batch_spec: [{shape: [20]}, {shape: [], dtype: int64, high: 3}]\n"
    loaded = load_text(tmp_path, MLP_CONFIG + spec)
    assert "_datamodule_scan" not in vars(loaded)
    est = loaded.estimate(4, device="cpu")
    assert est.batch_size == 4 and est.num_parameters == 20 * 8 + 8 + 8 * 8 + 8 + 8 * 3 + 3
    assert "_datamodule_scan" not in vars(loaded)  # the datamodule never ran


def test_global_batch_size_is_the_setting_else_the_configs_own(tmp_path):
    own = load_text(tmp_path, MLP_CONFIG.replace(
        "devices: 2", "devices: [0, 3]\n  num_nodes: 2\n  accumulate_grad_batches: 4"))
    assert own.trainer_world_size == 4 and own.global_batch_size == 4 * 4 * 4
    assert load_text(tmp_path, MLP_CONFIG.replace("devices: 2", "devices: '0,1,2'")).global_batch_size == 12
    assert load_text(tmp_path, MLP_CONFIG + "memplan: {global_batch_size: 96}\n").global_batch_size == 96
    default_batch = load_text(tmp_path, MLP_CONFIG.replace("batch_size: 4, ", ""))
    assert default_batch.data_batch_size == 256  # the datamodule's signature default


def test_loader_hints_from_init_args_else_the_memplan_section_else_defaults(tmp_path):
    default = load_text(tmp_path, MLP_CONFIG).loader
    assert (default.num_workers, default.pin_memory, default.prefetch_factor) == (0, False, 2)
    hints = "memplan: {num_workers: 6, pin_memory: true, prefetch_factor: 4}\n"
    hinted = load_text(tmp_path, MLP_CONFIG + hints).loader
    assert (hinted.num_workers, hinted.pin_memory, hinted.prefetch_factor) == (6, True, 4)
    given = load_text(tmp_path, MLP_CONFIG.replace("batch_size: 4,", "batch_size: 4, num_workers: 3,")
                      + "memplan: {num_workers: 6}\n").loader
    assert (given.num_workers, given.pin_memory, given.prefetch_factor) == (3, False, 2)


def test_optimizer_is_memplans_override_else_the_optimizer_section_else_the_models(tmp_path):
    assert load_text(tmp_path, MLP_CONFIG).optimizer is None
    section = "optimizer:\n  class_path: torch.optim.AdamW\n  init_args: {lr: 6e-4, betas: [0.9, 0.95]}\n"
    built = load_text(tmp_path, MLP_CONFIG + section).optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(built, torch.optim.AdamW) and built.defaults["lr"] == 6e-4  # 6e-4 is a float, as in LightningCLI
    assert load_text(tmp_path, MLP_CONFIG + "optimizer: SGD\n").optimizer_section.cls is torch.optim.SGD
    assert load_text(tmp_path, MLP_CONFIG + section + "memplan: {optimizer: sgd}\n").optimizer == "sgd"


def test_the_yaml_is_read_as_lightning_clis_parser_reads_it(tmp_path):
    from jsonargparse import get_loader

    text = MLP_CONFIG + "optimizer: {class_path: torch.optim.SGD, init_args: {lr: 1e-3, weight_decay: .5e-4}}\n"
    loaded = load_text(tmp_path, text)
    assert loaded.raw == get_loader("yaml")(textwrap.dedent(text))  # jsonargparse's loader: 1e-3 a float ...
    assert loaded.optimizer_section.init_args == {"lr": 1e-3, "weight_decay": 0.5e-4}
    with raises_config_error("", r"config.yaml holds only a key without a value \(model:\), which LightningCLI reads "
                                 r"as a string, not a config; give it its value"):
        load_text(tmp_path, "model:\n")  # ... and a lone key as a string, which YAML itself would not


def test_overrides_merge_dotted_and_nested_keys(tmp_path):
    loaded = load_text(tmp_path, MLP_CONFIG, overrides={
        "memplan.global_batch_size": 48, "trainer": {"precision": 16}, "data.init_args.batch_size": 2})
    assert loaded.settings.global_batch_size == 48 and loaded.trainer_precision == "16-mixed"
    assert loaded.data_batch_size == 2 and loaded.trainer["devices"] == 2 and loaded.data.init_args["in_features"] == 20


def test_a_7b_config_allocates_no_weights_until_memplan_builds_it_fake(tmp_path, user_module):  # noqa: F811
    built = user_module.CountedGPT.built
    rss_before = psutil.Process().memory_info().rss
    loaded = load_text(tmp_path, """
        model:
          class_path: memplan_test_user.CountedGPT
          init_args: {vocab_size: 32000, context: 4096, d_model: 4096, n_layers: 32, n_heads: 32}
        data:
          class_path: memplan.demos.RandomTokens
          init_args: {batch_size: 1, vocab_size: 32000, context: 4096}
        memplan: {global_batch_size: 64}
    """)
    assert loaded.example_batch(2)[0].shape == (2, 4096) and loaded.global_batch_size == 64
    assert built == []  # loading, batches and settings never build the model

    model = fake_model(loaded.build_model, new_fake_mode(), device=torch.device("cpu"), param_dtype=torch.float32)
    params = list(model.parameters())
    assert len(built) == 1 and all(isinstance(p, FakeTensor) for p in params)
    assert sum(p.numel() for p in params) > 6.5e9  # 26 GB of fp32 weights, had they been allocated
    assert psutil.Process().memory_info().rss - rss_before < 1 << 30


class LongTailTokens(pl.LightningDataModule):
    """Token batches whose length grows in steps: the first 8 tokens a sample, the fifth batch 64 (8x)."""

    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        lengths = [8, 16, 8, 24, 64, 16, 8, 8]
        return torch.utils.data.DataLoader([torch.zeros(n, dtype=torch.long) for n in lengths for _ in range(4)],
                                           batch_size=4, collate_fn=lambda s: (torch.stack(s), torch.stack(s)))


def test_suggest_plans_from_the_heaviest_batch_of_the_datamodule(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "longtail_dm", types.SimpleNamespace(LongTailTokens=LongTailTokens))
    loaded = load_text(tmp_path, """
        model: {class_path: memplan.demos.GPTLM, init_args: {vocab_size: 64, context: 64, d_model: 8, n_layers: 1, n_heads: 1}}
        data: {class_path: longtail_dm.LongTailTokens}
        memplan: {global_batch_size: 4}
    """)
    assert loaded.example_batch(2)[0].shape == (2, 64)  # not the first batch's 8
    assert "every batch of an epoch" in loaded.planned_for and "8.00x the first batch's" in loaded.planned_for
    # suggest's plan is for that batch, and says so
    from memplan.commands.planning import plan_config, resolve_hardware

    plan = plan_config(loaded, resolve_hardware(gpus=1, gpu="A100-80GB", gpu_memory=None))
    assert any("Planned for the heaviest" in r and "(4, 64), (4, 64)" in r for r in plan.reasons), plan.reasons


def test_a_fixed_shape_loader_is_scanned_only_briefly():
    from memplan.batching import batch_size_of
    from memplan.shapes import SAME_SHAPE_STOP, scan

    loader = [(torch.zeros(4, 16), torch.zeros(4, dtype=torch.long))] * 1000
    found = scan(loader, batch_size_of, max_batches=256, seconds=60)
    assert found.scanned == SAME_SHAPE_STOP and found.fixed
    assert found.describe().startswith(f"planned for batches of one shape: the first {SAME_SHAPE_STOP} read")
