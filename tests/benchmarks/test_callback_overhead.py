"""benchmarks.callback_overhead's breakdown of MemoryPlanner's own time: by part and by kind of step, from what the
instrumentation booked (figures given here, no clock read)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from pytorch_lightning.callbacks import Callback

from benchmarks.callback_overhead import USER_PART, OwnTime, StepClock


def test_the_breakdown_nets_the_wrapper_of_the_users_work_and_sorts_steps_by_kind():
    own = OwnTime(Callback(), StepClock())
    try:
        trainer = SimpleNamespace(global_step=0)
        own._trainer = trainer
        for step in range(20, 151):
            trainer.global_step = step
            own._book("training_step wrapper", 0.010 + 60e-6)  # 10 ms of the user's, 60 us of the wrapper's own
            own._book(USER_PART, -0.010)
            own._book("hook on_train_batch_end", 0.050 if step % 50 == 0 else 10e-6)  # a reading: 50 ms
        own.carried_steps.add(20)
        got = own.breakdown(steps=131, every=50)
    finally:
        own.close()
    wrapper = got["by_part"]["training_step wrapper, net of the user's work"]
    assert wrapper["steps"] == 131 and wrapper["median_us"] == pytest.approx(60.0)
    assert USER_PART not in got["by_part"]
    kinds = got["by_kind_of_step"]
    assert (kinds["guarded"]["steps"], kinds["reading"]["steps"], kinds["other"]["steps"]) == (1, 3, 127)
    assert kinds["reading"]["median_us"] == pytest.approx(50_060.0)
    # the readings' 3 x 50 ms spread over the 131 steps: most of the mean own time per step
    assert kinds["reading"]["us_per_step_of_all"] == pytest.approx(3 * 50_060.0 / 131)
