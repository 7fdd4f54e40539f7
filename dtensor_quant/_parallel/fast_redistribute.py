"""The redistribute shortcuts: opt-in patches of four torch functions, for speed only.

DTensor reaches a quantized local through ``__torch_dispatch__`` for every op
it issues, and that is all correctness needs. Three redistributes issue more
ops than they must for a tensor subclass, each a trip through Python
dispatch: ``Replicate -> Shard`` chunks every rank's piece, a gather along
any dim goes through funcol's wrapping, waiting, splitting and
concatenating (and ``full_tensor`` then views the gathered local through
dispatch once more), and ``Shard(i) -> Shard(j)`` on a CPU mesh gathers then
chunks every piece. The shortcuts (:mod:`.replicate_to_shard`,
:mod:`.gather_dim`, :mod:`.shard_to_shard`) run the same collectives and
give the same bytes in fewer calls; each replacement handles only
quantized locals and calls torch's own function for everything else.

They replace torch objects for the whole process, so they are never
installed by ``import dtensor_quant``: call :func:`enable` (or set
``DTENSOR_QUANT_FAST_REDISTRIBUTE=1``, applied when the first quantized
tensor is made). docs/performance.md measures what they save.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from .._core import config
from .._core.tensor import on_first_quantized_tensor
from .._core.torch_patches import PATCHES, Patch, uninstall
from . import gather_dim, replicate_to_shard, shard_to_shard

_MODULES = (replicate_to_shard, gather_dim, shard_to_shard)
#: The names of the three patches (core.torch_patches.PATCHES keys).
NAMES = ("replicate_to_shard", "gather_dim", "shard_to_shard")


def enable() -> None:
    """Install the three redistribute shortcuts (idempotent). Every process of a job must agree: call it
    on every rank, or on none (the shortcuts send the same bytes as torch's path, in the same order)."""
    for module in _MODULES:
        module.install()


def disable() -> None:
    """Put torch's own functions back."""
    for name in NAMES:
        uninstall(name)


@contextlib.contextmanager
def enabled() -> Iterator[dict[str, Patch]]:
    """The shortcuts installed for the block, by name; those that were not installed before are removed after."""
    before = {name for name in NAMES if name in PATCHES}
    enable()
    try:
        yield {name: PATCHES[name] for name in NAMES if name in PATCHES}
    finally:
        for name in set(NAMES) - before:
            uninstall(name)


def with_shortcuts(fn):
    """``fn`` run with the shortcuts installed (:func:`enabled`): for code that compares them with torch's path."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with enabled():
            return fn(*args, **kwargs)

    return run


def patch(name: str) -> Patch:
    """The installed shortcut ``name`` (one of :data:`NAMES`): its ``removed()`` runs torch's own code."""
    return PATCHES[name]


def _from_env() -> None:
    if config.get("fast_redistribute"):
        enable()


on_first_quantized_tensor(_from_env)
