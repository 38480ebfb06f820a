"""A config's top-level keys, checked as LightningCLI's `fit` will check them, before any work.

LightningCLI's parser accepts only the keys it knows: its sections (trainer, model, data, optimizer,
lr_scheduler, seed_everything), `config`, the fit method's own arguments (ckpt_path; weights_only in
Lightning 2.6), and what its subclass adds (memplan.train still adds the deprecated `memplan:`, which
memplan reads until memplan.config.placement.REMOVED_IN; memplan's settings now live in the MemoryPlanner
callback's init_args, which every LightningCLI accepts). Any other key
(a holder for YAML anchors, a note) would be planned, written back into the planned config, and then
refused by the launch ("Subcommand 'fit' does not accept option 'defaults.lr'"): memplan refuses it
first, naming it and the fix.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from memplan.config.errors import ConfigError

SECTIONS = ("seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler", "ckpt_path", "memplan")
"""The top-level keys every Lightning version memplan supports takes for `fit` (memplan:, deprecated, through
memplan.train)."""
ALSO_ACCEPTED = ("config",)
"""Keys LightningCLI takes that are not sections (`config:` names another config file)."""
SUBCOMMANDS = ("fit", "validate", "test", "predict")


def check_sections(raw: Mapping[str, Any], path: object) -> None:
    """Refuse a top-level key LightningCLI's `fit` would refuse, naming it and the fix."""
    unknown = [str(key) for key in raw if str(key) not in SECTIONS and str(key) not in ALSO_ACCEPTED]
    if not unknown:
        return
    accepted = tuple(dict.fromkeys((*SECTIONS, *ALSO_ACCEPTED, *fit_arguments())))
    for key in unknown:
        if key in accepted:
            continue
        value = raw[key]
        close = difflib.get_close_matches(key, SECTIONS, n=1, cutoff=0.8)  # modle, trainr; not optimizer_config
        if close:
            raise ConfigError(key, f"{key}: is not a LightningCLI section (did you mean {close[0]!r}?); the "
                              f"sections are {', '.join(SECTIONS)}")
        if key in SUBCOMMANDS:
            raise ConfigError(key, (
                f"{key}: in {path} holds a subcommand's settings (a config for `train.py --config FILE {key}`); "
                f"memplan reads the config given to `fit --config FILE`, with trainer:, model:, data: at the top "
                f"level: move what is under {key}: up one level"))
        anchors = (" To share values between sections with YAML anchors, define each anchor where its value is "
                   "first used (e.g. model.init_args.vocab_size: &vocab 32000, then data.init_args.vocab_size: "
                   "*vocab) instead of in a key of its own." if isinstance(value, (Mapping, list)) else "")
        raise ConfigError(key, (
            f"{key}: in {path} is not a key LightningCLI's fit accepts at the top level, so LightningCLI (memplan's "
            f"memplan.train included) would refuse this config and the planned one; remove {key}:.{anchors} "
            f"The top-level keys are {', '.join(accepted)}"))


def fit_arguments() -> tuple[str, ...]:
    """Trainer.fit's arguments LightningCLI takes from a config: ckpt_path, and weights_only from
    Lightning 2.6.0 on (its CHANGELOG: "Expose `weights_only` argument for `Trainer.{fit,...}`"). Read
    from the installed version's number, not by importing Lightning (seconds, for a refusal)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(part) for part in version("pytorch-lightning").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return ("ckpt_path", "weights_only")
    return ("ckpt_path", "weights_only") if (major, minor) >= (2, 6) else ("ckpt_path",)
