"""The test drivers' scenario runner (ddp_driver.py, fsdp_driver.py, run as ranks of a launch): each rank runs the
scenarios one after another with its output in a file per scenario, the checks a test reads them with, and the
end of a finished rank. callback_sim re-exports these names, which the drivers and tests import from there."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from memplan.hardware import readings


def this_rank() -> int:
    """This process's rank in the default process group; 0 without one."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_rank() if initialized else 0


def run_scenarios(main: Callable[[str, Path], None], out_root: Path, scenarios: list[str]) -> None:
    """Run a driver's scenarios one after another in this rank (every rank runs the same list, so the
    ranks meet in each scenario's fit: a 2-rank launch costs two interpreters, not two per scenario).
    Scenario S writes under out_root/S; this rank's stdout and stderr while S runs go to
    out_root/S/output_rank<R>.txt, and out_root/S/done_rank<R> is written once S returned. Each scenario
    starts from the real readings.read_memory (a scenario may SIMULATE it). An exception ends the rank
    (its traceback on the rank's own stderr and in out_root/raised_rank<R>, which check_scenario_ran quotes for
    the scenarios after it), so the scenarios after it leave no done file."""
    real_read_memory = readings.read_memory
    for scenario in scenarios:
        out = out_root / scenario
        out.mkdir(parents=True, exist_ok=True)
        readings.read_memory = real_read_memory
        try:
            with _output_to(out / f"output_rank{this_rank()}.txt"):
                main(scenario, out)
        except BaseException:
            (out_root / f"raised_rank{this_rank()}").write_text(f"{scenario}\n{traceback.format_exc()}")
            raise
        (out / f"done_rank{this_rank()}").write_text("")


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """File descriptors 1 and 2 (this process's and its children's stdout and stderr) go to `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def scenario_output(out: Path, ranks: int = 2) -> str:
    """What a scenario run by run_scenarios printed: each rank's stdout and stderr, rank by rank."""
    return "".join((out / f"output_rank{r}.txt").read_text(errors="replace") for r in range(ranks)
                   if (out / f"output_rank{r}.txt").exists())


def check_scenario_ran(out: Path, result: subprocess.CompletedProcess, ranks: int = 2) -> str:
    """Fail unless every rank finished the scenario written under `out` (run_scenarios' done files); the
    scenario's output (scenario_output)."""
    output = scenario_output(out, ranks)
    missing = [r for r in range(ranks) if not (out / f"done_rank{r}").exists()]
    raised = [(r, p.read_text().split("\n", 1)) for r in range(ranks)
              if (p := out.parent / f"raised_rank{r}").exists()]
    earlier = "".join(f"\nscenario {name} before it raised on rank {r}:\n{trace[-3000:]}"
                      for r, (name, trace) in raised if name != out.name)
    assert not missing, (f"scenario {out.name}: rank(s) {missing} did not finish it (the launch exited "
                         f"{result.returncode}){earlier}\n{output[-3000:]}\n--- launch stderr ---\n"
                         f"{result.stderr[-3000:]}")
    return output


def end_finished_rank() -> None:
    """End a test rank whose run has finished and written its files: destroy the process group (as
    memplan.train does), collect what the run left (a model's device meshes hold gloo groups), flush, and
    leave without interpreter shutdown. A finished 2-rank gloo FSDP2 run aborted in that shutdown ("terminate
    called without an active exception", exit -6, after every file was written) once in CI and 1 in ~36
    runs here, from a C++ destructor of torch's distributed stack (pytorch/pytorch#190489 and #179291 name
    the class): not what these tests check, and not code of memplan's (it starts no thread in a rank)."""
    import gc
    import os
    import sys

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
