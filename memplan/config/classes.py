"""`class_path` + `init_args` sections as LightningCLI's parser read them (memplan.config.lightning_parser):
the class it imported, the init_args as the config writes them (the key paths messages name) and as the
parser filled them in (every default), instantiated only when asked, by the parser itself.

Before the parser, check_shape refuses, without importing anything, the section forms memplan cannot plan
from: no class_path (the parser would fall back to the bare base class), a bare class name for the model or
the datamodule (LightningCLI resolves one only when its module happens to be imported), and arguments
beside class_path instead of under init_args.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memplan.config.errors import ConfigError

SECTION_KEYS = ("class_path", "init_args", "dict_kwargs")
MISSING = object()
"""What ClassSpec.value returns for a name the class does not take."""


@dataclass(frozen=True, kw_only=True)
class ClassSpec:
    """A parsed `class_path` + `init_args` section; nothing instantiated."""

    key: str
    """Its YAML key, e.g. 'model' or 'optimizer'."""
    class_path: str
    """As the parser resolved it (AdamW -> torch.optim.AdamW)."""
    cls: type
    """The class."""
    init_args: dict[str, Any]
    """The keyword arguments as the config writes them (with dict_kwargs merged)."""
    parsed: Any
    """The parser's Namespace(class_path, init_args): every argument, defaults included."""
    package: str
    """The Lightning package whose parser read it ('pytorch_lightning' or 'lightning.pytorch')."""

    def value(self, name: str) -> Any:
        """The argument `name` as the class gets it (the config's, else its default), or MISSING."""
        init_args = self.parsed.get("init_args")
        return init_args[name] if init_args is not None and name in init_args else MISSING

    def instantiate(self, *leading: Any, **overrides: Any) -> Any:
        """The instance, built by the parser as LightningCLI builds it; `overrides` replace init_args of the
        same name; `leading` (an optimizer's params) go first, as LightningCLI's instantiate_class passes them."""
        from memplan.config.lightning_parser import instantiate, instantiate_with

        section = self.parsed.clone()
        for name, value in overrides.items():
            section[f"init_args.{name}"] = value
        if leading:
            return instantiate_with(self.package, leading, section)
        return instantiate(self.cls, section)


def from_parsed(raw: Any, parsed: Any, key: str, package: str) -> ClassSpec:
    """The ClassSpec of section `key`: `raw` as the config writes it, `parsed` as the parser read it."""
    import importlib

    module, _, name = parsed.class_path.rpartition(".")
    written = raw if isinstance(raw, Mapping) else {}
    init_args = {**(written.get("init_args") or {}), **(written.get("dict_kwargs") or {})}
    return ClassSpec(key=key, class_path=parsed.class_path, cls=getattr(importlib.import_module(module), name),
                     init_args=init_args, parsed=parsed, package=package)


def check_shape(value: Any, key: str, *, bare_names: bool = False) -> None:
    """Refuse a `key:` section memplan cannot read a class from, by its key and with the fix; nothing imported.
    `bare_names`: a class name without its module is fine (the optimizer's AdamW: torch.optim's)."""
    if isinstance(value, str):
        value = {"class_path": value}
    if not isinstance(value, Mapping) or "class_path" not in value:
        raise ConfigError(f"{key}.class_path", (
            f"{key}.class_path is missing; memplan reads LightningCLI's form, "
            f"{key}: {{class_path: your_package.module.ClassName, init_args: {{...}}}}"))
    for extra in value:
        if extra not in SECTION_KEYS:
            raise ConfigError(f"{key}.{extra}", (
                f"{key}.{extra}: init arguments go under {key}.init_args (LightningCLI accepts only "
                f"{', '.join(SECTION_KEYS)} beside each other)"))
    class_path = value["class_path"]
    if not isinstance(class_path, str) or not class_path:
        raise ConfigError(f"{key}.class_path", f"{key}.class_path must be an import path such as "
                          f"'my_package.models.MyModel'; got {class_path!r}")
    if "." not in class_path and not bare_names:
        raise ConfigError(f"{key}.class_path", (
            f"{key}.class_path {class_path!r} must be a full import path such as 'my_package.models.{class_path}' "
            "(LightningCLI finds a bare class name only where its module happens to be imported)"))
    for section in ("init_args", "dict_kwargs"):
        given = value.get(section)
        if given is not None and not isinstance(given, Mapping):
            raise ConfigError(f"{key}.{section}",
                              f"{key}.{section} must be a mapping of argument names to values; got {given!r}")
