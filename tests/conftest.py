"""Every test runs with a private home and calibration file: no test reads or writes the developer's
~/.cache/memplan/calibration.json (which would change CUDA estimates on a machine that has one)."""
import pytest


@pytest.fixture(autouse=True)
def _private_calibration(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MEMPLAN_CALIBRATION", str(home / "calibration.json"))
