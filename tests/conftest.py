"""Every test runs with a private home and calibration file: no test reads or writes the developer's
~/.cache/memplan/calibration.json (which would change CUDA estimates on a machine that has one).

Under pytest-xdist (README's `-n 2`), the modules in ONE_WORKER run whole on one worker, each as one unit
handed out before the single tests: their tests share work that a module-scoped fixture or a cache does
once per process (on two workers it would be done twice); a module SCOPES names runs in another's unit. Every
other test is handed out on its own, as `-n` does.
(xdist's own `--dist loadgroup` does not group under pytest 9.2: pytest-dev/pytest-xdist#1386.)

Every test process computes on one CPU thread (OMP_NUM_THREADS=1, set here before torch is imported, so the
child processes tests start inherit it too; a test that needs more threads sets them itself). README's `-n 2`
runs two workers on two cores: with torch's default of one OpenMP thread per core each worker's threads spin
waiting for a core the other worker holds, which cost 40 % more CPU time on tests/estimator (126 against 75
CPU-seconds for test_estimate_cpu.py and test_checkpoint_settings.py on a 2-core AMD EPYC) for the same results.

The child processes tests start import Lightning as memplan's user install does: torchmetrics (which Lightning
imports) finds neither of the dev extras transformers and scipy, which it would import in each child, ~1.8 CPU-s
apiece; transformers' modules stay importable for a test's own models (child_site.py)."""
import os
import sys

os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402

import child_site  # noqa: E402

if "torch" in sys.modules:  # a plugin imported torch before this file set the variable (the test modules import it
    sys.modules["torch"].set_num_threads(1)  # after; xdist's controller, which runs no test, never: ~2 s saved there)

#: test modules whose tests share work done once per process: a 2-rank launch (fsdp_runs, planning_runs; ddp_runs,
#: a session fixture: see SCOPES), every candidate of a search traced (test_planner_floors.every_trace, ~10-20 CPU-s a
#: case, read by two tests), one process running `memplan suggest` on four configs (test_configs_shipped.suggested),
#: FSDP estimates read by several tests (test_estimate_fsdp.default_fsdp_estimate), one `memplan suggest` run
#: read by two tests (test_cli.table_on_24gib), one fresh interpreter running every refused config
#: (test_fast_refusal.refusals), one dry run of the GPU campaign's four parts read by two tests
#: (test_gpu_campaign.dry_run), estimates read by two tests (test_checkpoint_settings.traced)
ONE_WORKER = frozenset({"tests/callback/test_callback_ddp.py", "tests/callback/test_callback_fsdp.py",
                        "tests/commands/test_fast_refusal.py",
                        "tests/estimator/test_fake_copy_ddp.py", "tests/test_planner_floors.py",
                        "tests/test_configs_shipped.py", "tests/estimator/test_estimate_fsdp.py",
                        "tests/commands/test_cli.py", "tests/benchmarks/test_gpu_campaign.py",
                        "tests/estimator/test_checkpoint_settings.py"})
#: modules that read a session fixture of another module's unit, and run in that unit: tests/callback/conftest.py's
#: ddp_runs, one 2-rank launch of most of the DDP driver's scenarios
SCOPES = {"tests/callback/test_callback_final_backward.py": "tests/callback/test_callback_ddp.py",
          "tests/callback/test_callback_lightning_pytorch.py": "tests/callback/test_callback_ddp.py"}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: ignored where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":  # `-n N` alone means "load"; another --dist asked for stands
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerModules(LoadScopeScheduling):
        """Scopes as xdist's loadscope handles them (the largest first): a module of ONE_WORKER (with the modules
        SCOPES puts in it), or one test."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            module = SCOPES.get(module, module)
            return module if module in ONE_WORKER else nodeid

    return OneWorkerModules(config, log)


@pytest.fixture(scope="session", autouse=True)
def _children_see_the_user_install(tmp_path_factory):
    """PYTHONPATH for every child process of this test process (not for xdist's workers, which the controller
    starts before any test runs): child_site's sitecustomize first."""
    hook = child_site.install(tmp_path_factory.mktemp("child-site"))
    with pytest.MonkeyPatch.context() as patch:
        if hook is not None:  # None: this venv keeps the extras elsewhere, children import as this process does
            patch.setenv("PYTHONPATH", str(hook), prepend=os.pathsep)
        yield


@pytest.fixture(autouse=True)
def _private_calibration(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MEMPLAN_CALIBRATION", str(home / "calibration.json"))
