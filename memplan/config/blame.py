"""Which config values a failure to build or run the model comes from, found in its message.

A model built from config values fails where those values do not fit together, often far from them:
`num_attention_heads: 3` with `hidden_size: 100` is an aten view error in the attention's forward
("shape '[2, 16, 3, 33]' is invalid for input of size 3200") or a ValueError at construction ("The
hidden size (100) is not a multiple of the number of attention heads (3)"). The message holds the
values (and often the words of their names), so the keys can be named as the user wrote them:

- a divisor that does not divide: two int values d and n of the config, n % d != 0, both in the
  message, with n // d there too (the view's head size, when 2 or more) or the words multiple /
  divisible / divide;
- else, for a failure to build, the keys whose names are in the message as words ("hidden size",
  "attention heads").

Nothing is named without that evidence: None, and the failure is reported as it was.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from memplan.config.errors import ConfigError
from memplan.estimator.errors import EstimateError

_MAX_DEPTH = 6
_FILLER = {"num", "n", "number", "of", "the"}


@dataclass(frozen=True, kw_only=True)
class Blame:
    """The config keys a failure comes from, and the fix, in words."""

    keys: tuple[str, ...]
    """Dotted YAML keys, as written (model.init_args.config.num_attention_heads)."""
    what: str
    """What is wrong with them."""
    fix: str


def blamed(message: str, raw: Mapping[str, Any], failed: str, *, by_name: bool = True) -> ConfigError | None:
    """A ConfigError naming the model: / data: values `message` comes from (with `failed`, what failed,
    in words), or None without evidence. `by_name=False`: only a divisor that does not divide (a step's
    messages name arguments of ops, not of the config)."""
    values = [*int_values(raw.get("model"), "model"), *int_values(raw.get("data"), "data")]
    found = blame(message, values, by_name=by_name)
    if found is None:
        return None
    return ConfigError(found.keys[0], " ".join(f"{found.what}: {failed}; {found.fix}".split()))  # one line


def estimate_blame(err: EstimateError, *, raw: Mapping[str, Any], model_class: str, init_args: Mapping[str, Any],
                   batch_spec_key: str | None) -> ConfigError | None:
    """The ConfigError for a failure to trace a config (`err`, from its fields: never its message), or None
    to let it stand: about the batch, naming where the batch came from (`batch_spec_key`, the key path the
    config's batch_spec is written at, else data); about building the model, naming the model.init_args keys it comes from; about the model's
    step, naming config values only when a divisor that does not divide shows it (blamed())."""
    if err.argument == "batch":
        key = batch_spec_key or "data"
        fix = (f"that {key} describes the batch exactly as training_step receives it (structure, "
               "shapes, dtypes)" if batch_spec_key else "that data.init_args agree with it")
        return ConfigError(key, f"{key} and model.init_args do not work together: {model_class}'s training step "
                           f"failed on a batch from {key}: {err.detail}; check model.init_args (the model's own "
                           f"sizes) and {fix}")
    if err.argument != "model":
        return None
    if err.stage == "build" and err.cause is not None:  # the model's own constructor raised
        what = err.cause
        found = blamed(what, raw, f"{model_class}(**init_args) failed: {what}")
        if found is not None:
            return found
        named = [name for name in init_args if re.search(rf"\b{re.escape(str(name))}\b", what)]
        key = f"model.init_args.{named[0]}" if len(named) == 1 else "model.init_args"
        return ConfigError(key, f"{key}: {model_class}(**init_args) failed: {what}; fix {key}")
    # the step failed in the model: on config values that do not fit?
    return blamed(err.detail or "", raw, f"{model_class}'s training step failed: {err.detail}", by_name=False)


def int_values(section: Any, prefix: str, depth: int = 0) -> Iterator[tuple[str, int]]:
    """(dotted key, value) of every int under `section` (nested mappings: a transformers config dict,
    a class_path / init_args pair), bools left out."""
    if depth > _MAX_DEPTH or not isinstance(section, Mapping):
        return
    for key, value in section.items():
        path = f"{prefix}.{key}"
        if isinstance(value, int) and not isinstance(value, bool):
            yield path, value
        elif isinstance(value, Mapping):
            yield from int_values(value, path, depth + 1)


def blame(message: str, values: list[tuple[str, int]], *, by_name: bool = True) -> Blame | None:
    """The keys among `values` that `message` (a failure's text) shows it comes from, or None."""
    numbers = {int(n) for n in re.findall(r"(?<![\w.])\d{1,12}(?![\w.])", message)}
    text = " " + re.sub(r"[^a-z0-9]+", " ", message.lower()) + " "
    named = {key: _named_in(key, text) for key, _ in values}
    pairs = []
    says_divide = re.search(r"multiple|divisible|divide", text) is not None
    for d_key, d in values:
        for n_key, n in values:
            quotient = n // d >= 2 and n // d in numbers  # (a 1 is in too many messages to tell anything)
            if d >= 2 and n > d and n % d and d in numbers and n in numbers and (says_divide or quotient):
                pairs.append((named[d_key] + named[n_key], d_key, d, n_key, n))
    if pairs:
        best = max(p[0] for p in pairs)
        pairs = [p for p in pairs if p[0] == best]
        dividends = {(n_key, n) for _, _, _, n_key, n in pairs}
        if len(dividends) == 1:
            (n_key, n), divisors = dividends.pop(), [(d_key, d) for _, d_key, d, _, _ in pairs]
            shown = " (or ".join(f"{k} ({v})" for k, v in divisors) + ")" * (len(divisors) - 1)
            near = _divisors_near(n, divisors[0][1])
            return Blame(keys=(*(k for k, _ in divisors), n_key),
                         what=f"{shown} does not divide {n_key} ({n})",
                         fix=f"set {divisors[0][0]} to a divisor of {n} ({', '.join(map(str, near))}) or {n_key} "
                             f"to a multiple of {divisors[0][1]}")
    keys = tuple(key for key, _ in values if named[key]) if by_name else ()
    if keys:
        return Blame(keys=keys, what=f"the failure names {', '.join(keys)}", fix=f"fix {', '.join(keys)}")
    return None


def _named_in(key: str, text: str) -> int:
    """1 when the key's name is in `text` as words (hidden_size: 'hidden size'; num_attention_heads:
    'attention heads'), else 0."""
    words = [w for w in re.split(r"[^a-z0-9]+", key.rsplit(".", 1)[-1].lower()) if w and w not in _FILLER]
    if not words:
        return 0
    pattern = r" " + r" (?:of )?".join(re.escape(w.rstrip("s")) + r"s?" for w in words) + r" "
    return 1 if re.search(pattern, text) else 0


def _divisors_near(n: int, d: int, count: int = 3) -> list[int]:
    """Divisors of n closest to d (at least 2), up to `count`."""
    found = [k for k in range(2, min(n, 4096) + 1) if n % k == 0]
    return sorted(sorted(found, key=lambda k: (abs(k - d), k))[:count])
