"""One plain ``dcp.load``'s writes held back until every format record it reads is checked.

A state dict in entry form (``model.state_dict()``, or what
``dq.checkpoint.LoadPlanner`` makes of a tensors-only one) aliases the
model: its dense tensors are the parameters' bytes, and each quantized
weight's entries are its inner tensors. DCP writes every chunk where it
reads it, file by file in the order of its plan, and reads each weight's
``__quant__`` record in the same pass. A record that does not fit the
weight is refused when DCP reads it -- after whatever DCP read before it
was written: a dense embedding ahead of the first quantized weight,
another weight's bytes, a chunk in a file read first.

A :class:`LoadGuard` spans one load of one state dict. While armed, every
tensor of the state dict gives DCP (``__get_tensor_shard__``, DCP's lookup
of the tensor to read into) a scratch copy of its local tensor, made on
the first chunk read into it. When every record the load reads has been
checked, the copies are written into the tensors and the guard disarms;
a record that does not fit drops them, so the model is untouched. The
records the load reads are those of the weights whose entries DCP plans to
read (``__create_chunk_list__``, which DCP asks while planning; a partial
load may skip a weight). A load that reads every record before any tensor
(the records first in each file, the usual order of one file) copies
nothing; the cost otherwise is one copy of what was read before the last
record.

The guard is agnostic of the entries' form: a group is any mapping whose
tensors are entries and whose ``check_record(value)`` raises for a record
that does not fit (``state_dict.Entries``).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor

_HOOKS = ("__get_tensor_shard__", "__create_chunk_list__")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _chunks(t: torch.Tensor) -> list:
    """DCP's own chunk list of ``t`` (a DTensor's method, else the whole tensor), as if no hook were set."""
    method = getattr(type(t), "__create_chunk_list__", None)
    if method is not None:
        return method(t)
    return [ChunkStorageMetadata(offsets=torch.Size([0] * t.dim()), sizes=t.size())]


class LoadGuard:
    """Holds back one load's writes into ``groups`` (record-checked entries) and ``dense`` tensors."""

    def __init__(self, groups, dense):
        self.groups = list(groups)
        self.seen: set[int] = set()  # id() of the groups DCP's planner set up (assigned their record) in this load
        self.planned: set[int] = set()  # id() of the groups whose entries DCP plans to read
        self.checked: set[int] = set()
        self.pending: set[int] | None = None  # planned groups not yet checked; None until the first read
        self.staged: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # id(local): (local, scratch, group)
        self.armed: list[tuple[torch.Tensor, int]] = [(t, 0) for t in dense]
        for group in self.groups:
            group.guard = self
            self.armed += [(e, id(group)) for e in group.values() if isinstance(e, torch.Tensor)]
        for t, owner in self.armed:
            t.__get_tensor_shard__ = functools.partial(self._target, t, owner)
            if owner:
                t.__create_chunk_list__ = functools.partial(self._planned, t, owner)

    def set_up(self, group) -> bool:
        """DCP's planner assigned ``group``'s record (setting up a load): whether this guard is that load's.

        One set-up pass assigns each group's record once, before anything is
        read; a group seen again, or a guard that already read, is a load
        that ended before reading (a failed plan): the caller makes a new one.
        """
        if not self.armed or self.pending is not None or id(group) in self.seen:
            return False
        self.seen.add(id(group))
        return True

    def holds(self, group) -> bool:
        """Whether chunks of ``group`` wait in scratch copies and its own record was never checked."""
        return (
            bool(self.armed)
            and id(group) not in self.checked
            and any(owner == id(group) for _, _, owner in self.staged.values())
        )

    def check(self, group, record) -> None:
        """The load read ``group``'s record: ``group.check_record`` it; all records checked: commit."""
        self._start()
        try:
            group.check_record(record)
        except BaseException:
            self.abort()
            raise
        self.checked.add(id(group))
        self.pending.discard(id(group))
        if not self.pending:
            self.commit()

    def commit(self) -> None:
        staged = list(self.staged.values())
        self.abort()
        for local, scratch, _ in staged:
            local.copy_(scratch)

    def abort(self) -> None:
        """Disarm, dropping what was staged: nothing of this load is written any more."""
        for t, _ in self.armed:
            for hook in _HOOKS:
                fn = t.__dict__.get(hook)  # only this guard's: a later load's guard may have replaced it
                if isinstance(fn, functools.partial) and getattr(fn.func, "__self__", None) is self:
                    del t.__dict__[hook]
        self.armed, self.staged, self.pending = [], {}, set()
        for group in self.groups:
            if getattr(group, "guard", None) is self:
                group.guard = None

    def _planned(self, t: torch.Tensor, owner: int) -> list:
        self.planned.add(owner)
        return _chunks(t)

    def _start(self) -> None:
        if self.pending is None:
            # a group whose record DCP did not set up (dq.checkpoint.load takes each record out, checked before the
            # load) is not waited for
            self.pending = self.planned & self.seen

    def _target(self, t: torch.Tensor, owner: int, index) -> torch.Tensor:
        self._start()
        local = _local(t)
        if not self.pending:  # nothing to wait for (no record in this load)
            self.abort()
            return local
        if id(local) not in self.staged:
            self.staged[id(local)] = (local, local.clone(), owner)  # unread parts keep their bytes when committed
        return self.staged[id(local)][1]
