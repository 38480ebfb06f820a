"""`class_path` + `init_args` sections, as LightningCLI (jsonargparse) reads them: imported and
checked against the class's signature when the config loads, instantiated only when asked.

Nested `{class_path, init_args}` values inside init_args (a backbone, a loss module) are checked the
same way and instantiated, innermost first, when their owner is.
"""
from __future__ import annotations

import collections.abc
import contextlib
import importlib
import inspect
import os
import sys
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from memplan.config.errors import ConfigError, did_you_mean

_SECTION_KEYS = ("class_path", "init_args", "dict_kwargs")


@dataclass(frozen=True, kw_only=True)
class ClassSpec:
    """A checked `class_path` + `init_args` section; nothing instantiated."""

    key: str
    """Its YAML key, e.g. 'model' or 'model.init_args.backbone'."""
    class_path: str
    """As written in the config."""
    cls: type
    """The imported class."""
    init_args: dict[str, Any]
    """Keyword arguments (with dict_kwargs merged); nested sections are ClassSpecs."""

    def instantiate(self, *leading: Any, **overrides: Any) -> Any:
        """cls(*leading, **init_args | overrides), nested sections instantiated first."""
        kwargs = {name: _instantiate(value) for name, value in {**self.init_args, **overrides}.items()}
        return self.cls(*leading, **kwargs)

    def signature_default(self, name: str) -> Any:
        """The default of an __init__ parameter, or inspect.Parameter.empty."""
        parameter = _parameters(self.cls).get(name)
        return inspect.Parameter.empty if parameter is None else parameter.default

    def accepts(self, name: str) -> bool:
        params = _parameters(self.cls)
        return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def parse_class_section(value: Any, key: str, *, base: str | None = None, default_module: str | None = None,
                        leading: int = 0) -> ClassSpec:
    """Check a `class_path` section. `base`: the name of a class it must derive from (matched by name,
    so both `lightning` and `pytorch_lightning` classes pass). `default_module`: where a bare class name
    is looked up (torch.optim for `optimizer: AdamW`). `leading`: positional arguments memplan passes
    itself (an optimizer's params), not expected in init_args."""
    if isinstance(value, str):
        value = {"class_path": value}
    if not isinstance(value, Mapping) or "class_path" not in value:
        raise ConfigError(f"{key}.class_path", (
            f"{key}.class_path is missing; memplan reads LightningCLI's form, "
            f"{key}: {{class_path: your_package.module.ClassName, init_args: {{...}}}}"))
    for extra in value:
        if extra not in _SECTION_KEYS:
            raise ConfigError(f"{key}.{extra}", (
                f"{key}.{extra}: init arguments go under {key}.init_args (LightningCLI accepts only "
                f"{', '.join(_SECTION_KEYS)} beside each other)"))
    class_path = value["class_path"]
    cls = _import_class(class_path, f"{key}.class_path", default_module)
    if base is not None and not any(c.__name__ == base for c in inspect.getmro(cls)):
        raise ConfigError(f"{key}.class_path", f"{key}.class_path {class_path!r} is not a {base} subclass; "
                          f"LightningCLI's {key} must be one")
    init_args: dict[str, Any] = {}
    for section in ("init_args", "dict_kwargs"):
        given = value.get(section) or {}
        if not isinstance(given, Mapping):
            raise ConfigError(f"{key}.{section}",
                              f"{key}.{section} must be a mapping of argument names to values; got {given!r}")
        init_args.update(given)
    _check_arguments(cls, init_args, key, leading)
    nested = {name: _parse_nested(arg, f"{key}.init_args.{name}") for name, arg in init_args.items()}
    return ClassSpec(key=key, class_path=class_path, cls=cls, init_args=nested)


def _import_class(class_path: Any, key: str, default_module: str | None) -> type:
    if not isinstance(class_path, str) or not class_path:
        raise ConfigError(key, f"{key} must be an import path such as 'my_package.models.MyModel'; got {class_path!r}")
    module_name, _, name = class_path.rpartition(".")
    if not module_name:
        if default_module is None:
            raise ConfigError(key, f"{key} {class_path!r} must be a full import path such as "
                              f"'my_package.models.{class_path}' (memplan does not search for bare class names)")
        module_name = default_module
    # `python train.py` imports from the directory it runs in; memplan does the same.
    with _cwd_on_path():
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ConfigError(key, (
                f"{key} {class_path!r}: cannot import module {module_name!r} ({type(err).__name__}: {err}). "
                "Check the spelling, and run memplan from the directory your training script runs from "
                "(or pip install the package that defines it)")) from err
    cls = getattr(module, name, None)
    if cls is None:
        public = [n for n in vars(module) if not n.startswith("_")]
        raise ConfigError(key, f"{key} {class_path!r}: module {module_name!r} has no attribute {name!r}"
                          f"{did_you_mean(name, public)}")
    if not inspect.isclass(cls):
        raise ConfigError(key, f"{key} {class_path!r} is a {type(cls).__name__}, not a class")
    return cls


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(cls).parameters)
    except (ValueError, TypeError):  # no signature to read (a builtin): accept anything
        return {"kwargs": inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)}


def check_arguments(cls: type, arguments: Mapping[str, Any], prefix: str, *, leading: int = 0) -> None:
    """Check keyword arguments for `cls` as LightningCLI would: each one it takes (did-you-mean for the rest),
    each of the type its annotation says where that can be told, every required one given. `prefix` is
    their YAML path ('model.init_args', 'trainer'): a ConfigError names `prefix.<argument>`."""
    _check_arguments(cls, arguments, prefix.rsplit(".init_args", 1)[0], leading, prefix=prefix)


def _check_arguments(cls: type, init_args: Mapping[str, Any], key: str, leading: int, *,
                     prefix: str | None = None) -> None:
    prefix = f"{key}.init_args" if prefix is None else prefix
    params = _parameters(cls)
    named = [p for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    accepted = [p.name for p in named[leading:]]
    if not takes_any:
        for name in init_args:
            if name not in accepted:
                hint = did_you_mean(str(name), accepted)
                raise ConfigError(f"{prefix}.{name}", (
                    f"{prefix}.{name}: {cls.__name__} has no argument {name!r}{hint}; "
                    f"its arguments are {', '.join(accepted) or '(none)'}"))
    hints = _type_hints(cls)
    for name, value in init_args.items():
        parameter = params.get(name)
        if parameter is not None:
            problem = _type_problem(value, hints.get(name, parameter.annotation), parameter.default)
            if problem is not None:
                raise ConfigError(f"{prefix}.{name}", (
                    f"{prefix}.{name} must be {problem} ({cls.__name__}'s argument {name!r}); got {value!r}"))
    for p in named[leading:]:
        if p.default is p.empty and p.name not in init_args:
            raise ConfigError(f"{prefix}.{p.name}", (
                f"{prefix}.{p.name} is missing: {cls.__name__} requires it (no default); "
                f"add it under {prefix}"))


def _type_hints(cls: type) -> dict[str, Any]:
    """cls.__init__'s resolved annotations; {} where they cannot be resolved (forward references)."""
    try:
        return typing.get_type_hints(cls.__init__)
    except (NameError, TypeError, AttributeError, SyntaxError):
        return {}


def _type_problem(value: Any, hint: Any, default: Any) -> str | None:
    """What `value` should be, when it plainly is not what the argument takes; None when it is, or when
    that cannot be told (an annotation memplan does not read, a nested class section). Without an
    annotation a numeric default stands for it, and only a string in its place is refused."""
    if isinstance(value, Mapping) and "class_path" in value:
        return None
    if hint is inspect.Parameter.empty:
        numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
        return f"a number like its default {default!r}" if numeric and isinstance(value, str) else None
    verdict = _matches(value, hint)
    return None if verdict is not False else _describe(hint)


def _matches(value: Any, hint: Any) -> bool | None:
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        verdicts = [_matches(value, arg) for arg in typing.get_args(hint)]
        return True if True in verdicts else (None if None in verdicts else False)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None) or hint is None:
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else isinstance(value, str)
    if hint in (list, tuple) or origin in (list, tuple, collections.abc.Sequence):
        return isinstance(value, (list, tuple))
    if hint is dict or origin in (dict, collections.abc.Mapping):
        return isinstance(value, Mapping)
    return None


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if hint is type(None) or hint is None:
        return "null"
    names = {bool: "true or false", int: "an int", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    if hint in (list, tuple) or origin in (list, tuple, collections.abc.Sequence):
        return "a list"
    if hint is dict or origin in (dict, collections.abc.Mapping):
        return "a mapping"
    return getattr(hint, "__name__", str(hint))


def _parse_nested(value: Any, key: str) -> Any:
    if isinstance(value, Mapping) and "class_path" in value:
        return parse_class_section(value, key)
    if isinstance(value, list) and any(isinstance(v, Mapping) and "class_path" in v for v in value):
        return [_parse_nested(v, f"{key}[{i}]") for i, v in enumerate(value)]
    return value


def _instantiate(value: Any) -> Any:
    if isinstance(value, ClassSpec):
        return value.instantiate()
    if isinstance(value, list):
        return [_instantiate(v) for v in value]
    return value
