"""benchmarks/faults.py: its cases and how it sorts what it sees (the replay itself is the benchmark)."""
from __future__ import annotations

import json

from benchmarks import faults


def result(code: int, out: str = "", err: str = "", hung: bool = False) -> dict:
    return {"code": code, "out": out, "err": err, "hung": hung, "seconds": 0.1}


def test_the_replay_covers_at_least_sixty_cases_of_every_class_with_unique_ids():
    cases = faults.cases()
    assert len(cases) >= 60 and len({c.id for c in cases}) == len(cases)
    assert {"absurd size", "not a file", "bad plan file", "implausible plan", "preemption", "logs", "NVML"} <= \
        {c.kind for c in cases}


def test_each_outcome_is_told_apart(tmp_path):
    refuse = faults.Case(id="x", kind="k", argv=[], fragment="--gpus must be")
    answer = faults.Case(id="y", kind="k", argv=[], expect="answer", fragment="uses 1 of 4")
    assert faults.classify(refuse, result(2, err="memplan: error: --gpus must be from 1"), tmp_path)[0] == "clear"
    assert faults.classify(refuse, result(2, err="memplan: error: something else"), tmp_path)[0] == "unclear"
    assert faults.classify(refuse, result(1, err="Traceback (most recent call last):\n  x\nValueError: y"),
                           tmp_path)[0] == "traceback"
    assert faults.classify(refuse, result(-9, hung=True), tmp_path)[0] == "hang"
    assert faults.classify(refuse, result(0, out="planned"), tmp_path)[0] == "silent wrong"
    assert faults.classify(answer, result(0, out="plan"), tmp_path)[0] == "silent wrong"
    assert faults.classify(answer, result(0, out="│ uses 1 │\n│ of 4"), tmp_path)[0] == "clear"  # a table's wrap


def test_a_plan_without_its_config_or_a_temporary_file_is_data_loss(tmp_path):
    (tmp_path / "planned.plan.json").write_text(json.dumps({"accumulate_grad_batches": 2}))
    assert faults.pair_whole(tmp_path, "", "") == "data loss"
    (tmp_path / "planned.yaml").write_text("trainer: {accumulate_grad_batches: 2}\n")
    assert faults.pair_whole(tmp_path, "", "") is None
    (tmp_path / ".planned.yaml.x.tmp").write_text("")
    assert faults.pair_whole(tmp_path, "", "") == "data loss"


def test_cheap_cases_replay_as_clear(tmp_path):
    chosen = [c for c in faults.cases() if c.id in ("gpus-20-digits", "watch-interval-inf", "log-not-a-folder")]
    for case in chosen:
        folder = tmp_path / case.id
        folder.mkdir()
        outcome, seen = faults.classify(case, faults.run_case(case, folder), folder)
        assert outcome == "clear", (case.id, seen)
