"""The torch and Lightning versions memplan knows, and the check of the installed ones.

The ranges below are pyproject.toml's (tests/compat/test_compat_versions.py checks they match, and that the
installed versions lie inside them); .ci/versions runs a smoke subset on the lowest and the highest
release of each, and .ci/versions.result.md holds its last result.
"""
from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from typing import Any

Bounds = tuple[tuple[int, int], tuple[int, int]]

LIGHTNING_RANGE: Bounds = ((2, 4), (2, 7))
"""pytorch-lightning / lightning versions memplan is known to work with: >= 2.4, < 2.7. (2.2 and 2.3 import
`pkg_resources` without declaring setuptools, which dropped it in 82: a fresh install of them fails to import.)"""
TORCH_RANGE: Bounds = ((2, 7), (2, 14))
"""torch versions whose private attributes memplan.compat.torch reads are known: >= 2.7, < 2.14. Below, as
.ci/versions found them: 2.6 has no Meta kernels for c10d's collectives (the FSDP2 trace fails), 2.5 no
`torch.distributed.fsdp.CPUOffloadPolicy` (FSDP2's public home), 2.4 no `torch.utils.checkpoint.CheckpointPolicy`
(nothing that imports memplan.estimator.checkpointing starts)."""

PACKAGES: tuple[tuple[str, Bounds], ...] = (
    ("pytorch-lightning", LIGHTNING_RANGE), ("lightning", LIGHTNING_RANGE), ("torch", TORCH_RANGE))
"""Each package memplan.compat reaches into, with its known range."""


class IncompatibleVersionError(RuntimeError):
    """A private attribute of Lightning or torch that memplan needs is not where it was."""


class VersionWarning(UserWarning):
    """torch or Lightning is installed at a version outside the range memplan knows."""


def release_numbers(text: str, count: int) -> tuple[int, ...]:
    """The first `count` numbers of a version string, 0 where missing: ('2.5.0.post0', 3) -> (2, 5, 0),
    ('2.7.0rc1', 2) -> (2, 7), ('2.13.0+cpu', 3) -> (2, 13, 0)."""
    numbers = [int(m.group()) if (m := re.match(r"\d+", part)) else 0 for part in text.split(".")[:count]]
    return tuple(numbers + [0] * (count - len(numbers)))


def version_tuple(text: str) -> tuple[int, int]:
    """(major, minor) of a version string: '2.13.0+cpu' -> (2, 13), '2.7.0rc1' -> (2, 7)."""
    major, minor = release_numbers(text, 2)
    return major, minor


def installed_version(package: str) -> str | None:
    """The installed version of `package`, or None."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


LIGHTNING_AUTOCAST_CACHE_OFF = (2, 5, 5)
"""The first release whose Trainer's MixedPrecision plugin autocasts with `cache_enabled=False` (pytorch_lightning
and lightning.pytorch plugins/precision/amp.py, read from the released wheels: 2.5.4 and earlier write
`torch.autocast(device, dtype=dtype)`; Lightning PR #20921). Fabric's plugin keeps the cache on, as memplan's plain
loops do. Lightning's master (PR #21616, not in 2.6.6) brings a cached forward_context back: re-check this when
LIGHTNING_RANGE takes in 2.7."""


def lightning_autocast_caches(distribution: str = "pytorch-lightning") -> bool:
    """Whether the installed Lightning's autocast keeps torch's weight-cast cache on (releases before
    LIGHTNING_AUTOCAST_CACHE_OFF), read from `distribution`'s metadata ("pytorch-lightning" or "lightning", the
    package the Trainer comes from; the other where that one is not installed), without importing either. With
    neither installed: False, as the current releases run."""
    other = "lightning" if distribution == "pytorch-lightning" else "pytorch-lightning"
    text = installed_version(distribution) or installed_version(other)
    if text is None:
        return False
    return release_numbers(text, 3) < LIGHTNING_AUTOCAST_CACHE_OFF


def within(text: str, bounds: Bounds) -> bool:
    """Whether version `text` lies in [low, high) by major.minor."""
    low, high = bounds
    return low <= version_tuple(text) < high


def known(bounds: Bounds) -> str:
    """The range as a requirement's specifier: '>=2.4,<2.7'."""
    (a, b), (c, d) = bounds
    return f">={a}.{b},<{c}.{d}"


def require(owner: Any, name: str, package: str) -> None:
    """Raise IncompatibleVersionError, naming the attribute, the installed version and the known range,
    where `owner` has no attribute `name`."""
    if not hasattr(owner, name):
        bounds = TORCH_RANGE if package == "torch" else LIGHTNING_RANGE
        raise IncompatibleVersionError(
            f"memplan reads {type(owner).__name__}.{name}, which this {package} "
            f"({installed_version(package) or 'unknown version'}) does not have; it is known in {package}"
            f"{known(bounds)}. Install a {package} in that range, or a memplan that supports this one")


def check_installed(who: str = "MemoryPlanner") -> list[str]:
    """What is installed outside the known ranges, in words naming `who` (empty: all inside)."""
    found = []
    for package, bounds in PACKAGES:
        text = installed_version(package)
        if text is not None and not within(text, bounds):
            found.append(f"{package} {text} is outside the versions {who} is known to work with "
                         f"({package}{known(bounds)})")
    return found


_checked = False


def check_installed_once(who: str) -> list[str]:
    """`check_installed(who)` the first time a process asks (estimate, suggest); empty after, so a plan
    that runs many estimates says it once."""
    global _checked
    if _checked:
        return []
    _checked = True
    return check_installed(who)
