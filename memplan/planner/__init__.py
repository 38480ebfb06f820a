"""The planner: search world size x precision x checkpointing x micro-batch for the fastest training
setting that fits every chosen GPU and the host. Pure: a PlanRequest and an estimator in, a frozen
Plan out (or NoFit); no Lightning, no GPU.

    from memplan.planner import DeviceBudget, PlanRequest, make_plan, estimator_for
    from memplan.hardware import lookup_gpu
    request = PlanRequest(global_batch_size=256, devices=(DeviceBudget.from_catalog(lookup_gpu("A100-80GB")),) * 8)
    plan = make_plan(request, estimator_for(model, batch, device="A100-80GB"))
"""
from memplan.planner.costs import StepSetting, StepTime, host_bytes_per_rank, predict_step
from memplan.planner.nofit import NoFit, fsdp_full_shard_bytes
from memplan.planner.request import DeviceBudget, HostLoad, PlanRequest
from memplan.planner.search import Estimator, make_plan
from memplan.planner.tracing import block_classes, estimator_for, largest_block_bytes

__all__ = ["DeviceBudget", "block_classes", "Estimator", "HostLoad", "NoFit", "PlanRequest", "estimator_for",
           "fsdp_full_shard_bytes", "host_bytes_per_rank", "largest_block_bytes", "make_plan",
           "predict_step", "StepSetting", "StepTime"]
