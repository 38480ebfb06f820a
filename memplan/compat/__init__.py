"""Every private attribute of torch and Lightning that memplan reads, one module per package.

    memplan.compat.torch         fake tensors, dispatch keys, autograd, nn.Module and FSDP2 internals
    memplan.compat.lightning     the Trainer's loops, strategies, signal connector, logger cadence
    memplan.compat.torchmetrics  a Metric's state defaults
    memplan.compat.versions      the versions each is known for, and the check of the installed ones

Each name says the versions it is known for. tests/compat/test_compat_private_access.py fails where any other
module of memplan uses a private torch or Lightning name. The installed versions are checked where
MemoryPlanner is set up and where `memplan.estimate` and `memplan suggest` run (a warning naming the
installed version and the known range); .ci/versions runs a smoke subset on the lowest and the highest
versions of the range.

The names below keep `from memplan import compat; compat.ddp_kwargs(...)` working for existing callers;
each is imported when first used (PEP 562), so `memplan.compat.versions` and `.lightning` import no torch.
Do not name a global `torch` or `lightning` here: importing the submodules sets those attributes.
"""
from memplan.lazy import lazy_exports

_LAZY = {
    **dict.fromkeys(("attach_stand_in_trainer", "ddp_kwargs", "layer_sync", "logger_row_getter",
                     "skip_backward_getter", "train_data_source"), "memplan.compat.lightning"),
    **dict.fromkeys(("has_gradient_hooks", "rebuilt_buckets_getter", "tensor_version"), "memplan.compat.torch"),
    **dict.fromkeys(("LIGHTNING_RANGE", "TORCH_RANGE", "IncompatibleVersionError", "VersionWarning",
                     "check_installed", "installed_version", "within"), "memplan.compat.versions"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
