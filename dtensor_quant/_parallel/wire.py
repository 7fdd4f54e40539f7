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

Each transfer names the group it went over: ``group`` (the process group's
name), ``ranks`` (its global ranks, in group order) and ``mesh_dim`` (the
device-mesh dim's name, where known: the library's own collectives say it, and
torch's DeviceMesh describes every group it makes for a dim as ``mesh_<name>``;
a 1-D mesh over the whole world reuses the default group, which names no dim,
so there only ``ranks`` tell). ``log.over("tp")`` keeps what went over one dim::

    with wire.record() as log:
        out = model(x)
    assert {t.mesh_dim for t in log.transfers if "all_reduce" in t.op} == {"tp"}
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from .._core.tensor import QuantizedTensor

_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor")
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_", "check_for_nan"}
# Which argument holds what this rank sends, by schema argument name.
_SENT_ARGS = ("input", "inputs", "input_tensor", "input_tensors", "input_list", "tensors", "tensor")
# Which argument names the group: functional collectives take its name, c10d's the ProcessGroup.
_GROUP_ARGS = ("group_name", "process_group", "group")


@dataclass(frozen=True)
class Transfer:
    """One collective's contribution from this rank, and the group it went over (None where unknown)."""

    op: str
    dtype: torch.dtype
    nbytes: int
    quantized: bool = False
    group: str | None = None  # the process group's name (c10d's ``group_name``)
    ranks: tuple[int, ...] | None = None  # the group's global ranks
    mesh_dim: str | None = None  # the mesh dim the group belongs to, where known


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

    def over(self, mesh_dim: str | None = None, ranks=None) -> WireLog:
        """Only what went over the mesh dim named ``mesh_dim`` and/or the group of exactly ``ranks``."""
        if mesh_dim is None and ranks is None:
            raise ValueError("WireLog.over needs a mesh_dim name, ranks, or both")
        want = None if ranks is None else tuple(ranks)
        return WireLog(
            [
                t
                for t in self.transfers
                if (mesh_dim is None or t.mesh_dim == mesh_dim) and (want is None or t.ranks == want)
            ]
        )

    def groups(self) -> set[tuple[str | None, tuple[int, ...] | None]]:
        """The (mesh dim, ranks) pairs that the recorded collectives went over."""
        return {(t.mesh_dim, t.ranks) for t in self.transfers}

    def __len__(self) -> int:
        return len(self.transfers)


_logs: list[WireLog] = []
_dims = threading.local()  # .stack: the mesh dims named by ``on_mesh_dim`` blocks, innermost last


@contextlib.contextmanager
def on_mesh_dim(mesh_dim: str | None) -> Iterator[None]:
    """The collectives issued in the block go over the mesh dim ``mesh_dim``: a caller that knows the mesh says
    so, where the group cannot (a 1-D mesh over the whole world uses the default group, which names no dim)."""
    stack = _dims.__dict__.setdefault("stack", [])
    stack.append(mesh_dim)
    try:
        yield
    finally:
        stack.pop()


def note(op: str, tensors, quantized: bool = True, group=None, mesh_dim: str | None = None) -> None:
    """Record a collective that dtensor_quant issues on a quantized tensor's bytes.

    ``group``: the process group it goes over (a ``ProcessGroup`` or its name); ``mesh_dim``: the name of
    the mesh dim it belongs to, where the caller knows it (else read from the group's description).
    """
    if not _logs:
        return
    name, ranks, described = group_of(group)
    named = getattr(_dims, "stack", None)
    mesh_dim = mesh_dim or (named[-1] if named else None) or described
    for t in _tensors(tensors):
        for log in _logs:
            log.transfers.append(Transfer(op, t.dtype, t.numel() * t.element_size(), quantized, name, ranks, mesh_dim))


def group_of(group) -> tuple[str | None, tuple[int, ...] | None, str | None]:
    """(name, global ranks, mesh dim name) of a ``ProcessGroup`` or group name; Nones where not known.

    Only called while recording: resolving a name costs a lookup. DeviceMesh names the groups it makes for a
    dim ``mesh_<dim name>`` (``group_desc``); the default group (``default_pg``) names no dim.
    """
    if group is None:
        return None, None, None
    if isinstance(group, str):
        name = group
        try:
            group = _resolve_process_group(name)
        except (RuntimeError, ValueError, KeyError):  # a name this process does not know: keep the name
            return name, None, None
    else:
        if isinstance(group, torch.ScriptObject):  # c10d's ops take the group boxed
            group = dist.ProcessGroup.unbox(group)
        name = getattr(group, "group_name", None)
    try:
        ranks = tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, KeyError):
        ranks = None
    desc = getattr(group, "group_desc", "") or ""
    dim = desc[len("mesh_") :] if desc.startswith("mesh_") and desc != "mesh_default" else None
    return name, ranks, dim


def note_hidden(op: str, tensors, group=None, mesh_dim: str | None = None) -> None:
    """Record a dense collective issued inside a custom op, where the recording mode cannot see it.

    A dispatch mode sees a custom op (``dtensor_quant::quantize``) but not the
    collectives its kernel runs, so those report themselves; outside a custom
    op the mode records them and this does nothing.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if not any(isinstance(m, _Recorder) for m in _get_current_dispatch_mode_stack()):
        note(op, tensors, quantized=False, group=group, mesh_dim=mesh_dim)


def recording() -> bool:
    """Whether a :func:`record` block is open in this process: a collective that takes a faster path the
    recording mode cannot see (:mod:`dtensor_quant._parallel.activation_stats`) takes the seen one then."""
    return bool(_logs)


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
                values = _values(func, args, kwargs)
                group = next((values[k] for k in _GROUP_ARGS if values.get(k) is not None), None)
                note(func._schema.name, _sent(values, name), quantized=False, group=group)
        return func(*args, **kwargs)


def _values(func, args, kwargs) -> dict:
    return {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs


def _sent(values, name):
    if name.startswith("scatter"):
        return values.get("output_tensors", [])
    for key in _SENT_ARGS:
        if key in values:
            return values[key]
    return []
