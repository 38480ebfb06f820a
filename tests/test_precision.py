"""Lightning's precision aliases read alike everywhere: a flag, a YAML key, a plan file (memplan.precision)."""
from __future__ import annotations

import pytest

from memplan.config.errors import ConfigError
from memplan.config.settings import MemplanSettings, normalize_precision
from memplan.plan import Plan
from memplan.precision import PRECISIONS, canonical_precision

ALIASES = [(16, "16-mixed"), ("16", "16-mixed"), ("bf16", "bf16-mixed"), (32, "32-true"), ("32", "32-true"),
           ("16-mixed", "16-mixed"), ("bf16-true", "bf16-true")]
PLAN = {"gpu_name": "A100-80GB", "nodes": 1, "world_size": 1, "micro_batch_size": 8, "accumulate_grad_batches": 1,
        "global_batch_size": 8, "gradient_checkpointing": False, "strategy": "auto", "predicted_peak_bytes": 1,
        "device_budget_bytes": 2, "host_bytes_per_rank": 3}


@pytest.mark.parametrize(("given", "canonical"), ALIASES)
def test_an_alias_means_the_same_on_the_command_line_in_yaml_and_in_a_plan_file(given, canonical):
    from memplan.commands.args import precision

    assert precision("--precision")(str(given)) == canonical
    assert normalize_precision(given, name="trainer.precision") == canonical
    assert MemplanSettings.from_dict({"precisions": [given]}).precisions == (canonical,)
    assert Plan.from_dict({**PLAN, "precision": given}).precision == canonical


@pytest.mark.parametrize("bad", [64, "64-true", "transformer-engine", "fp16", "BF16", True, 16.0, None, ["16"]])
def test_what_memplan_does_not_estimate_is_refused_by_the_name_given(bad):
    with pytest.raises(ValueError, match="^--precision"):
        canonical_precision(bad, name="--precision")
    with pytest.raises(ConfigError, match=r"^memplan.precisions\[0\]") as info:
        MemplanSettings.from_dict({"precisions": [bad]})
    assert info.value.key == "memplan.precisions[0]"


def test_the_estimator_shares_the_one_list():
    from memplan.estimator.result import PRECISIONS as ESTIMATED

    assert ESTIMATED is PRECISIONS
