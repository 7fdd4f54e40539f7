"""Formats from what people type: ``int8``, ``fp8``, ``bnb-nf4``, ``int4:64``, ``NF4(block_size=32)``.

A name is an alias (:data:`ALIASES`: ``fp8``, ``float8-row``, ``int4``,
``nf4``, ``bnb-nf4``, ``mxfp4``, ...), a format's class name, or a unique
prefix of one, case, ``-`` and ``_`` ignored, so formats added later are
found without a table. Arguments follow after ``:`` (``int4:64``,
``int4:group_size=64``) or in parentheses as the format's repr writes them
(``NF4(block_size=32, scaler_block_size=256)``); a dtype by its name
(``float16``, ``torch.float16``). Only formats the planner can plan are
offered: a format class that cannot be built with its defaults or whose
layout the planner cannot read (an abstract base such as
``FlatBlockedFormat``) is not.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re

import torch

from .. import _formats  # noqa: F401  (the built-in formats register as subclasses)
from .._core.format import QuantFormat

#: What people type, to the class it means (normalized: lower case, no "-" or "_").
ALIASES = {
    "fp8": "Float8Rowwise", "float8": "Float8Rowwise", "fp8row": "Float8Rowwise", "float8row": "Float8Rowwise",
    "fp8rowwise": "Float8Rowwise", "fp8tensor": "Float8Tensorwise", "float8tensor": "Float8Tensorwise",
    "fp8block": "Float8Blockwise", "float8block": "Float8Blockwise", "fp8blockwise": "Float8Blockwise",
    "int4": "Int4Groupwise", "int4g": "Int4Groupwise", "int4zero": "Int4GroupwiseIntZero",
    "int4z": "Int4GroupwiseIntZero", "gptq": "Int4GroupwiseIntZero", "awq": "Int4GroupwiseIntZero",
    "int8": "Int8Rowwise", "nf4": "NF4", "bnbnf4": "BnbNF4", "bitsandbytes": "BnbNF4", "nf4bs": "NF4BlockScales",
    "mxfp4": "MXFP4",
}  # fmt: skip


def _norm(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def _subclasses(cls) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


@functools.cache
def _plannable(cls: type) -> bool:
    """Whether the planner can plan ``cls`` (built with its defaults, one weight checked at TP 2)."""
    from .planner.cells import Layer, check

    try:
        check(Layer("w", (256, 256), "colwise"), cls(), 1, 2)
    except Exception:
        return False
    return True


def plannable_formats() -> dict[str, type]:
    """The format classes the planner can plan, by name."""
    return {c.__name__: c for c in _subclasses(QuantFormat) if not c.__name__.startswith("_") and _plannable(c)}


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    dtype = getattr(torch, text.removeprefix("torch."), None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return text.strip("'\"")


def _literal(node: ast.AST):
    """A literal argument, or a dtype written ``torch.float16`` / ``float16``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
        return _value(node.attr)
    if isinstance(node, ast.Name):
        return _value(node.id)
    return ast.literal_eval(node)


def _arguments(text: str) -> tuple[list, dict]:
    """``64, scale_dtype=float16`` -> ``([64], {"scale_dtype": torch.float16})``."""
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        return [_literal(a) for a in call.args], {k.arg: _literal(k.value) for k in call.keywords}
    except (SyntaxError, ValueError, TypeError):
        raise ValueError(f"cannot read the arguments {text!r}: write them as 64 or group_size=64") from None


def _known(classes) -> str:
    return ", ".join(sorted(classes)) + "; or " + ", ".join(sorted(ALIASES))


def parse_format(spec: str) -> QuantFormat:
    """``"int4:64"`` -> ``Int4Groupwise(64)``; raises ValueError naming the known formats."""
    match = re.fullmatch(r"\s*([\w.-]+)\s*(?::(.*)|\((.*)\))?\s*", spec, flags=re.S)
    classes = plannable_formats()
    name = _norm(match.group(1)).removeprefix("dq.").removeprefix("dtensorquant.") if match else ""
    if name in ALIASES:
        found = [classes[ALIASES[name]]]
    else:
        found = [c for n, c in classes.items() if _norm(n) == name] or [
            c for n, c in classes.items() if _norm(n).startswith(name)
        ]
    # "int4g" names Int4Groupwise, not also Int4GroupwiseIntZero: a match that is a prefix of every other wins.
    shortest = min(found, key=lambda c: len(c.__name__), default=None)
    if len(found) > 1 and all(_norm(c.__name__).startswith(_norm(shortest.__name__)) for c in found):
        found = [shortest]
    if not match or not name or len(found) != 1:
        what = f"{spec!r} could mean {', '.join(c.__name__ for c in found)}" if len(found) > 1 else repr(spec)
        raise ValueError(f"unknown format {what}: expected one of {_known(classes)} (e.g. int4:64, NF4(block_size=32))")
    text = match.group(2) if match.group(2) is not None else match.group(3) or ""
    if match.group(2) is not None and "=" not in text:  # int4:64,float16 -- positional, bare names
        args, kwargs = [_value(a.strip()) for a in text.split(",") if a.strip()], {}
    else:
        args, kwargs = _arguments(text)
    cls = found[0]
    try:
        return cls(*args, **kwargs)
    except (TypeError, ValueError) as e:
        takes = ""
        if dataclasses.is_dataclass(cls):
            takes = f"; {cls.__name__} takes {', '.join(f.name for f in dataclasses.fields(cls) if f.init)}"
        raise ValueError(f"{cls.__name__}({text}): {e}{takes} (e.g. {cls()!r})") from None
