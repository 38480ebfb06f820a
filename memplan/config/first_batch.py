"""One batch from the config's datamodule: the heaviest of the first few its train_dataloader yields, for
the estimate to trace on."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memplan.config.classes import MISSING, ClassSpec
from memplan.config.errors import ConfigError

def heaviest_batch(loader: Any) -> tuple[Any, str | None]:
    """(the heaviest batch per sample of up to SCAN_BATCHES of `loader`, which one it is in words):
    collate only, RNGs restored (memplan.shapes); the first batch where its size cannot be read."""
    from memplan.batching import batch_size_of
    from memplan.shapes import SCAN_BATCHES, SCAN_SECONDS, heaviest

    try:
        found = heaviest(loader, batch_size_of, max_batches=SCAN_BATCHES, seconds=SCAN_SECONDS)
    except ValueError:
        return next(iter(loader)), None
    return found.batch, found.describe()


def first_batch(data: ClassSpec) -> tuple[Any, str | None]:
    """The batch to plan with from the datamodule's train_dataloader(), loaded in this process: the
    heaviest of its first batches for one loader (heaviest_batch), the first of each of several."""
    overrides: dict[str, Any] = {}
    if data.value("num_workers") is not MISSING:
        overrides["num_workers"] = 0  # one batch needs no worker processes
    if data.value("pin_memory") is not MISSING:
        overrides["pin_memory"] = False  # nor pinned memory (which warns on a machine without a GPU)
    if data.value("persistent_workers") is not MISSING:
        overrides["persistent_workers"] = False  # torch refuses persistent workers without workers
    step = f"{data.cls.__name__}(**data.init_args)"
    try:
        datamodule = data.instantiate(**overrides)
        step = f"{data.cls.__name__}.setup('fit')"
        datamodule.setup("fit")
        step = f"{data.cls.__name__}.train_dataloader()"
        loaders = datamodule.train_dataloader()
        step = f"iterating {data.cls.__name__}.train_dataloader()"
        if isinstance(loaders, Mapping):  # Lightning combines several loaders into one batch of each
            return {name: next(iter(loader)) for name, loader in loaders.items()}, None
        if isinstance(loaders, (list, tuple)):
            return [next(iter(loader)) for loader in loaders], None
        return heaviest_batch(loaders)
    except StopIteration:
        raise ConfigError("data", f"data: {data.cls.__name__}.train_dataloader() yielded no batch; check "
                          "data.init_args (an empty dataset, or drop_last with fewer samples than a batch)") from None
    except Exception as err:  # the user's datamodule: report it as theirs, with its own message
        raise ConfigError("data", (
            f"data: {step} raised {type(err).__name__}: {err}. memplan takes one batch from the datamodule; "
            "fix data.init_args, or describe the batch in the MemoryPlanner callback's init_args.suggest.batch_spec "
            "instead")) from err
