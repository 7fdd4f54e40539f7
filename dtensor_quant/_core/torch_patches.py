"""The library's patches of torch internals: named, fingerprinted, scoped, and undoable.

Two torch behaviours give quantized tensors wrong results or refuse them and
offer no public hook to change them (:mod:`dtensor_quant._parallel.compile_key`,
:mod:`dtensor_quant._fsdp.reshard_after_forward`). Each is patched through
:func:`replace`, which

* checks that every private member it replaces still exists, and that its
  source is the one the patch was written against (a fingerprint of the
  source text, per torch release): a torch that renamed or rewrote it raises
  :class:`TorchPatchError` naming the member, instead of the patch silently
  not applying or applying to code it was not written for.
  ``DTENSOR_QUANT_UNTESTED_TORCH=1`` installs it anyway, with a warning;
* keeps torch's original, so the patch can be undone (:meth:`Patch.removed`)
  and a test can check that torch still needs it (each patch has one: it
  fails the day torch's own behaviour changes under it).

Scoping is the patch's own job: each replacement handles only this library's
tensors and calls torch's original for everything else.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from . import config


class TorchPatchError(RuntimeError):
    """A torch internal that a patch replaces is missing or not the code the patch was written for."""


#: The torch releases each patch was written and tested against.
TESTED_TORCH = ("2.13",)


def fingerprint(fn: Callable) -> str:
    """A short hash of ``fn``'s source text (what a patch checks before replacing it)."""
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


@dataclass
class Patch:
    """One installed patch: where it replaced what, and torch's originals."""

    name: str
    why: str
    originals: dict[tuple[type, str], object] = field(default_factory=dict)

    def original(self, owner: type, member: str):
        """torch's own ``owner.member`` (a function, or a property's getter), as it was before the patch."""
        value = self.originals[(owner, member)]
        return value.fget if isinstance(value, property) else value

    @contextlib.contextmanager
    def removed(self) -> Iterator[None]:
        """torch's own code in place of the patch for the block (the tests that torch still needs it)."""
        patched = {key: key[0].__dict__[key[1]] for key in self.originals}
        for (owner, member), value in self.originals.items():
            setattr(owner, member, value)
        try:
            yield
        finally:
            for (owner, member), value in patched.items():
                setattr(owner, member, value)


#: Installed patches by name.
PATCHES: dict[str, Patch] = {}


def _untested_allowed() -> bool:
    return config.get("untested_torch")


def _name(owner) -> str:
    """``torch.x.Class`` for a class, ``torch.x`` for a module (a patched module-level function)."""
    return owner.__name__ if isinstance(owner, types.ModuleType) else f"{owner.__module__}.{owner.__qualname__}"


def replace(
    name: str,
    why: str,
    replacements: dict[tuple[type | types.ModuleType, str], tuple[str, Callable]],
    *,
    strict: bool = True,
) -> Patch | None:
    """Install patch ``name``: ``replacements[(owner, member)] = (fingerprint of torch's member, make)``.

    ``make`` is called with torch's original (the function, or a property's
    getter) and returns the replacement (made a property where torch's
    member is one). Checks every member before replacing any; a second call
    returns the installed patch. ``strict=False`` is for a patch whose
    replacement only wraps torch's code (it works whatever that code is):
    a changed fingerprint then installs it with a warning, and a missing
    member warns that the patch is not installed and returns None.
    """
    if name in PATCHES:
        return PATCHES[name]
    problems = []
    for (owner, member), (expected, _) in replacements.items():
        where = f"{_name(owner)}.{member}"
        value = owner.__dict__.get(member)
        fn = value.fget if isinstance(value, property) else value
        if fn is None or not callable(fn):
            problems.append(f"{where} does not exist")
        elif fingerprint(fn) != expected:
            problems.append(
                f"{where} is not the code the patch was written for (source {fingerprint(fn)}, not {expected})"
            )
    if problems:
        message = (
            f"dtensor_quant's patch '{name}' ({why}) was written against torch {', '.join(TESTED_TORCH)}; on torch "
            f"{torch.__version__}: {'; '.join(problems)}. Use a tested torch (pip install torch==2.13.0), or set "
            "DTENSOR_QUANT_UNTESTED_TORCH=1 to install it anyway at your own risk."
        )
        missing = any("does not exist" in p for p in problems)
        if not strict and missing:
            warnings.warn(f"{message} The patch is NOT installed.", RuntimeWarning, stacklevel=3)
            return None
        if missing or (strict and not _untested_allowed()):
            raise TorchPatchError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    patch = Patch(name, why)
    for (owner, member), (_, make) in replacements.items():
        value = owner.__dict__[member]
        patch.originals[(owner, member)] = value
        original = value.fget if isinstance(value, property) else value
        new = make(original)
        if isinstance(value, property) and not isinstance(new, property):
            new = property(new, doc=value.__doc__)
        setattr(owner, member, new)
    PATCHES[name] = patch
    return patch


def uninstall(name: str) -> bool:
    """Put torch's own members back in place of patch ``name``; False if it was not installed."""
    patch = PATCHES.pop(name, None)
    if patch is None:
        return False
    for (owner, member), value in patch.originals.items():
        setattr(owner, member, value)
    return True
