"""The pure parts: the layout's arithmetic, the gathered row, the shared decision, plan checks."""
from __future__ import annotations

import pytest
from callback_sim import make_plan
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from memplan.callback import Layout
from memplan.callback.apply import layout_from_plan, plan_mismatches
from memplan.callback.layout import chunk_bounds
from memplan.callback.adjust import Adjuster, RankStatus
from memplan.hardware.readings import MemoryReading
from memplan.units import GiB


def status(rank: int, free_fraction: float, *, micro: int = 8, ooms: int = 0, failed: int | None = None,
           checkpointing: bool = False) -> RankStatus:
    total = 80 * GiB
    reading = MemoryReading(process_bytes=10 * GiB, device_used_bytes=int(total * (1 - free_fraction)),
                            device_total_bytes=total, allocated_bytes=9 * GiB, reserved_bytes=10 * GiB,
                            peak_bytes=11 * GiB, headroom_bytes=int(total * free_fraction))
    return RankStatus(rank=rank, reading=reading, micro_batch_size=micro, gradient_checkpointing=checkpointing,
                      oom_retries=ooms, oom_micro_batch_size=failed)


def adjuster(**overrides) -> Adjuster:
    options = dict(margin=0.05, grow=True, grow_margin=0.25, grow_patience=2, planned_micro_batch_size=8,
                   can_checkpoint=True)
    options.update(overrides)
    return Adjuster(**options)


def runs(micro: int, checkpointing: bool = False, *, loader: int = 8) -> Layout:
    """The shared layout the ranks run now: `micro` of each loaded batch of `loader` on 2 ranks."""
    return Layout(loader_batch_size=loader, micro_batch_size=micro, accumulate_grad_batches=1, world_size=2,
                  gradient_checkpointing=checkpointing)


def test_the_layout_keeps_the_global_batch_whatever_the_micro_batch():
    layout = Layout(loader_batch_size=12, micro_batch_size=12, accumulate_grad_batches=2, world_size=4)
    for micro in (12, 6, 5, 1):
        smaller = layout.with_micro_batch(micro)
        assert smaller.global_batch_size == 96
        assert smaller.micro_batches_per_step == 2 * -(-12 // micro)
    assert Layout.from_dict(layout.to_dict()) == layout
    assert chunk_bounds(0, 9, 4) == [(0, 4), (4, 8), (8, 9)]
    with pytest.raises(ValueError, match="micro_batch_size .13. must not exceed loader_batch_size"):
        layout.with_micro_batch(13)
    with pytest.raises(ValueError, match="accumulate_grad_batches must be a positive int"):
        Layout(loader_batch_size=2, micro_batch_size=1, accumulate_grad_batches=0, world_size=1)


def test_a_status_survives_the_float64_row_of_the_gather():
    original = status(3, 0.2, micro=4, ooms=2, failed=8, checkpointing=True)
    assert RankStatus.from_row(original.to_row()) == original
    blank = RankStatus(rank=0, reading=MemoryReading(), micro_batch_size=1, gradient_checkpointing=False,
                       oom_retries=0)
    assert RankStatus.from_row(blank.to_row()) == blank


def test_one_rank_under_the_margin_lowers_everyone_halving_then_checkpointing():
    decide = adjuster()
    micro, checkpointing, steps = 8, False, []
    for _ in range(5):
        change = decide.decide([status(0, 0.5), status(1, 0.01)], runs(micro, checkpointing))
        if change is None:
            steps.append(None)
            continue
        assert change.cause == "headroom" and change.ranks == (1,)
        micro, checkpointing = change.micro_batch_size, change.gradient_checkpointing
        steps.append((micro, checkpointing))
    assert steps == [(4, False), (2, False), (1, False), (1, True), None]


def test_an_oom_on_one_rank_brings_everyone_to_its_micro_batch_and_caps_growth():
    decide = adjuster()
    change = decide.decide([status(0, 0.5, micro=8), status(1, 0.5, micro=2, ooms=2, failed=4)], runs(8))
    assert (change.cause, change.ranks, change.micro_batch_size) == ("oom", (1,), 2)
    assert decide.ceiling == 4
    # the same OOM count again is old news; lasting headroom grows, but never back to 4
    micro, grown = 2, []
    for _ in range(4):
        change = decide.decide([status(0, 0.5, micro=micro), status(1, 0.5, micro=micro, ooms=2, failed=4)],
                               runs(micro))
        micro = change.micro_batch_size if change else micro
        grown.append(change and (change.cause, change.micro_batch_size))
    assert grown == [None, ("grow", 3), None, None]


def test_growth_needs_every_rank_roomy_for_patience_checks_and_stops_at_the_plan():
    decide = adjuster(grow_patience=3)
    roomy = [status(0, 0.5, micro=2), status(1, 0.5, micro=2)]
    assert decide.decide(roomy, runs(2)) is None and decide.decide(roomy, runs(2)) is None
    assert decide.decide([status(0, 0.5), status(1, 0.2)], runs(2)) is None  # rank 1 not roomy: start over
    assert [decide.decide(roomy, runs(2)) for _ in range(2)] == [None, None]
    change = decide.decide(roomy, runs(2))
    assert (change.cause, change.micro_batch_size) == ("grow", 4)
    assert adjuster(grow=False, grow_patience=1).decide(roomy, runs(2)) is None
    at_plan = adjuster(grow_patience=1)
    assert at_plan.decide(roomy, runs(8)) is None


def test_the_adjusters_state_is_plain_and_restores():
    decide = adjuster()
    decide.decide([status(0, 0.5, micro=2, ooms=1, failed=4)], runs(8))
    decide.decide([status(0, 0.5, micro=2, ooms=1, failed=4)], runs(2))
    state = decide.state_dict()
    assert state == {"calm_checks": 1, "ceiling": 4}
    again = adjuster()
    again.load_state_dict(state)
    assert (again.calm_checks, again.ceiling) == (1, 4)


def test_plan_mismatches_name_the_fix():
    plan = make_plan(4, 2, world_size=8, precision="bf16-mixed")
    found = plan_mismatches(plan, precision="bf16-mixed", world_size=8, nodes=1)
    assert found == []
    found = plan_mismatches(plan, precision="16-mixed", world_size=4, nodes=1)
    assert "Trainer(precision='bf16-mixed')" in found[0] and "Trainer(num_nodes=1, devices=8)" in found[1]


def test_a_plan_becomes_a_layout_on_the_trainers_world():
    plan = make_plan(4, 2, world_size=2)  # global 16
    assert layout_from_plan(plan, world_size=2, loader_batch_size=32, settable=True) == Layout(
        loader_batch_size=4, micro_batch_size=4, accumulate_grad_batches=2, world_size=2)
    assert layout_from_plan(plan, world_size=1, loader_batch_size=32, settable=True).accumulate_grad_batches == 4
    assert layout_from_plan(plan, world_size=2, loader_batch_size=8, settable=False) == Layout(
        loader_batch_size=8, micro_batch_size=4, accumulate_grad_batches=1, world_size=2)
    with pytest.raises(MisconfigurationException, match="not a multiple of the loader batch 6 x 2"):
        layout_from_plan(plan, world_size=2, loader_batch_size=6, settable=False)


def test_sizes_cut_the_loaded_batch_into_the_fewest_even_chunks():
    from memplan.callback.adjust import larger_micro_batch, smaller_micro_batch

    assert [smaller_micro_batch(s, 16) for s in (16, 8, 4, 2, 1)] == [8, 4, 2, 1, None]
    assert smaller_micro_batch(9, 9) == 3  # 3 + 3 + 3, not 4 + 4 + 1
    assert smaller_micro_batch(15, 16) == 6  # at most half of 15, in even chunks of 16: 6 + 5 + 5
    # growth only to a size with fewer chunks, below the smallest that failed: none between 8 and 16
    assert larger_micro_batch(8, 15, 16) is None
    assert larger_micro_batch(7, 15, 16) == 8  # 7 + 7 + 2 -> 8 + 8
    assert larger_micro_batch(2, 16, 16) == 8  # bisection toward the planned 16, in even chunks
    assert larger_micro_batch(8, 16, 16) == 16


def test_after_an_oom_growth_stays_below_the_size_that_failed():
    adjuster = Adjuster(margin=0.05, grow=True, grow_margin=0.25, grow_patience=1, planned_micro_batch_size=16,
                        can_checkpoint=True)
    roomy = MemoryReading(device_total_bytes=100, headroom_bytes=60)
    oom = RankStatus(rank=1, reading=roomy, micro_batch_size=8, gradient_checkpointing=False, oom_retries=1,
                     oom_micro_batch_size=16)
    calm = RankStatus(rank=0, reading=roomy, micro_batch_size=8, gradient_checkpointing=False, oom_retries=0)
    change = adjuster.decide([calm, oom], runs(16, loader=16))
    assert (change.cause, change.micro_batch_size) == ("oom", 8)
    assert all(adjuster.decide([calm, oom], runs(8, loader=16)) is None for _ in range(5))  # never 15, never 16 again


def test_growth_bisects_toward_the_loaded_batch_when_the_plan_asked_for_more():
    # a plan of micro-batch 64 on a loader that yields 16 (known from the start): the layout runs 16 whole, and
    # after lowering to 2, growth halves the way to 16, not the way to 64, which no chunk of 16 can reach
    decide = adjuster(planned_micro_batch_size=64, grow_patience=1)
    micro, grown = 2, []
    for _ in range(3):
        change = decide.decide([status(0, 0.5, micro=micro), status(1, 0.5, micro=micro)], runs(micro, loader=16))
        micro = change.micro_batch_size if change else micro
        grown.append(change and (change.cause, change.micro_batch_size))
    assert grown == [("grow", 8), ("grow", 16), None]
    assert decide.growth_cap(runs(2, loader=16)) == 16
