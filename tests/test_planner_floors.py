"""The planner's lower bounds (memplan/planner/floors.py) held against full traces.

Every candidate of small models is traced exactly (DDP at two world sizes and every FSDP layout,
micro-batches 1 and 2, with and without checkpointing) and each candidate's floor, computed from all
the traces, must not exceed its own traced device total: a floor above it would rule out a setting
that fits. The floors must also be worth having: the static one is the model's parameter bytes, and
the offload floor comes close to the traced figure.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest

from memplan.demos import GPTLM, LlamaLM
from memplan.estimator.optimizer_state import elementwise_state_bytes
from memplan.estimator.result import MemoryEstimate
from memplan.hardware import lookup_gpu
from memplan.planner import DeviceBudget, PlanRequest, estimator_for, make_plan
from memplan.planner.candidates import enumerate_candidates
from memplan.planner.floors import Floors
from memplan.planner.search import _Search
from test_planner_fsdp import ShardedStep, request


# Widths as small as the layers allow: a trace's cost is its op count (layers, parameters), which the widths
# hardly change; the uneven shapes are what the floors are tested on.
def tiny_gpt() -> GPTLM:  # 515 vocabulary rows shard unevenly over 2 and 4 ranks
    return GPTLM(vocab_size=515, context=8, d_model=16, n_layers=3, n_heads=2, dropout=0.0)


def tiny_llama() -> LlamaLM:  # GQA: 4 query heads share 2 key/value heads; 3 layers do not divide 4 ranks
    return LlamaLM(vocab_size=301, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, context=8)


MODELS = {"gpt": tiny_gpt, "llama": tiny_llama}


@functools.cache
def every_trace(model: str, device: str, gpus: int, nodes: int):
    """A search with every candidate up to micro-batch 2 traced; (search, candidates)."""
    build = MODELS[model]
    skeleton = build()
    gpu = lookup_gpu(device) if device != "cpu" else None
    budget = (DeviceBudget.from_catalog(gpu) if gpu is not None else
              DeviceBudget(name="cpu", cuda_index=None, total_bytes=1 << 40, free_bytes=1 << 40,
                           compute_capability=(8, 0)))
    request = PlanRequest(
        global_batch_size=2 * gpus * nodes, devices=(budget,) * gpus, nodes=nodes, precisions=("bf16-mixed",),
        parameter_count=sum(p.numel() for p in skeleton.parameters()),
        parameter_bytes=sum(p.numel() * p.element_size() for p in skeleton.parameters()),
        optimizer_state_bytes=elementwise_state_bytes(skeleton, "adamw"),
        block_classes=("block",))
    estimator = estimator_for(build, skeleton.example_batch(1), optimizer="adamw", device=device)
    search = _Search(request, estimator)
    candidates = [c for c in search.candidates if c.micro_batch_size <= 2]
    for c in candidates:
        search.trace(*c.trace_key)
    return search, candidates


CASES = [("gpt", "cpu", 2, 2), ("llama", "H100-80GB", 2, 2), ("gpt", "H100-80GB", 4, 1)]


@pytest.mark.parametrize("model, device, gpus, nodes", CASES)
def test_no_floor_exceeds_the_traced_peak(model, device, gpus, nodes):
    search, candidates = every_trace(model, device, gpus, nodes)
    layouts = {(c.group.sharding, c.group.offload) for c in candidates}
    assert {("FULL_SHARD", False), ("SHARD_GRAD_OP", False), ("FULL_SHARD", True), (None, False)} <= layouts
    for c in candidates:
        traced = search.traces[c.trace_key].device_total
        assert search.floors.floor(c) <= traced, (c.group.describe(), c.world_size, c.micro_batch_size)


@pytest.mark.parametrize("model, device, gpus, nodes", CASES)
def test_floors_are_close_enough_to_rule_out(model, device, gpus, nodes):
    search, candidates = every_trace(model, device, gpus, nodes)
    parameter_bytes = search.request.parameter_bytes
    assert search.request.optimizer_state_bytes == 2 * parameter_bytes  # AdamW's two moments, fp32
    for c in candidates:
        floor, traced = search.floors.floor(c), search.traces[c.trace_key].device_total
        if c.group.sharding is None:
            assert floor >= 3 * parameter_bytes  # every DDP rank holds every parameter and its state
        elif c.group.sharding == "SHARD_GRAD_OP":
            assert floor >= parameter_bytes  # every block stays gathered from forward to backward
        if c.group.offload:  # what the non-offloaded layout held besides its training state
            assert floor >= 0.8 * traced, (c.group.describe(), c.micro_batch_size, floor, traced)


def estimate_of(*, parameters=0, gradients=0, optimizer_state=0, forward_activations=0, peak=0, phase="backward"):
    return MemoryEstimate(
        parameters=parameters, gradients=gradients, optimizer_state=optimizer_state, activations=0, temporaries=0,
        batch=0, peak_allocated=peak, peak_reserved=peak, device_total=peak, device="H100-80GB",
        precision="bf16-mixed", checkpointing=False, forward_activations=forward_activations, peak_phase=phase)


def floors_after(*traces) -> tuple[Floors, dict]:
    """Floors fed (sharding, offload, world, micro, estimate) traces; and the 8-GPU x 2-node candidates by
    (sharding, offload, micro)."""
    request = PlanRequest(global_batch_size=64, devices=(DeviceBudget.from_catalog(lookup_gpu("H100-80GB")),) * 8,
                          nodes=2, precisions=("bf16-mixed",), parameter_count=10**9, allow_checkpointing=False)
    floors = Floors(None)
    for sharding, offload, world, micro, est in traces:
        floors.add(micro_batch_size=micro, precision="bf16-mixed", checkpointing=False, world_size=world,
                   sharding=sharding, offload=offload, est=est)
    candidates = {(c.group.sharding, c.group.offload, c.micro_batch_size): c for c in enumerate_candidates(request)
                  if c.world_size == 16}
    return floors, candidates


def test_which_trace_bounds_which_layout():
    ddp = estimate_of(parameters=40, optimizer_state=80, forward_activations=100, peak=300)
    full = estimate_of(parameters=3, optimizer_state=6, forward_activations=110, peak=200)
    grad_op = estimate_of(parameters=3, optimizer_state=6, forward_activations=150, peak=250)
    floors, c = floors_after(("SHARD_GRAD_OP", False, 16, 1, grad_op))
    # SHARD_GRAD_OP counts its gathered blocks as saved: no source for a layout that reshards, nor for DDP
    assert floors.floor(c[("FULL_SHARD", False, 1)]) == 0
    assert floors.floor(c[("SHARD_GRAD_OP", False, 2)]) == 9
    floors, c = floors_after(("FULL_SHARD", False, 16, 1, full))
    assert floors.floor(c[(None, False, 1)]) == 0  # FSDP keeps the root gathered: no source for DDP
    assert floors.floor(c[("HYBRID_SHARD", False, 1)]) == 110  # same world size, reshards too
    assert floors.floor(c[("FULL_SHARD", False, 2)]) == 9 + 110  # a larger micro-batch saves no less
    assert floors.floor(c[("FULL_SHARD", True, 1)]) == 200 - 2 * 3 - 6  # offload: all but the training state
    floors, c = floors_after(("FULL_SHARD", False, 16, 2, full), (None, False, 2, 1, ddp))
    assert floors.floor(c[("FULL_SHARD", False, 1)]) == 9 + 100  # only the DDP trace is at micro-batch 1
    assert floors.floor(c[("FULL_SHARD", False, 2)]) == 9 + 100  # the smaller of two sources
    assert floors.floor(c[("FULL_SHARD", True, 1)]) == 100
    floors, c = floors_after(("FULL_SHARD", False, 16, 1, estimate_of(parameters=3, peak=200, phase="optimizer")))
    assert floors.floor(c[("FULL_SHARD", True, 1)]) == 0  # a peak in the optimizer step bounds no offload


def test_a_70b_shaped_search_needs_no_ddp_trace():
    """Parameter bytes alone rule out DDP when no GPU holds the weights: the search traces FSDP only."""
    sim = ShardedStep(params=70_000_000_000, activation_bytes_per_sample=1 << 30)
    make = request(nodes=8, global_batch_size=512, parameter_count=70_000_000_000,
                   parameter_bytes=4 * 70_000_000_000)
    plan = make_plan(make, sim)
    assert plan.strategy == "fsdp"
    assert sim.calls and all(call[3] is not None for call in sim.calls)
    assert any(r.startswith("DDP does not fit: needs at least") for r in plan.reasons)
    without = ShardedStep(params=70_000_000_000, activation_bytes_per_sample=1 << 30)
    make_plan(request(nodes=8, global_batch_size=512, parameter_count=70_000_000_000), without)
    assert any(call[3] is None for call in without.calls)  # without the bound, DDP is traced to learn it
    assert len(sim.calls) < len(without.calls)


def test_optimizer_state_rules_out_sharding_layouts_without_a_trace(monkeypatch):
    """With the optimizer's state known (AdamW: 2 fp32 moments), 8-way HYBRID_SHARD's 70B training
    state (parameters and moments: 105 GB a GPU) is over an H100's budget before any trace. (On a slow
    network, 50 Gb/s per GPU, where HYBRID_SHARD is predicted fast enough to be worth a trace.)"""
    from memplan.planner import costs

    monkeypatch.setattr(costs, "INTER_NODE_BYTES_PER_S", 6.25e9)

    def search(**bounds):
        sim = ShardedStep(params=70_000_000_000, activation_bytes_per_sample=1 << 30)
        plan = make_plan(request(nodes=8, global_batch_size=512, parameter_count=70_000_000_000,
                                 parameter_bytes=4 * 70_000_000_000, **bounds), sim)
        return plan, [call[3].sharding_strategy for call in sim.calls]

    plan, shardings = search(optimizer_state_bytes=8 * 70_000_000_000)
    alone, shardings_without = search()
    assert "HYBRID_SHARD" in shardings_without and "HYBRID_SHARD" not in shardings
    assert dataclasses.replace(plan, reasons=()) == dataclasses.replace(alone, reasons=())
    assert len(shardings) < len(shardings_without)
    assert any(r.startswith("FSDP HYBRID_SHARD does not fit: needs at least 97.79 GiB") for r in plan.reasons)


def test_parameter_bytes_is_checked():
    with pytest.raises(ValueError, match="PlanRequest.parameter_bytes must be an int >= 0"):
        request(parameter_bytes=-1)


def test_optimizer_state_bytes_is_checked():
    with pytest.raises(ValueError, match="PlanRequest.optimizer_state_bytes must be an int >= 0"):
        request(optimizer_state_bytes=-1)


def test_an_optimizer_claim_the_first_trace_contradicts_is_withdrawn():
    floors = Floors(parameter_bytes=400, optimizer_state_bytes=800)
    assert floors.state_bytes == 1200 and not floors.claim_checked
    floors.add(micro_batch_size=1, precision="bf16-mixed", checkpointing=False, world_size=16, sharding="FULL_SHARD",
               offload=True, est=estimate_of(optimizer_state=0), shard_degree=16)
    assert floors.state_bytes == 1200 and not floors.claim_checked  # offloaded: its state is on the host
    floors.add(micro_batch_size=1, precision="bf16-mixed", checkpointing=False, world_size=16, sharding="FULL_SHARD",
               offload=False, est=estimate_of(parameters=25, optimizer_state=50), shard_degree=16)
    assert floors.state_bytes == 1200 and floors.claim_checked  # 800 / 16 held: confirmed
    wrong = Floors(parameter_bytes=400, optimizer_state_bytes=800)
    wrong.add(micro_batch_size=1, precision="bf16-mixed", checkpointing=False, world_size=2, sharding=None,
              offload=False, est=estimate_of(parameters=400, optimizer_state=100))  # e.g. an unused head
    assert wrong.state_bytes == 400 and wrong.claim_checked


@pytest.mark.parametrize("claim_factor", [5, 1000])
def test_a_wrong_optimizer_claim_never_changes_the_plan(claim_factor):
    """The claim is a probe's (estimator/optimizer_state.py), which cannot see parameters that get no
    gradient. Too high (x5: the first trace withdraws it; x1000: it alone rules out every setting, so
    the search withdraws it before tracing), the plan is the one made without it."""
    def plan_with(**bounds):
        sim = ShardedStep(params=70_000_000_000, activation_bytes_per_sample=1 << 30)
        return make_plan(request(nodes=8, global_batch_size=512, parameter_count=70_000_000_000,
                                 parameter_bytes=4 * 70_000_000_000, **bounds), sim)

    real = 8 * 70_000_000_000  # ShardedStep's optimizer state: two fp32 moments
    wrong, alone = plan_with(optimizer_state_bytes=claim_factor * real), plan_with()
    # the same plan; the runners-up may differ by what the longer search traced on the way
    words = dict(reasons=(), alternatives=(), speed_reason=None)  # the runner-up depends on what was traced
    assert dataclasses.replace(wrong, **words) == dataclasses.replace(alone, **words)
