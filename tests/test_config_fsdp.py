"""The planned config of an FSDP plan: ModelParallelStrategy (FSDP2) for a model that shards itself in
configure_model, FSDPStrategy (FSDP1) otherwise; MemoryPlanner kept in both."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from memplan.config import load_config
from memplan.config.write import applies_fully_shard, fsdp_strategy, planner_callback, write_planned_config
from memplan.demos import MLP, GPTLM, LlamaLM
from memplan.plan import Plan
from memplan.units import GiB

ROOT = Path(__file__).resolve().parents[1]
GPT_BLOCK = "memplan.demos._GPTBlock"


def fsdp_plan(**fields) -> Plan:
    values = dict(gpu_name="H100-80GB", gpus=(0, 1, 2, 3, 4, 5, 6, 7), nodes=1, world_size=8, micro_batch_size=4,
                  accumulate_grad_batches=16, global_batch_size=512, precision="bf16-mixed",
                  gradient_checkpointing=True, strategy="fsdp", predicted_peak_bytes=40 * GiB,
                  device_budget_bytes=71 * GiB, host_bytes_per_rank=4 * GiB, sharding_strategy="FULL_SHARD",
                  block_classes=(GPT_BLOCK,))
    return Plan(**{**values, **fields})


def test_only_models_whose_configure_model_calls_fully_shard_shard_themselves():
    assert applies_fully_shard(GPTLM) and applies_fully_shard(LlamaLM)
    assert not applies_fully_shard(MLP)


def test_a_self_sharding_model_gets_model_parallel_strategy_for_full_shard():
    assert fsdp_strategy(fsdp_plan(), GPTLM) == {
        "class_path": "ModelParallelStrategy", "init_args": {"data_parallel_size": 8, "tensor_parallel_size": 1}}


@pytest.mark.parametrize("model, fields", [
    (MLP, {}),  # does not shard itself
    (GPTLM, {"cpu_offload": True}),  # configure_model's fully_shard does not offload
    (GPTLM, {"sharding_strategy": "SHARD_GRAD_OP"}),  # nor keep blocks unsharded after forward
])
def test_otherwise_fsdp_strategy_with_the_planned_settings(model, fields):
    entry = fsdp_strategy(fsdp_plan(**fields), model)
    assert entry["class_path"] == "FSDPStrategy"
    assert entry["init_args"]["sharding_strategy"] == fields.get("sharding_strategy", "FULL_SHARD")
    assert entry["init_args"]["cpu_offload"] == fields.get("cpu_offload", False)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_planned_gpt_config_keeps_memory_planner_and_names_model_parallel_strategy(tmp_path, recwarn):
    loaded = load_config(ROOT / "configs" / "gpt2-small.yaml")
    out = tmp_path / "planned.yaml"
    write_planned_config(loaded, fsdp_plan(), out, callback=planner_callback(tmp_path / "planned.plan.json"))
    trainer = yaml.safe_load(out.read_text())["trainer"]
    assert trainer["strategy"]["class_path"] == "ModelParallelStrategy"
    assert [c["class_path"] for c in trainer["callbacks"]] == ["memplan.MemoryPlanner"]
    assert not [w for w in recwarn if "MemoryPlanner" in str(w.message)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Lightning's use of jsonargparse's old API
def test_planned_model_parallel_config_is_a_lightning_cli_config(tmp_path, monkeypatch, capsys):
    from test_configs_shipped import lightning_cli_print_config

    out = tmp_path / "planned.yaml"
    write_planned_config(load_config(ROOT / "configs" / "gpt2-small.yaml"), fsdp_plan(), out,
                         callback=planner_callback(tmp_path / "planned.plan.json"))

    strategy = yaml.safe_load(lightning_cli_print_config(out, monkeypatch, capsys))["trainer"]["strategy"]
    assert strategy["class_path"].endswith("ModelParallelStrategy")
    assert (strategy["init_args"]["data_parallel_size"], strategy["init_args"]["tensor_parallel_size"]) == (8, 1)
