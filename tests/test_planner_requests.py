"""The planner's inputs (memplan.planner): the host-RAM model per rank, device budgets from an NVML reading and
from the catalog, requests refused by field with the fix, a plan made with the real memplan.estimate, and a
request that keeps every candidate on every GPU (all_devices). The search is test_planner.py's."""
from __future__ import annotations

import dataclasses

import pytest
from planner_sim import gpus

from memplan.hardware import GpuInfo, lookup_gpu
from memplan.planner import DeviceBudget, HostLoad, PlanRequest, estimator_for, host_bytes_per_rank, make_plan
from memplan.planner.costs import RANK_RUNTIME_BYTES, WORKER_BYTES
from memplan.units import GiB, MiB


# --- the models ----------------------------------------------------------------------------------
def test_host_bytes_per_rank_formula():
    load = HostLoad(model_init_bytes=GiB, sample_bytes=MiB, num_workers=4, prefetch_factor=2, pin_memory=True)
    assert host_bytes_per_rank(load, 8) == (RANK_RUNTIME_BYTES + GiB + 4 * WORKER_BYTES
                                            + 8 * MiB * (4 * 2 + 1) + 2 * 8 * MiB)
    assert host_bytes_per_rank(HostLoad(model_init_bytes=0, sample_bytes=MiB), 2) == RANK_RUNTIME_BYTES + 2 * MiB


def test_device_budget_from_nvml_reading_and_catalog():
    info = GpuInfo(index=3, uuid="GPU-x", name="NVIDIA A100-SXM4-80GB", total_bytes=80 * GiB,
                   used_bytes=30 * GiB, free_bytes=50 * GiB, compute_capability=None, mig_mode=False)
    budget = DeviceBudget.from_gpu_info(info, cuda_index=1)
    assert (budget.cuda_index, budget.free_bytes, budget.compute_capability) == (1, 50 * GiB, (8, 0))
    catalog = DeviceBudget.from_catalog(lookup_gpu("V100-16GB"))
    assert catalog.free_bytes == catalog.total_bytes == 16160 * MiB and catalog.cuda_index is None
    with pytest.raises(ValueError, match="no memory reading"):
        DeviceBudget.from_gpu_info(dataclasses.replace(info, free_bytes=None))


# --- bad requests ----------------------------------------------------------------------------------
A100 = gpus("A100-80GB", 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(devices=()), r"PlanRequest.devices must be a non-empty tuple"),
    (dict(margin=1.0), r"PlanRequest.margin must be a fraction in \[0, 1\)"),
    (dict(margin=-0.1), r"PlanRequest.margin must be a fraction in \[0, 1\)"),
    (dict(precisions=("fp8",)), r"PlanRequest.precisions: 'fp8' is not a precision the planner searches"),
    (dict(precisions=("bf16-true",)), r"'bf16-true' is not a precision the planner searches"),
    (dict(precisions=("bf16-mixed",), devices=gpus("V100-32GB", 2)), r"allows only 'bf16-mixed'.*add '16-mixed'"),
    (dict(global_batch_size=0), r"PlanRequest.global_batch_size must be an int >= 1"),
    (dict(global_batch_size=10, nodes=4), r"global_batch_size \(10\) must be divisible by the world size.*multiple of 4"),
    (dict(max_micro_batch_size=0), r"PlanRequest.max_micro_batch_size must be an int >= 1"),
    (dict(devices=gpus("A100-80GB", 1) * 2), r"lists a cuda_index twice"),
])
def test_bad_requests_name_the_field_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanRequest(**{"global_batch_size": 64, "devices": A100, **kwargs})


def test_bad_device_budget_and_host_load():
    with pytest.raises(ValueError, match=r"DeviceBudget.free_bytes .* must not exceed total_bytes"):
        DeviceBudget(name="A100-80GB", cuda_index=0, total_bytes=GiB, free_bytes=2 * GiB, compute_capability=(8, 0))
    with pytest.raises(ValueError, match=r"DeviceBudget.compute_capability must be a \(major, minor\)"):
        DeviceBudget(name="A100-80GB", cuda_index=0, total_bytes=GiB, free_bytes=GiB, compute_capability=(8,))
    with pytest.raises(ValueError, match=r"HostLoad.prefetch_factor must be an int >= 1"):
        HostLoad(model_init_bytes=0, sample_bytes=0, prefetch_factor=0)


# --- the real estimator ----------------------------------------------------------------------------
def test_plan_with_the_real_estimator_matches_a_direct_estimate():
    import memplan
    from memplan.batching import resize_batch
    from memplan.demos import ImageCNN

    batch = ImageCNN().example_batch(4)
    calls = []
    traced = estimator_for(ImageCNN, batch, device="A100-80GB")  # the model is built under fake tensors

    def estimator(**kwargs):
        calls.append(kwargs)
        return traced(**kwargs)

    # ~3.9 MiB of activations per sample: 2 GiB free per GPU holds micro-batch 128, not 256 (with NCCL).
    a100 = lookup_gpu("A100-80GB")
    device = DeviceBudget(name=a100.name, cuda_index=None, total_bytes=a100.total_bytes, free_bytes=2 * GiB,
                          compute_capability=(8, 0))
    request = PlanRequest(global_batch_size=512, devices=(device, device), allow_checkpointing=False)
    plan = make_plan(request, estimator)
    direct = memplan.estimate(ImageCNN, resize_batch(batch, plan.micro_batch_size), precision=plan.precision,
                              device="A100-80GB", strategy="ddp" if plan.world_size > 1 else None,
                              world_size=plan.world_size)
    assert plan.predicted_peak_bytes == direct.device_total <= plan.device_budget_bytes
    # The small CNN's micro-steps are bound by the host (costs.HOST_SECONDS_PER_OP per op): 32-true, which runs no
    # autocast casts, is the faster; the two GPUs' DDP buckets leave room for micro-batch 64.
    assert (plan.world_size, plan.precision) == (2, "32-true")
    assert plan.micro_batch_size < 256 and plan.accumulate_grad_batches > 1
    assert len(calls) <= 6


def test_all_devices_keeps_every_candidate_on_every_gpu():
    """MemoryPlanner's request: the Trainer's world size is fixed, so no candidate uses fewer GPUs."""
    from memplan.planner.candidates import enumerate_candidates
    from memplan.planner.request import DeviceBudget, PlanRequest

    gpu = DeviceBudget(name="cpu", cuda_index=None, total_bytes=1 << 34, free_bytes=1 << 34, compute_capability=(8, 0))
    free = PlanRequest(global_batch_size=16, devices=(gpu, gpu), precisions=("32-true",))
    fixed = PlanRequest(global_batch_size=16, devices=(gpu, gpu), precisions=("32-true",), all_devices=True)
    assert {c.gpus_per_node for c in enumerate_candidates(free)} == {1, 2}
    assert {c.gpus_per_node for c in enumerate_candidates(fixed)} == {2}
