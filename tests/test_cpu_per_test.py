"""scripts/cpu_per_test.py's report: the suite's CPU time, each process counted once."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report_module():
    spec = importlib.util.spec_from_file_location("cpu_per_test", ROOT / "scripts" / "cpu_per_test.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, *records: dict) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_xdist_controllers_children_are_its_workers_and_are_not_counted_twice(tmp_path):
    test = {"event": "test", "id": "tests/test_a.py::test_one", "own": 30.0, "children": 30.0, "wall": 60.0}
    _write(tmp_path / "gw0-11.jsonl", test, {"event": "end", "own": 40.0, "children": 35.0})
    _write(tmp_path / "gw1-12.jsonl", {"event": "end", "own": 20.0, "children": 25.0})
    _write(tmp_path / "main-10.jsonl", {"event": "end", "own": 6.0, "children": 120.0})  # the workers, waited for
    text = _report_module().report(tmp_path, top=5)
    assert text.splitlines()[0] == ("1 tests: 1.00 CPU-minutes in tests, 2.10 in the test processes in all "
                                    "(with collection and imports)")


def test_without_workers_the_one_process_counts_its_children(tmp_path):
    _write(tmp_path / "main-10.jsonl", {"event": "end", "own": 50.0, "children": 10.0})
    assert "1.00 in the test processes in all" in _report_module().report(tmp_path, top=5).splitlines()[0]
