"""Old import paths of modules that moved into layer folders, kept for the code that imports them today.

``from dtensor_quant.launch import RankPool`` and the like still work, with
a ``DeprecationWarning`` naming the new path. Only paths that the docs and
examples used before the move are kept; the public names (``dq.quantize``,
``dq.hf``, ``dq.fsdp``, ...) never moved and need nothing here.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

PACKAGE = __name__.rpartition(".")[0]

#: old module (under the package) -> where it lives now
MOVED = {
    "bits": "core.bits",
    "blocks": "core.reductions",
    "format": "core.format",
    "format_ids": "core.format_ids",
    "layout": "core.layout",
    "native": "core.native",
    "agree": "dist.agree",
    "matmul": "ops.matmul",
    "gather_quantized": "fsdp.gather_quantized",
    "torch_fixes": "fsdp.reshard_after_forward",
    "format_spec": "model.format_spec",
    "padding": "model.padding",
    "planner": "model.planner",
    "tp_plan": "model.tp_plan",
    "launch": "testing.rank_pool",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{PACKAGE}.{old} moved to {PACKAGE}.{new}; import it from there (the old path will go away)",
        DeprecationWarning,
        stacklevel=4,
    )


class _OldPathLoader(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(f"{PACKAGE}.{self.new}")

    def exec_module(self, module) -> None:
        pass


class _OldPathFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.rpartition(".")
        if prefix != PACKAGE or old not in MOVED:
            return None
        _warn(old, MOVED[old])
        return importlib.util.spec_from_loader(fullname, _OldPathLoader(MOVED[old]))


def install() -> None:
    """Put the finder for the old paths on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(_OldPathFinder())


def old_attribute(name: str):
    """``dtensor_quant.<old module>`` as an attribute (``dq.planner``): the moved module, with a warning."""
    if name not in MOVED:
        raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")
    _warn(name, MOVED[name])
    return importlib.import_module(f"{PACKAGE}.{MOVED[name]}")
