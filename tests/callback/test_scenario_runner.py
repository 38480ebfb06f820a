"""The test drivers' scenario runner (callback_sim.run_scenarios): when a scenario of a shared launch raises, the
scenarios after it fail their tests with the raising scenario's name and traceback, not only "did not finish"."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from callback_sim import check_scenario_ran, run_scenarios


def test_a_scenario_after_one_that_raised_names_it_and_its_traceback(tmp_path: Path):
    def main(scenario: str, out: Path) -> None:
        os.write(1, f"running {scenario}\n".encode())  # fd 1, as a rank's own output (pytest replaces sys.stdout)
        if scenario == "second":
            raise ValueError("the second scenario's own fault")

    with pytest.raises(ValueError):
        run_scenarios(main, tmp_path, ["first", "second", "third"])
    launch = subprocess.CompletedProcess(args=[], returncode=1, stdout="", stderr="")
    assert "running first" in check_scenario_ran(tmp_path / "first", launch, ranks=1)
    with pytest.raises(AssertionError) as third:
        check_scenario_ran(tmp_path / "third", launch, ranks=1)
    assert "scenario second before it raised on rank 0" in str(third.value)
    assert "ValueError: the second scenario's own fault" in str(third.value)
    with pytest.raises(AssertionError) as second:
        check_scenario_ran(tmp_path / "second", launch, ranks=1)
    assert "before it raised" not in str(second.value)  # its own output says why
    assert "running second" in str(second.value)
