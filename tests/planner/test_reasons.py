"""The plan's account and NoFit name what the user can change in the words the request carries
(memplan.planner.reasons.Words): rendered once by the planner, rewritten by nobody after."""
from __future__ import annotations

import pickle

import pytest

from memplan.planner import DeviceBudget, NoFit, PlanRequest, make_plan
from memplan.planner.reasons import GPUS_USED, Words
from memplan.units import GiB
from tests.planner_sim import SimulatedStep, gpus

FLAGS = Words(allow_amp="allowing mixed precision (--amp)", allow_checkpointing="allowing checkpointing (--ckpt)",
              checkpointing_refused="--no-ckpt was given")


def _no_fit(**request) -> str:
    sim = SimulatedStep(params_bytes=20 * GiB, activation_bytes_per_sample=GiB)  # DDP needs ~100 GiB per GPU
    with pytest.raises(NoFit) as caught:
        make_plan(PlanRequest(global_batch_size=64, devices=gpus("A100-80GB", 8), largest_block_bytes=GiB,
                              precisions=("32-true",), allow_checkpointing=False, **request), sim)
    return str(caught.value)


def test_nofit_names_the_settings_in_the_request_s_words():
    message = _no_fit(words=FLAGS)
    assert message.endswith("Allowing mixed precision (--amp) and allowing checkpointing (--ckpt) would lower what "
                            "DDP needs.")
    assert "precisions=(" not in message and "allow_checkpointing" not in message


def test_nofit_does_not_offer_checkpointing_to_a_model_with_nothing_to_checkpoint():
    message = _no_fit(words=FLAGS, checkpointable=False)
    assert message.endswith("Allowing mixed precision (--amp) would lower what DDP needs. Activation checkpointing "
                            "cannot help: the model has no repeated blocks to checkpoint.")
    assert "--ckpt" not in message


def test_the_account_says_why_checkpointing_is_off_in_the_request_s_words():
    roomy = dict(global_batch_size=64, devices=gpus("A100-80GB", 8), allow_checkpointing=False)
    refused = make_plan(PlanRequest(**roomy, words=FLAGS), SimulatedStep())
    assert "No activation checkpointing (--no-ckpt was given)." in refused.reasons
    nothing = make_plan(PlanRequest(**roomy, words=FLAGS, checkpointable=False), SimulatedStep())
    assert "No activation checkpointing (the model has no repeated blocks memplan can checkpoint)." in nothing.reasons


def test_the_reason_for_unused_gpus_carries_its_code_to_other_ranks():
    # 6 of 8 GPUs: the global batch of 36 does not split over 7 or 8 ranks
    plan = make_plan(PlanRequest(global_batch_size=36, devices=gpus("A100-80GB", 8)), SimulatedStep())
    used = [r for r in pickle.loads(pickle.dumps(plan)).reasons if getattr(r, "code", None) == GPUS_USED]
    assert len(used) == 1 and used[0].startswith("Uses 6 of 8 GPUs per node")
    assert plan.to_dict()["reasons"] == [str(r) for r in plan.reasons]


def test_a_plan_for_cpu_ranks_speaks_of_devices_in_its_account_and_its_alternatives():
    # MemoryPlanner on a machine without a GPU plans for CPU ranks; the 8th has 6 GiB free, so eight ranks, faster,
    # hold no setting: the near misses say why in the same words as the account
    free = [80 * GiB] * 7 + [6 * GiB]
    cpus = tuple(DeviceBudget(name="cpu", cuda_index=None, total_bytes=80 * GiB, free_bytes=f, compute_capability=(8, 0))
                 for f in free)
    sim = SimulatedStep(activation_bytes_per_sample=3 * GiB)
    plan = make_plan(PlanRequest(global_batch_size=512, devices=cpus), sim)
    assert plan.reasons[0].startswith("4 ranks (1 node x 4 devices) x micro-batch")
    assert "cap every device's budget at 5.40 GiB" in " ".join(plan.reasons)
    used = [r for r in plan.reasons if getattr(r, "code", None) == GPUS_USED]
    assert used[0].startswith("Uses 4 of 8 devices per node: with 8 nothing fits the 5.40 GiB per-device budget")
    misses = [a.why_not for a in plan.alternatives if not a.fits]
    assert misses and all(m.startswith("does not fit: needs ") and " per device (" in m for m in misses)
    assert not [t for t in (*plan.reasons, *misses) if "GPU" in t]
    on_gpus = make_plan(PlanRequest(global_batch_size=512, devices=gpus("A100-80GB", 8, cuda7=6 * GiB)), sim)
    assert "per GPU" in " ".join(on_gpus.reasons) and " per GPU (" in on_gpus.alternatives[0].why_not
