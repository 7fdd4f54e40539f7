"""Formats from short command-line strings: ``int8``, ``int4:64``, ``Int4Groupwise(64)``, ``int4:128,float16``.

The name matches a :class:`~dtensor_quant.QuantFormat` subclass by its class
name or by a unique prefix of it (case-insensitive), so formats added later
are found without a table; arguments after ``:`` (or in parentheses) are
passed positionally (a dtype by its name: ``float16``, ``bfloat16``).
"""

from __future__ import annotations

import re

from .. import _formats  # noqa: F401  (the built-in formats register as subclasses)
from .._core.format import QuantFormat


def _subclasses(cls) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_format(spec: str) -> QuantFormat:
    """``"int4:64"`` -> ``Int4Groupwise(64)``; raises ValueError naming the known formats."""
    match = re.fullmatch(r"\s*(\w+)\s*(?:[:(]\s*([^)]*?)\s*\)?)?\s*", spec)
    classes = {c.__name__: c for c in _subclasses(QuantFormat) if not c.__name__.startswith("_")}
    name = match.group(1).lower() if match else ""
    found = [c for n, c in classes.items() if n.lower() == name] or [
        c for n, c in classes.items() if n.lower().startswith(name)
    ]
    # "int4" names Int4Groupwise, not also Int4GroupwiseIntZero: a match that is a prefix of every other wins.
    shortest = min(found, key=lambda c: len(c.__name__), default=None)
    if len(found) > 1 and all(c.__name__.lower().startswith(shortest.__name__.lower()) for c in found):
        found = [shortest]
    if not match or len(found) != 1:
        known = ", ".join(sorted(classes))
        raise ValueError(f"unknown format {spec!r}: expected one of {known} (or a prefix, e.g. int4:64)")
    args = [_value(a.strip()) for a in (match.group(2) or "").split(",") if a.strip()]
    return found[0](*args)
