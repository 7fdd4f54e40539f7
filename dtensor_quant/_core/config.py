"""Every environment variable the library reads, in one table (``dq.config``).

Each setting is declared once here: its variable, its default, what it does
and how its text is read. Modules ask :func:`get` where they use the value,
so a bad value is a :class:`ConfigError` naming the variable and the values
it takes at the point it matters -- never at ``import dtensor_quant``. The
README lists the same table (a test keeps the two equal), and
``python -m dtensor_quant config`` prints the values in force.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass


class ConfigError(ValueError):
    """An environment variable of the library holds a value it does not take."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("1/true/yes/on or 0/false/no/off")


#: The vector levels ``DTENSOR_QUANT_MAX_LEVEL`` takes, and the instructions of each.
LEVELS = {"1": "AVX2", "2": "AVX-512", "3": "AVX-512 BF16", "4": "AMX"}


def _level(text: str) -> int | None:
    value = text.strip()
    if not value:
        return None
    if value not in LEVELS:
        raise ValueError("")  # the setting's doc lists the levels, once
    return int(value)


def _path(text: str) -> str | None:
    return os.path.expanduser(text.strip()) or None


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, its default text, what it does, how its text is read."""

    env: str
    default: str
    doc: str
    parse: Callable[[str], object]


#: The settings by short name. Adding one here is the only way a module reads the environment.
SETTINGS: dict[str, Setting] = {
    s.env.removeprefix("DTENSOR_QUANT_").lower(): s
    for s in (
        Setting(
            "DTENSOR_QUANT_NATIVE",
            "1",
            "0 turns the library's C++ kernels off: every matmul dequantizes and calls torch (the reference path)",
            _flag,
        ),
        Setting(
            "DTENSOR_QUANT_MAX_LEVEL",
            "",
            "caps the kernels' vector path: "
            + ", ".join(f"{k} {n}" for k, n in LEVELS.items())
            + " (empty: what the CPU has)",
            _level,
        ),
        Setting(
            "DTENSOR_QUANT_CACHE",
            "",
            "where built kernels are kept, a folder per torch, Python and vector level "
            "(empty: $XDG_CACHE_HOME/dtensor_quant/kernels, else ~/.cache/dtensor_quant/kernels)",
            _path,
        ),
        Setting(
            "DTENSOR_QUANT_FAST_REDISTRIBUTE",
            "0",
            "1 enables the redistribute shortcuts (dq.enable_fast_redistribute()) when the first quantized "
            "tensor is made",
            _flag,
        ),
        Setting(
            "DTENSOR_QUANT_MEMO",
            "1",
            "0 decides every op's layout afresh instead of looking it up (for debugging the memo)",
            _flag,
        ),
        Setting(
            "DTENSOR_QUANT_AGREE_EVERY_CALL",
            "0",
            "1 checks before every collective, not once per layout, that all ranks hold the same layout",
            _flag,
        ),
        Setting(
            "DTENSOR_QUANT_UNTESTED_TORCH",
            "0",
            "1 applies the library's torch patches on a torch release they were not written for (with a warning)",
            _flag,
        ),
    )
}


def get(name: str):
    """The value of setting ``name`` (a key of :data:`SETTINGS`) from the environment, parsed.

    Read on every call, so a test or a program may set the variable before the
    code that uses it runs. A value the setting does not take raises
    :class:`ConfigError` naming the variable.
    """
    setting = SETTINGS[name]
    text = os.environ.get(setting.env, setting.default)
    key = (name, text)
    if key in _PARSED:  # the kernels ask on every call: the parse of a text seen before, looked up
        return _PARSED[key]
    try:
        value = setting.parse(text)
        if setting.parse in _PURE:
            _PARSED[key] = value
        return value
    except ValueError as e:
        takes = f" ({e})" if str(e) else ""  # the values it takes, where its doc does not list them
        what = f"what it does: {setting.doc}"
        raise ConfigError(f"{setting.env}={text!r} is not a value it takes{takes}; {what}") from None


#: The parsers whose value depends on the text alone (``_path`` also reads $HOME), and their values by
#: ``(setting, text)``.
_PURE = (_flag, _level)
_PARSED: dict[tuple[str, str], object] = {}


def describe() -> list[tuple[str, str, str]]:
    """``(variable, value in force, what it does)`` for every setting, in table order."""
    return [(s.env, os.environ.get(s.env, s.default), s.doc) for s in SETTINGS.values()]
