"""What LightningCLI's parser refused, in memplan's words: one line naming the YAML key path as the config
writes it, and the fix.

jsonargparse reports a refusal as indented text: the parser key at fault, the class_path it was reading there
(`Problem with given class_path 'memplan.demos.MLP'`), nested as deep as the config nests classes, and the
reason at the bottom (`Option 'hiden' is not accepted`, `Expected a <class 'int'>. Got value: two`). This
module reads that chain into a key path (model.init_args.backbone.init_args.width, trainer.callbacks[1]...)
and says the fix with what the parser knows of the class there (its parameters, for a did-you-mean and the
type an argument takes, in words: memplan.compat.jsonargparse). It checks nothing itself: the parser did.
"""
from __future__ import annotations

import collections.abc
import importlib
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memplan.config.errors import ConfigError, did_you_mean

_NOISE = re.compile(r"^(Subtypes:|Given value|Errors:|Does not validate against any of the Union subtypes|"
                    r"Subclass types expect one of|a class path \(str\)|a dict with|a dict without|"
                    r"Expected a <class 'NoneType'>)")
_KEY = re.compile(r'^(?:Parser key|Key) "([^"]+)"(?: element (\d+))?')
_FRAME = re.compile(r"^Problem with given class_path '([^']+)'")
_SKIPPED = {"optimizer": "params", "lr_scheduler": "optimizer"}
"""The argument LightningCLI passes itself, per section (add_optimizer_args / add_lr_scheduler_args skip it)."""


@dataclass(frozen=True)
class _Reason:
    key: str
    """The YAML key path at fault."""
    class_path: str | None
    """The class the parser was reading there (resolved: AdamW -> torch.optim.AdamW), if any."""
    owner: str
    """The key of that class's section (model, trainer.callbacks[1], model.init_args.backbone)."""
    text: str
    """jsonargparse's reason, one line."""


def refused(message: str, raw: Mapping[str, Any], package: str) -> ConfigError:
    """The ConfigError for jsonargparse's refusal `message` of the config `raw` (as read from the YAML)."""
    reason = _read(message, raw)
    text = reason.text
    if found := re.match(r"Option '([^']+)' is not accepted|Group '([^']+)' does not accept option '([^']+)'", text):
        name = found.group(1) or found.group(3)
        key = f"{reason.owner}.init_args.{name}" if found.group(1) else f"{found.group(2)}.{name}"
        cls = _class(reason, package) if found.group(1) else _trainer(package)
        accepted = [p.name for p in _parameters(cls) if p.name != _SKIPPED.get(reason.owner)]
        return ConfigError(key, f"{key}: {_name(cls, reason)} has no argument {name!r}{did_you_mean(name, accepted)}; "
                           f"its arguments are {', '.join(accepted) or '(none)'}")
    if found := re.match(r"the following arguments are required: (.+)$", text):
        name = found.group(1).split(",")[0].strip()
        prefix = f"{reason.owner}.init_args"
        return ConfigError(f"{prefix}.{name}", f"{prefix}.{name} is missing: {_name(_class(reason, package), reason)} "
                           f"requires it (no default); add it under {prefix}")
    if found := re.match(r"Import path (\S+) does not correspond to a subclass of (\w+)", text):
        key, given = f"{reason.key}.class_path", _lookup(raw, f"{reason.key}.class_path") or found.group(1)
        base = found.group(2)
        return ConfigError(key, f"{key} {given!r} is not {'an' if base[0] in 'AEIOU' else 'a'} {base} subclass; "
                           f"LightningCLI's {reason.key} must be one")
    found = re.match(r"Expected a path but (\S+) either not accessible|Expected a dot import path string: (\S+)", text)
    if found and reason.class_path is None:
        key = reason.key + (".class_path" if isinstance(_lookup(raw, reason.key), Mapping) else "")
        name = found.group(1) or found.group(2)
        return ConfigError(key, f"{key} {name!r}: LightningCLI finds no class by that name"
                           f"{_subclass_hint(reason.key, name)}; write its full import path (as {reason.key}: "
                           "{class_path: package.module.ClassName})")
    if re.match(r"No module named|module '[^']+' has no attribute|cannot import name", text) and reason.class_path:
        key = f"{reason.owner}.class_path"
        if (problem := _import_problem(reason.class_path)) is not None:
            return ConfigError(key, f"{key} {reason.class_path!r}: {problem}")
    if text.startswith("Expected a ") or text.startswith("Not a valid subclass"):
        if (typed := _type_refusal(reason, raw, package)) is not None:
            return typed
    key = reason.key
    return ConfigError(key, f"{key or 'the config'}: LightningCLI would refuse this config at launch "
                       f"({f'{reason.class_path}: ' if reason.class_path else ''}{text}); fix {key or 'it'}")


def _read(message: str, raw: Mapping[str, Any]) -> _Reason:
    """The key path, the innermost class_path and the reason of jsonargparse's message, each reason scoped by
    its indentation. Of the reasons a Union lists, one inside a class_path (the deepest) wins over a plain
    type mismatch or another alternative's class."""
    stack: list[tuple[int, list[str], str | None, str]] = [(-1, [], None, "")]  # (indent, parts, class_path, owner)
    found: list[_Reason] = []
    for text in message.splitlines():
        line = text.strip().lstrip("- ").strip()
        if not line or _NOISE.match(line):
            continue
        indent = len(text) - len(text.lstrip(" -"))
        while len(stack) > 1 and stack[-1][0] >= indent:
            stack.pop()
        _, parts, class_path, owner = stack[-1]
        if key := _KEY.match(line):
            names = key.group(1).removeprefix("init_args.").split(".")
            parts = [*parts, "init_args", *names] if class_path is not None else names
            if key.group(2) is not None:
                parts[-1] += f"[{int(key.group(2)) - 1}]"
            stack.append((indent, parts, class_path, owner))
        elif frame := _FRAME.match(line):
            parts = _entry(parts, frame.group(1), raw)
            stack.append((indent, parts, frame.group(1), ".".join(parts)))
        else:
            found.append(_Reason(key=".".join(parts), class_path=class_path, owner=owner or ".".join(parts[:1]),
                                 text=line))
    if not found:
        return _Reason(key="", class_path=None, owner="", text=" ".join(message.split()))
    strong = [r for r in found if r.class_path is not None and not r.text.startswith(_WEAK)]
    return strong[-1] if strong else found[0]


_WEAK = ("Expected a ", "Not a valid", "Import path")
"""Reasons one alternative of a Union gives (the value is not of this type): another may say more."""


def _entry(parts: list[str], class_path: str, raw: Mapping[str, Any]) -> list[str]:
    """`parts` made exact where they name a list of class sections (trainer.callbacks) and jsonargparse did
    not say which element: the one entry whose class_path is this one."""
    section = _lookup(raw, ".".join(parts))
    if not isinstance(section, list):
        return parts
    index = [i for i, entry in enumerate(section) if isinstance(entry, Mapping)
             and class_path.endswith(str(entry.get("class_path", "")).lstrip("."))]
    return [*parts[:-1], f"{parts[-1]}[{index[0]}]"] if len(index) == 1 else parts


def _type_refusal(reason: _Reason, raw: Mapping[str, Any], package: str) -> ConfigError | None:
    """`<key> must be <the type its parameter takes, in words> (<Class>'s argument '<name>'); got <value>`."""
    key = reason.key
    name = key.rsplit(".", 1)[-1]
    if reason.class_path is not None:
        cls = _class(reason, package)
    elif key.startswith("trainer.") and key.count(".") == 1:
        cls = _trainer(package)
    else:
        return None
    annotation = next((p.annotation for p in _parameters(cls) if p.name == name), None)
    if annotation is None:
        return None
    value = _lookup(raw, key)
    return ConfigError(key, f"{key} must be {describe(annotation)} ({_name(cls, reason)}'s argument {name!r}); "
                       f"got {value!r}")


def _class(reason: _Reason, package: str) -> type | None:
    if reason.class_path is None:
        return _trainer(package) if reason.key.startswith("trainer.") else None
    module, _, name = reason.class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _trainer(package: str) -> type:
    return importlib.import_module(package).Trainer


def _name(cls: type | None, reason: _Reason) -> str:
    return cls.__name__ if cls is not None else (reason.class_path or "Trainer").rsplit(".", 1)[-1]


def _parameters(cls: type | None) -> list[Any]:
    from memplan.compat.jsonargparse import signature_parameters

    return [] if cls is None else signature_parameters(cls)


def _import_problem(class_path: str) -> str | None:
    """Why `class_path` does not import, with the fix: the module that does not import, or the names the
    module has (did-you-mean); None where it imports (the failure was inside it)."""
    module_name, _, name = class_path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        return (f"cannot import module {module_name!r} ({type(err).__name__}: {err}). Check the spelling, and run "
                "memplan from the directory your training script runs from (or pip install the package that "
                "defines it)")
    if hasattr(module, name):
        return None
    public = [n for n in vars(module) if not n.startswith("_")]
    return f"module {module_name!r} has no attribute {name!r}{did_you_mean(name, public)}"


_BASES = {"optimizer": ("torch.optim", "Optimizer"), "lr_scheduler": ("torch.optim.lr_scheduler", "LRScheduler")}
"""The base class whose subclasses LightningCLI looks a bare class name up among, per section."""


def _subclass_hint(key: str, name: str) -> str:
    """' (did you mean ...)' among the names of the section's base class's subclasses, or ''."""
    if key not in _BASES:
        return ""
    module, base = _BASES[key]
    found, todo = set(), [getattr(importlib.import_module(module), base)]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__name__ not in found:
                found.add(sub.__name__)
                todo.append(sub)
    return did_you_mean(name, sorted(found))


def _lookup(raw: Mapping[str, Any], key: str) -> Any:
    """The value at a key path such as 'trainer.callbacks[1].init_args.adjust', or None."""
    node: Any = raw
    for part in key.split(".") if key else []:
        name, *indexes = part.split("[")
        node = node.get(name) if isinstance(node, Mapping) else None
        for index in indexes:
            position = int(index.rstrip("]"))
            node = node[position] if isinstance(node, list) and position < len(node) else None
    return node


def describe(hint: Any) -> str:
    """A parameter's type in the words of a YAML value: 'an int', 'a number or null', 'a list', 'one of ...'."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(hint)
        if int in args and float in args:  # int | float: any number
            args = tuple(a for a in args if a is not int)
        return " or ".join(dict.fromkeys(describe(arg) for arg in args))
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
