"""The errors of a DCP save or load that did not complete (``dq.checkpoint``'s own; a format mismatch is
:class:`~dtensor_quant.checkpoint.CheckpointFormatError`)."""

from __future__ import annotations


class CheckpointSaveError(RuntimeError):
    """A save that did not complete; the previous checkpoint at the target path is untouched."""


class CheckpointLoadError(RuntimeError):
    """A load that did not complete; raised on every rank (DCP's own failure is a BaseException)."""


class CheckpointCorruptError(CheckpointLoadError):
    """A stored chunk whose bytes fail their checksum (damaged or truncated file); nothing was loaded."""
