"""Code a lower layer calls whose implementation lives higher up: declared below, provided from above on import.

A layer never imports the layers above it (``tools/check_imports.py``). Some
code of a low layer still needs an answer only a higher one knows: the
factories of ``_ops`` ask which weights are trainable (the owning module's
state, kept in ``_training``), the in-place initialisation asks how a
local shard is quantized as its weight (its mesh and placements), and the
tensor's own methods (``dequantize``, FSDP2's and DCP's hooks) run code of
``_ops``, ``_fsdp`` and ``_checkpoint``. As in DTensor's ``_ops/``, where a
sharding rule is registered by importing the module that defines it, the
low module declares a :class:`Slot` here by name (:func:`declare`) and
calls it; the module that implements it registers with
``@provides(name)`` at import, which ``import dtensor_quant`` does for every
module. Nothing assigns into another module's globals: what is provided is
listed by :func:`slots`.

This module imports nothing of the package, so every layer can use it.
"""

from __future__ import annotations

from collections.abc import Callable

_SLOTS: dict[str, Slot] = {}


class Slot:
    """A function called here and provided by a module above (see the module docstring).

    Calling a slot that nothing provides returns ``unprovided(*args)`` when
    one was declared (what the answer is without the upper layer, e.g. "no
    weight is trainable"), else raises: the package was imported only in part.
    """

    __slots__ = ("doc", "fn", "name", "unprovided")

    def __init__(self, name: str, doc: str, unprovided: Callable | None):
        self.name, self.doc, self.fn, self.unprovided = name, doc, None, unprovided

    def __call__(self, *args, **kwargs):
        fn = self.fn
        if fn is None:
            if self.unprovided is not None:
                return self.unprovided(*args, **kwargs)
            raise RuntimeError(
                f"dtensor_quant: {self.name} is provided by a module of the package that was not imported: "
                "import dtensor_quant"
            )
        return fn(*args, **kwargs)

    def __repr__(self) -> str:
        by = f"{self.fn.__module__}.{self.fn.__qualname__}" if self.fn is not None else "nothing"
        return f"Slot({self.name!r}, provided by {by})"


def declare(name: str, doc: str, *, unprovided: Callable | None = None) -> Slot:
    """Declare the slot ``name`` (what it computes: ``doc``) and return it, for the declaring module to call."""
    if name in _SLOTS:
        raise RuntimeError(f"dtensor_quant: the slot {name!r} is declared twice")
    slot = _SLOTS[name] = Slot(name, doc, unprovided)
    return slot


def provides(name: str):
    """Register the decorated function as the implementation of the declared slot ``name``."""

    def register(fn):
        slot = _SLOTS.get(name)
        if slot is None:
            raise RuntimeError(f"dtensor_quant: no slot {name!r} is declared; declared: {sorted(_SLOTS)}")
        old = slot.fn
        if old is not None and (old.__module__, old.__qualname__) != (fn.__module__, fn.__qualname__):
            raise RuntimeError(f"dtensor_quant: {slot!r} cannot also be provided by {fn.__module__}.{fn.__qualname__}")
        slot.fn = fn
        return fn

    return register


def slot(name: str) -> Slot:
    """The declared slot ``name``."""
    return _SLOTS[name]


def slots() -> dict[str, Slot]:
    """Every declared slot by name (and, on each, what provides it)."""
    return dict(_SLOTS)
