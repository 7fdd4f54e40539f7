"""Fields read from a checkpoint's JSON documents, each checked where it is read.

A checkpoint directory comes from anywhere, and its JSON can hold anything: a
list where an object belongs, a missing or null field, a string where a
number goes, a file cut short. ``config.json`` and the producers'
``quantization_config`` in it (compressed-tensors, GPTQ, AWQ, bitsandbytes,
FP8 blocks), and bitsandbytes' ``quant_state`` JSON stored in a tensor, are
read through :class:`Fields`: every field the library uses is read with
:meth:`Fields.field`, which checks it against a :class:`Kind` and raises
:class:`~dtensor_quant.state_dict.CheckpointFormatError` naming the file, the
tensor it is read for, the field, what it holds and what was expected --
never an ``AttributeError``, ``KeyError``, ``TypeError`` or a bare
``JSONDecodeError`` from inside a reader. One helper instead of a
``try``/``except`` at each read: the check and the message are the same
everywhere.

:class:`Fields` is a ``dict``, so code written for the plain document (a
producer registered with :func:`~dtensor_quant._checkpoint.hf.producers.register_producer`)
reads it as before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...state_dict import CheckpointFormatError

REQUIRED = object()  # ``get``'s default: the field must be there


@dataclass(frozen=True)
class Kind:
    """What a field must hold: a description for messages and a test."""

    what: str
    test: Callable[[object], bool]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


INT = Kind("an integer", _is_int)
POSITIVE = Kind("a positive integer", lambda v: _is_int(v) and v > 0)
NUMBER = Kind("a finite number", lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v))
STRING = Kind("a string", lambda v: isinstance(v, str))
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
OBJECT = Kind("a JSON object", lambda v: isinstance(v, dict))


def list_of(kind: Kind, n: int | None = None) -> Kind:
    """A list of values of ``kind`` (of ``n`` of them, when given)."""
    count = f"{n} " if n is not None else ""
    return Kind(
        f"a list of {count}values, each {kind.what}",
        lambda v: isinstance(v, list) and (n is None or len(v) == n) and all(kind.test(x) for x in v),
    )


def either(*kinds: Kind) -> Kind:
    return Kind(" or ".join(k.what for k in kinds), lambda v: any(k.test(v) for k in kinds))


def exactly(*values) -> Kind:
    return Kind(
        " or ".join(json.dumps(v) for v in values), lambda v: any(v == x and type(v) is type(x) for x in values)
    )


class Fields(dict):
    """A JSON object read from ``file`` (at ``at`` inside it), whose fields are checked as they are read."""

    def __init__(self, data: dict, file, tensor: str | None = None, at: str = ""):
        super().__init__(data)
        self.file, self.tensor, self.at = str(file), tensor, at

    @classmethod
    def of(cls, value, file, *, tensor: str | None = None, at: str = "") -> Fields:
        """``value`` as :class:`Fields`, refused unless it is a JSON object."""
        if isinstance(value, Fields) and not at:
            return value
        if not isinstance(value, dict):
            raise _bad(str(file), tensor, at or "the document", f"is {_show(value)}", OBJECT.what)
        return cls(value, file, tensor, at)

    def field(self, name: str, kind: Kind, default=None, *, tensor: str | None = None):
        """Field ``name``, checked to be ``kind``; ``default`` when it is missing or null.

        With ``default=REQUIRED`` a missing or null field is refused too.
        """
        value = self.get(name)
        tensor = tensor or self.tensor
        if value is None:
            if default is REQUIRED:
                why = "is missing" if name not in self else "is null"
                raise _bad(self.file, tensor, self._path(name), why, kind.what)
            return default
        if not kind.test(value):
            raise _bad(self.file, tensor, self._path(name), f"is {_show(value)}", kind.what)
        return value

    def sub(self, name: str, default=None, *, tensor: str | None = None) -> Fields | None:
        """Field ``name``, an object, as :class:`Fields` (``default`` when missing or null)."""
        value = self.field(name, OBJECT, default, tensor=tensor)
        return (
            value if not isinstance(value, dict) else Fields(value, self.file, tensor or self.tensor, self._path(name))
        )

    def _path(self, name: str) -> str:
        return f"{self.at}.{name}" if self.at else name


def _show(value) -> str:
    return f"{type(value).__name__} {json.dumps(value)[:80]}" if not isinstance(value, dict) else "an object"


def _bad(file: str, tensor: str | None, field: str, why: str, expected: str) -> CheckpointFormatError:
    of = f" (read for tensor {tensor})" if tensor else ""
    return CheckpointFormatError(f"{file}{of}: field '{field}' {why}, expected {expected}; the file is damaged")


def parse(text: bytes | str, file, *, tensor: str | None = None, at: str = "") -> Fields:
    """A JSON object from ``text`` (the contents of ``file``, or of its ``tensor``), refused if it is not one."""
    try:
        value = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        of = f", tensor {tensor}," if tensor else ""
        raise CheckpointFormatError(f"{file}{of} is not valid JSON ({e}): the file is damaged or cut short") from None
    return Fields.of(value, file, tensor=tensor, at=at)


def load(path) -> Fields:
    """The JSON object in file ``path`` (``config.json``, an index), refused naming the file if it is not one."""
    path = Path(path)
    return parse(path.read_bytes(), path)
