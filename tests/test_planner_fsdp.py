"""The planner with FSDP: DDP against FSDP's layouts, the communication cost model, the planned config.

A simulated step stands in for memplan.estimate: per rank, the training state (fp32 parameters,
gradients, Adam's two states: 4 x params) is sharded over the FSDP shard degree (none of it on the GPU
with CPU offload), two blocks are gathered at once (SHARD_GRAD_OP keeps all of them gathered from forward
to backward), activations grow with the micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from memplan.estimator.result import MemoryEstimate
from memplan.hardware import lookup_gpu
from memplan.hardware.catalog import gpu_links
from memplan.planner import DeviceBudget, NoFit, PlanRequest, make_plan
from memplan.planner import costs
from memplan.planner.costs import OVERLAP, Collectives, StepSetting, communication_seconds, predict_step
from memplan.planner.profile import CostProfile
from memplan.units import GiB, MiB

CONTEXT = 640 * MiB
BLOCKS = 32


@dataclass
class ShardedStep:
    params: int = 7_000_000_000
    activation_bytes_per_sample: int = 3 * GiB
    calls: list = field(default_factory=list)

    def __call__(self, *, micro_batch_size, precision, checkpointing, world_size, fsdp=None):
        self.calls.append((micro_batch_size, checkpointing, world_size, fsdp))
        weights = 4 * self.params
        act = self.activation_bytes_per_sample * micro_batch_size // (4 if checkpointing else 1)
        if fsdp is None:
            state = 4 * weights + (weights if world_size > 1 else 0)  # + DDP's buckets
            gathered = 0
        else:
            shard = fsdp.shard_size or world_size
            state = 0 if fsdp.cpu_offload else -(-4 * weights // shard)
            gathered = weights if fsdp.sharding_strategy == "SHARD_GRAD_OP" else 2 * weights // BLOCKS
        total = state + gathered + act
        return MemoryEstimate(
            parameters=state // 4, gradients=state // 4, optimizer_state=state // 2, activations=act,
            temporaries=gathered, batch=0, peak_allocated=total, peak_reserved=total,
            device_total=total + CONTEXT, cuda_context=CONTEXT, device="H100-80GB", precision=precision,
            checkpointing=checkpointing, strategy="fsdp" if fsdp else ("ddp" if world_size > 1 else None),
            world_size=world_size, forward_activations=act, batch_size=micro_batch_size)


def h100s(count: int) -> tuple[DeviceBudget, ...]:
    return (DeviceBudget.from_catalog(lookup_gpu("H100-80GB")),) * count


def request(**kwargs) -> PlanRequest:
    base = dict(global_batch_size=256, devices=h100s(8), precisions=("bf16-mixed",), parameter_count=7_000_000_000,
                tokens_per_sample=4096, block_classes=("transformers.models.llama.modeling_llama.LlamaDecoderLayer",))
    return PlanRequest(**{**base, **kwargs})


def test_a_7b_model_that_ddp_cannot_fit_is_planned_with_fsdp_full_shard():
    sim = ShardedStep()
    plan = make_plan(request(), sim)
    assert plan.strategy == "fsdp" and plan.sharding_strategy == "FULL_SHARD" and not plan.cpu_offload
    assert plan.micro_batch_size * plan.world_size * plan.accumulate_grad_batches == 256
    assert plan.predicted_peak_bytes <= plan.device_budget_bytes
    assert any(r.startswith("DDP does not fit") for r in plan.reasons)
    assert plan.block_classes == ("transformers.models.llama.modeling_llama.LlamaDecoderLayer",)
    fsdp_calls = [c for c in sim.calls if c[3] is not None]
    assert fsdp_calls and all(c[2] == 8 for c in fsdp_calls)  # FSDP traced at its own world size


def test_a_model_ddp_fits_stays_on_ddp():
    plan = make_plan(request(parameter_count=100_000_000), ShardedStep(params=100_000_000))
    assert plan.strategy == "ddp" and plan.sharding_strategy is None


def test_without_a_parameter_count_fsdp_is_not_searched_and_nofit_says_what_it_would_need():
    with pytest.raises(NoFit, match="FSDP full shard across 8 GPUs would need about"):
        make_plan(request(parameter_count=None), ShardedStep())


def test_multi_node_shards_within_a_node_when_that_fits(monkeypatch):
    # A 20B model (SHARD_GRAD_OP's gathered 80 GB do not fit), a slow network (100 Gb/s per GPU) and
    # micro-batch 1 on 64 ranks: too little compute to hide FULL_SHARD's gathers between nodes, so the
    # layout that keeps its all-gathers inside the node wins.
    monkeypatch.setattr(costs, "INTER_NODE_BYTES_PER_S", 12.5e9)
    plan = make_plan(request(nodes=8, global_batch_size=64, parameter_count=20 * 10**9),
                     ShardedStep(params=20 * 10**9))
    assert plan.strategy == "fsdp" and plan.sharding_strategy == "HYBRID_SHARD"
    assert plan.world_size == 64 and plan.gpus_per_node == 8


def test_offload_is_the_last_resort_and_needs_the_host_ram():
    # 70B-class: the sharded state alone (16 B x 70e9 / 8 = 130 GiB) is over an H100 on one node.
    big = ShardedStep(params=70_000_000_000, activation_bytes_per_sample=1 * GiB)
    plan = make_plan(request(parameter_count=70_000_000_000), big)
    assert plan.strategy == "fsdp" and plan.cpu_offload
    with pytest.raises(NoFit, match=r"FSDP with CPU offload \(allow_cpu_offload\) keeps .* 8 ranks per node need "
                                    r"[0-9.]+ [GT]iB, over the 230.40 GiB host budget; add nodes"):
        make_plan(request(parameter_count=70_000_000_000, host_available_bytes=256 * GiB), big)


def test_full_shard_moves_one_and_a_half_times_ddps_bytes():
    def seconds(sharding):
        ranks = Collectives(sharding=sharding, world_size=8, gpus_per_node=8, nodes=1, gpu_name="H100-80GB")
        return communication_seconds(ranks, parameter_count=10**9, accumulate_grad_batches=1)

    ddp = seconds(None)
    assert seconds("FULL_SHARD") == pytest.approx(1.5 * ddp)
    assert seconds("SHARD_GRAD_OP") == pytest.approx(ddp)
    ring = 2 * 7 / 8 * 4e9 / (gpu_links("H100-80GB").intra_node_bytes_per_s * 0.7)
    assert ddp == pytest.approx(ring)


def test_fsdp_pays_for_its_communication_only_when_compute_cannot_hide_it(monkeypatch):
    profile = CostProfile.from_parameters(7 * 10**9, tokens_per_sample=4096)
    block = 4 * 7 * 10**9 // BLOCKS
    args = dict(offload=False, gpus_per_node=8, micro_batch_size=1, accumulate_grad_batches=4, precision="bf16-mixed",
                checkpointing=True, gpu_name="H100-80GB", largest_block_bytes=block)
    one_node = predict_step(profile, StepSetting(sharding="FULL_SHARD", world_size=8, nodes=1, **args))
    # Inside a node the micro-step's compute could hide it all: what shows is the first block's all-gather
    # or the share of every collective that contends with compute, whichever is larger.
    first = 7 / 8 * block / (450e9 * 0.7)
    comm = communication_seconds(Collectives(sharding="FULL_SHARD", world_size=8, gpus_per_node=8, nodes=1,
                                             gpu_name="H100-80GB"), parameter_count=7 * 10**9, accumulate_grad_batches=1)
    assert comm < OVERLAP * one_node.micro_step_seconds
    assert one_node.communication_seconds == pytest.approx(4 * max(first, (1 - OVERLAP) * comm))
    # Between nodes a ring runs at the node's NICs together (8 x 400 Gb/s): FULL_SHARD over 64 ranks
    # hides about as well as inside the node; HYBRID_SHARD all-reduces each GPU's shard over its own NIC.
    across = predict_step(profile, StepSetting(sharding="FULL_SHARD", world_size=64, nodes=8, **args))
    hybrid = predict_step(profile, StepSetting(sharding="HYBRID_SHARD", world_size=64, nodes=8, **args))
    assert hybrid.communication_seconds > across.communication_seconds >= one_node.communication_seconds
    # A slow network (100 Gb/s per GPU) turns it around: gathers between nodes cost more than the shard's all-reduce.
    monkeypatch.setattr(costs, "INTER_NODE_BYTES_PER_S", 12.5e9)
    across = predict_step(profile, StepSetting(sharding="FULL_SHARD", world_size=64, nodes=8, **args))
    hybrid = predict_step(profile, StepSetting(sharding="HYBRID_SHARD", world_size=64, nodes=8, **args))
    assert across.communication_seconds > hybrid.communication_seconds
    assert across.samples_per_s < hybrid.samples_per_s


def test_planned_config_names_lightnings_fsdp_strategy(tmp_path, monkeypatch):
    from memplan.config.write import fsdp_strategy

    monkeypatch.setattr(costs, "INTER_NODE_BYTES_PER_S", 12.5e9)  # HYBRID_SHARD's case (the multi-node test)
    plan = make_plan(request(nodes=8, global_batch_size=64, parameter_count=20 * 10**9), ShardedStep(params=20 * 10**9))
    entry = fsdp_strategy(plan)
    assert entry == {"class_path": "FSDPStrategy", "init_args": {
        "sharding_strategy": "HYBRID_SHARD", "auto_wrap_policy": list(plan.block_classes), "cpu_offload": False,
        "device_mesh": [8, 8]}}


@pytest.mark.parametrize("kwargs, match", [
    (dict(strategies=("zero3",)), "PlanRequest.strategies"),
    (dict(parameter_count=0), "PlanRequest.parameter_count"),
    (dict(tokens_per_sample=0), "PlanRequest.tokens_per_sample"),
])
def test_bad_fsdp_request_fields_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        request(**kwargs)


def test_plan_with_the_real_estimator_shards_what_ddp_cannot_hold():
    import functools

    import memplan
    from memplan.batching import resize_batch
    from memplan.demos import GPTLM
    from memplan.estimator.fsdp import FsdpSettings
    from memplan.planner import block_classes, estimator_for

    # two blocks: a repeated block to wrap (block_classes below); the bytes that separate DDP from FSDP are mostly the
    # embedding's (50257 x 512 = 25.7M parameters), so more blocks would only add ops to every trace
    build = functools.partial(GPTLM, vocab_size=50257, context=128, d_model=512, n_layers=2, n_heads=8, dropout=0.0)
    batch = GPTLM.example_batch(build(), 1)
    traced = estimator_for(build, batch, device="A100-80GB")
    ddp = traced(micro_batch_size=1, precision="bf16-mixed", checkpointing=False, world_size=4)
    fsdp = traced(micro_batch_size=1, precision="bf16-mixed", checkpointing=False, world_size=4, fsdp=FsdpSettings())
    # 32M parameters: 16 B each (+ buckets) under DDP, a quarter of it under FSDP, which adds its all-gather
    # buffers and what its all-gather and reduce-scatter streams cache apart from the default stream (160 MiB)
    assert fsdp.side_stream_reserved > 0
    assert fsdp.device_total < ddp.device_total - 100 * MiB
    free = (fsdp.device_total + ddp.device_total) // 2  # between the two: only FSDP fits
    a100 = lookup_gpu("A100-80GB")
    device = DeviceBudget(name=a100.name, cuda_index=None, total_bytes=a100.total_bytes, free_bytes=int(free / 0.9),
                          compute_capability=(8, 0))
    request = PlanRequest(global_batch_size=4, devices=(device,) * 4, precisions=("bf16-mixed",),
                          allow_checkpointing=False, allow_cpu_offload=False,
                          parameter_count=sum(p.numel() for p in build().parameters()), tokens_per_sample=128,
                          block_classes=block_classes(build()))
    plan = make_plan(request, traced)
    assert (plan.strategy, plan.world_size, plan.micro_batch_size) == ("fsdp", 4, 1)
    assert plan.block_classes == ("memplan.demos._GPTBlock",)
    direct = memplan.estimate(build, resize_batch(batch, 1), precision="bf16-mixed", device="A100-80GB",
                              strategy="fsdp", world_size=4,
                              fsdp=FsdpSettings(sharding_strategy=plan.sharding_strategy))
    assert plan.predicted_peak_bytes == direct.device_total <= plan.device_budget_bytes


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Lightning's use of jsonargparse's old API
def test_planned_fsdp_config_is_a_lightning_cli_config(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    import yaml
    from test_configs_shipped import lightning_cli_print_config

    from memplan.config import load_config
    from memplan.config.write import planner_callback, write_planned_config
    from memplan.plan import Plan

    loaded = load_config(Path(__file__).resolve().parents[1] / "configs" / "llama-7b-fsdp.yaml")
    block = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    plan = Plan(gpu_name="H100-80GB", gpus=(), nodes=2, world_size=16, micro_batch_size=4, accumulate_grad_batches=4,
                global_batch_size=256, precision="bf16-mixed", gradient_checkpointing=True, strategy="fsdp",
                predicted_peak_bytes=40 * GiB, device_budget_bytes=71 * GiB, host_bytes_per_rank=4 * GiB,
                sharding_strategy="HYBRID_SHARD", block_classes=(block,))
    out = tmp_path / "planned.yaml"
    write_planned_config(loaded, plan, out, callback=planner_callback("planned.plan.json"))
    trainer = yaml.safe_load(out.read_text())["trainer"]
    assert trainer["strategy"] == {"class_path": "FSDPStrategy", "init_args": {
        "sharding_strategy": "HYBRID_SHARD", "auto_wrap_policy": [block], "cpu_offload": False,
        "activation_checkpointing_policy": [block], "device_mesh": [2, 8]}}
    assert (trainer["devices"], trainer["num_nodes"], trainer["accumulate_grad_batches"]) == (8, 2, 4)
    assert [c["class_path"] for c in trainer["callbacks"]] == ["memplan.MemoryPlanner"]  # kept under FSDP

    printed = lightning_cli_print_config(out, monkeypatch, capsys)
    assert "FSDPStrategy" in printed and "HYBRID_SHARD" in printed


@dataclass
class Prefetching(ShardedStep):
    """A ShardedStep that records what the search asks it to prefetch: (setting, traces made by then)."""

    prefetched: list = field(default_factory=list)

    def prefetch(self, *, micro_batch_size, precision, checkpointing, world_size, fsdp=None):
        self.prefetched.append(((micro_batch_size, checkpointing, world_size, fsdp), len(self.calls)))

    def cancel(self, **setting):
        pass


def test_the_best_fit_is_verified_beside_the_next_groups_exploration():
    """A 70B-shaped search on one node of 8 H100s: CPU offload with checkpointing finds a fit, then FULL_SHARD
    without offload (faster, if it fit) is explored; the fit's verification is prefetched before that
    exploration's trace (a second core runs it meanwhile: planner/background.py), and the plan is the same."""
    params = 70_000_000_000

    def plan_with(sim):
        return make_plan(request(global_batch_size=256, parameter_count=params, parameter_bytes=4 * params,
                                 optimizer_state_bytes=8 * params), sim)

    sim = Prefetching(params=params, activation_bytes_per_sample=60 * GiB)
    plan = plan_with(sim)
    assert plan == plan_with(ShardedStep(params=params, activation_bytes_per_sample=60 * GiB))
    assert plan.gradient_checkpointing and plan.cpu_offload
    on_device = next(i for i, call in enumerate(sim.calls) if call[1] and not call[3].cpu_offload)
    verification = sim.calls.index((plan.micro_batch_size, True, 8, sim.calls[-1][3]))
    assert on_device < verification  # explored first, then verified
    assert (sim.calls[verification], on_device) in sim.prefetched  # started before the exploration's trace
