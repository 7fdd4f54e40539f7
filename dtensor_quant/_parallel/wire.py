"""Record what every collective puts on the wire: op, dtype and bytes per rank.

``with dtensor_quant.wire.record() as log:`` captures every collective this
process issues inside the block -- DTensor's redistributes, FSDP2's
all-gathers and reduce-scatters, DCP's -- with the dtype that travels and the
bytes this rank contributes. Collectives on quantized tensors are recorded as
the stored bytes they actually send, so a test can assert that nothing left
the process in bf16 or fp32::

    with wire.record() as log:
        w.full_tensor()
    assert log.dtypes() == {torch.uint8}

FSDP2's collectives go through the dispatcher as ``c10d::_allgather_base_``
and ``c10d::_reduce_scatter_base_`` on flat buffers and are recorded the same
way; ``log.all_gathers()`` selects the all-gathers of either API.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._core.tensor import QuantizedTensor

_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor")
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_", "check_for_nan"}
# Which argument holds what this rank sends, by schema argument name.
_SENT_ARGS = ("input", "inputs", "input_tensor", "input_tensors", "input_list", "tensors", "tensor")


@dataclass(frozen=True)
class Transfer:
    op: str
    dtype: torch.dtype
    nbytes: int
    quantized: bool = False


@dataclass
class WireLog:
    transfers: list[Transfer] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def dtypes(self) -> set[torch.dtype]:
        return {t.dtype for t in self.transfers}

    def bytes_by_dtype(self) -> dict[torch.dtype, int]:
        out: Counter = Counter()
        for t in self.transfers:
            out[t.dtype] += t.nbytes
        return dict(out)

    def all_gathers(self) -> WireLog:
        """Only the all-gathers (DTensor's ``all_gather_into_tensor``, FSDP2's ``_allgather_base_``, ...)."""
        return WireLog([t for t in self.transfers if "allgather" in t.op or "all_gather" in t.op])

    def __len__(self) -> int:
        return len(self.transfers)


_logs: list[WireLog] = []


def note(op: str, tensors, quantized: bool = True) -> None:
    """Record a collective that dtensor_quant issues on a quantized tensor's bytes."""
    if not _logs:
        return
    for t in _tensors(tensors):
        for log in _logs:
            log.transfers.append(Transfer(op, t.dtype, t.numel() * t.element_size(), quantized))


def note_hidden(op: str, tensors) -> None:
    """Record a dense collective issued inside a custom op, where the recording mode cannot see it.

    A dispatch mode sees a custom op (``dtensor_quant::quantize``) but not the
    collectives its kernel runs, so those report themselves; outside a custom
    op the mode records them and this does nothing.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if not any(isinstance(m, _Recorder) for m in _get_current_dispatch_mode_stack()):
        note(op, tensors, quantized=False)


@contextlib.contextmanager
def record() -> Iterator[WireLog]:
    """Capture every collective issued in this process inside the block."""
    log = WireLog()
    _logs.append(log)
    try:
        with _Recorder():
            yield log
    finally:
        _logs.remove(log)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)


class _Recorder(TorchDispatchMode):
    """Sees plain-tensor collectives; quantized ones report themselves through :func:`note`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, _, name = func._schema.name.partition("::")
        if ns in _NAMESPACES and name not in _NOT_COLLECTIVES:
            flat = list(_tensors(list(args) + list(kwargs.values())))
            if not any(isinstance(t, QuantizedTensor) for t in flat):
                note(func._schema.name, _sent(func, args, kwargs, name), quantized=False)
        return func(*args, **kwargs)


def _sent(func, args, kwargs, name):
    values = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
    if name.startswith("scatter"):
        return values.get("output_tensors", [])
    for key in _SENT_ARGS:
        if key in values:
            return values[key]
    return []
