"""Checkpoints of quantized models: DCP entries, DCP save/load, Hugging Face directories.

``dq.checkpoint.save/load/async_save`` (:mod:`.dcp`) import
torch.distributed.checkpoint, about a second, so they load on first use;
:mod:`.state_dict` (the per-inner-tensor entries) and :mod:`.hf`
(``dq.hf``) load with the package.
"""

from __future__ import annotations

import importlib

# What dq.checkpoint offers from .dcp (and .state_dict), loaded on first access.
_DCP_NAMES = frozenset(
    {
        "AtomicFileSystemWriter",
        "CHECKSUM_SUFFIX",
        "CheckpointCorruptError",
        "CheckpointLoadError",
        "CheckpointSaveError",
        "VerifyingFileSystemReader",
        "WeightsOnlyLoadPlanner",
        "async_save",
        "load",
        "save",
        "staging_path",
    }
)


def __getattr__(name: str):
    if name in _DCP_NAMES:
        return getattr(importlib.import_module(".dcp", __name__), name)
    if name == "CheckpointFormatError":
        return importlib.import_module(".state_dict", __name__).CheckpointFormatError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
