"""The errors of a DCP save or load that did not complete (``dq.checkpoint``'s own; a format mismatch is
:class:`~dtensor_quant.checkpoint.CheckpointFormatError`)."""

from __future__ import annotations


class CheckpointSaveError(RuntimeError):
    """A save that did not complete; the previous checkpoint at the target path is untouched.

    ``lost_ranks``: the global ranks that stopped answering during the save (killed, crashed or stuck), found by
    a roll call once a collective failed (``_parallel/liveness.py``); empty when every rank answered.
    """

    def __init__(self, message: str, lost_ranks: list[int] | tuple = ()):
        super().__init__(message)
        self.lost_ranks = list(lost_ranks)

    def __reduce__(self):  # picklable with its ranks (a rank pool sends it to the test process)
        return type(self), (str(self), self.lost_ranks)


class CheckpointLoadError(RuntimeError):
    """A load that did not complete; raised on every rank (DCP's own failure is a BaseException)."""


class CheckpointCorruptError(CheckpointLoadError):
    """A stored chunk whose bytes fail their checksum (damaged or truncated file); nothing was loaded."""
