"""FSDP2's padded shard rows: the one record of how many rows a short shard was cut from.

FSDP2 keeps an uneven (short) shard as a leading-rows narrow of its
zero-padded shard of ``ceil(rows / world)`` rows, and every rank must send
the same number of bytes, so :mod:`dtensor_quant.fsdp` pads a short shard
back to that many rows before the all-gather. The shard cannot tell the
padded length from its own shape: the narrow records it here (under
:data:`PADDED_ROWS` in the tensor's ``__dict__``), and only aliases and device
copies of the narrow keep it -- a factory or clone of a split piece is not a
narrow of anything. Both local types FSDP2 shards use these rules:
:class:`~dtensor_quant.QuantizedTensor` (through the slice and alias
handlers) and :class:`~dtensor_quant.GatherQuantized` (in its dispatch).
"""

from __future__ import annotations

import torch

PADDED_ROWS = "fsdp_padded_rows"


def padded_rows(t: torch.Tensor) -> int:
    """Rows of FSDP2's padded shard that ``t`` (this rank's shard) is a leading narrow of."""
    return max(t.__dict__.get(PADDED_ROWS, 0), t.shape[0])


def note_narrow(src: torch.Tensor, out: torch.Tensor, dim: int, start: int) -> None:
    """``out`` is ``src`` narrowed along ``dim`` from ``start``: a leading-rows narrow records the padded rows."""
    length = src.shape[0]
    if dim == 0 and start == 0 and out.shape[0] < length:
        out.__dict__[PADDED_ROWS] = max(length, src.__dict__.get(PADDED_ROWS, 0))
    elif dim != 0 or start == 0:
        keep_padded_rows(src, out)


def keep_padded_rows(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` is an alias or device copy of ``src``: it keeps ``src``'s padded rows (same shape only)."""
    if PADDED_ROWS in src.__dict__ and out.shape == src.shape:
        out.__dict__[PADDED_ROWS] = src.__dict__[PADDED_ROWS]
    return out


def copy_padded_rows(src: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` stands for ``src``'s rows in another form (its quantized shard): it keeps the record."""
    if PADDED_ROWS in src.__dict__:
        out.__dict__[PADDED_ROWS] = src.__dict__[PADDED_ROWS]
