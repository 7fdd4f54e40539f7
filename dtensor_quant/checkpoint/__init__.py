"""Checkpoints of quantized models (``dq.checkpoint``): DCP save/load in any layout, the state-dict entries.

``save``/``load``/``async_save`` write and read torch.distributed.checkpoint
directories atomically, checked, in any sharding. A quantized model's
``state_dict()`` holds tensors (torch's contract); on disk each quantized
weight is its entries, one key per inner tensor plus a format record (the
stored bytes, readable without this library), made by ``save`` and by the
DCP planners ``SavePlanner``/``LoadPlanner``. ``entries_from_state`` and
``tensor_state_dicts(model, enabled=False)`` give the entry form for plain
DCP with its default planners; ``register`` installs the state-dict hooks
(``quantize_`` does). The save/load
half imports torch.distributed.checkpoint (about a second), so it loads on
first use. Hugging Face directories are :mod:`dtensor_quant.hf`.
"""

from __future__ import annotations

import importlib

from .._checkpoint.state_dict import (
    CheckpointFormatError,
    check_entry_chunks,
    entries_from_state,
    quant_record,
    quantize_like,
    register,
    tensor_state_dicts,
)

#: What dq.checkpoint offers from the private save/load module, loaded on first access.
_DCP_NAMES = frozenset(
    {
        "AtomicFileSystemWriter",
        "CHECKSUM_SUFFIX",
        "CheckpointCorruptError",
        "CheckpointLoadError",
        "CheckpointSaveError",
        "LoadPlanner",
        "SavePlanner",
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
        return getattr(importlib.import_module("dtensor_quant._checkpoint.dcp"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _DCP_NAMES)


__all__ = [
    "CHECKSUM_SUFFIX",
    "AtomicFileSystemWriter",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "LoadPlanner",
    "SavePlanner",
    "VerifyingFileSystemReader",
    "WeightsOnlyLoadPlanner",
    "async_save",
    "check_entry_chunks",
    "entries_from_state",
    "load",
    "quant_record",
    "quantize_like",
    "register",
    "save",
    "staging_path",
    "tensor_state_dicts",
]
