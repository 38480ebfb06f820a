"""The private jsonargparse function memplan reads: the parameters LightningCLI's parser takes for a class.

jsonargparse (the parser under LightningCLI) reports a refused config as text; memplan names the fix from
what the parser itself knows of the class at fault: its parameters, as jsonargparse resolves them (following
`**kwargs` into the parent classes they are passed to, as LightningCLI does), for a did-you-mean and for the
type an argument takes, in words. Nothing here checks a type: the parser did.
"""
from __future__ import annotations

from typing import Any

KNOWN_JSONARGPARSE = ">=4.39,<=4.53"
"""jsonargparse versions `_parameter_resolvers.get_signature_parameters` is known for (pyproject's floor, 4.39,
to the installed 4.53)."""


def signature_parameters(cls: type) -> list[Any]:
    """`jsonargparse._parameter_resolvers.get_signature_parameters(cls, None)` (jsonargparse 4.39-4.53): the
    parameters of cls.__init__ the parser accepts, each with .name, .annotation, .default; [] where the
    function is gone (an upgrade: messages then name no argument, the refusal itself still stands)."""
    try:
        from jsonargparse._parameter_resolvers import get_signature_parameters
    except ImportError:
        return []
    try:
        return list(get_signature_parameters(cls, None))
    except Exception:  # noqa: BLE001  (a class jsonargparse cannot read: no names to offer, the refusal stands)
        return []
