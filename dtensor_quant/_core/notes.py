"""What a QuantizedTensor knows besides its layout: one typed record, and one rule per kind of op.

A quantized tensor is its inner tensors plus relations (what
``__tensor_flatten__`` carries). A few facts about it cannot be read off
those, and later ops need them:

* which **stored bytes** it shares with other tensors (:class:`Bytes`): every
  view of a weight -- an alias, ``.t()``, a slice, an expert of a stack --
  shares one record, which counts the writes made through any of them and
  holds what kernels prepared from those bytes (so a write through ``w[:n]``
  reaches the prepared copy of ``w``);
* which inner tensors a **view shares with elements outside it**
  (``shared_outside``): the row scales of ``w[:, :64]`` also scale columns
  64 and up, so a write there must leave them unchanged;
* whether it is a **leading narrow of a longer buffer** (``narrowed_from``,
  the buffer's rows) or **made by a factory** (``from_factory``): FSDP2 keeps
  an uneven shard as a leading narrow of a zero-padded factory buffer, and
  every rank must send the padded length;
* the **weight a transposed view was made from** (``weight``): ``F.linear``
  makes ``w.t()`` per call, and the kernel reads the weight's own inner tensors;
* **inner tensors not made yet** (``pending``): ``t()`` defers its inner
  transposes to their first read, because the ``mm`` that follows reads the
  weight's.

They live in one field, ``QuantizedTensor.notes``, a frozen :class:`Notes`.
Each op kind has one rule below that gives its result's notes from its
input's (:func:`alias`, :func:`transposed`, :func:`sliced`, :func:`same_bytes`,
:func:`moved`, :func:`new_bytes`, :func:`factory`); nothing else writes them.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .layout import shares_outside


class Bytes:
    """The stored bytes one tensor and all its views share: writes made through them, kernels' prepared copies.

    ``writes`` counts the writes made through this library's ops (``copy_``,
    collectives into a tensor, in-place updates) into any view: inner views
    made inside ``__torch_dispatch__`` have version counters of their own, so
    a version alone does not see a write through another view. ``watched``
    are the inner tensors that code outside the library may write into (the
    first tensor's own, and the ones a state dict hands to a checkpoint
    loader): their versions count as writes too (:meth:`stamp`).
    ``cache_kernels`` is False for bytes their owner frees and refills (FSDP2's
    all-gather buffers). ``prepared`` is the kernels' cache, filled by
    :mod:`dtensor_quant._ops.matmul`.
    """

    __slots__ = ("__weakref__", "cache_kernels", "prepared", "watched", "writes")

    def __init__(self, watched=(), cache_kernels: bool = True):
        self.writes = 0
        # not fake or traced ones, nor inference tensors (they have no version to watch)
        self.watched = [t for t in watched if type(t) is torch.Tensor and not t.is_inference()]
        self.cache_kernels = cache_kernels
        self.prepared: dict = {}

    def stamp(self) -> tuple:
        """Changes whenever these bytes are written, through the library or into a watched tensor."""
        return (self.writes, *[t._version for t in self.watched])  # a list, not a generator: runs per matmul


class Notes(NamedTuple):
    """The record; see the module docstring. Immutable: the rules make new ones.

    A tuple rather than a frozen dataclass: views make one per call, and a
    tuple is built in a fraction of the time. Compare fields, never whole
    records (``weight`` is a tensor).
    """

    bytes: Bytes | None
    shared_outside: tuple[tuple[int, tuple], ...] = ()  # (inner index, (relation, dim, start, stop) of the cut)
    narrowed_from: int = 0  # rows of the buffer this is a leading-rows narrow of (0: none)
    from_factory: bool = False
    weight: Any = None  # the QuantizedTensor a transposed view was made from
    pending: tuple | None = None  # (fill, *args): fill(q, *args) makes the inner tensors


#: ``Notes`` built from a full tuple of its fields in one C call: ``Notes(...)`` runs the generated Python
#: ``__new__`` (a frame of its own), and the rules below run for every view.
_record = tuple.__new__

# Where the compiled kernel op, which sees inner tensors only, finds their Bytes (keyed by the first inner
# tensor of a tensor whose bytes are new; views share their source's record and add nothing). The value is
# a weak reference: the record holds its key (``watched``), and a strong value would keep the key -- the
# tensor's largest inner tensor -- alive for ever (every quantize, clone and gather leaked one before).
_BYTES_OF = WeakIdKeyDictionary()


def bytes_of(first_inner: torch.Tensor) -> Bytes | None:
    """The :class:`Bytes` record of the tensor whose first inner tensor is ``first_inner``, while a tensor
    over those bytes holds it (no tensor left, no prepared kernel inputs to reuse)."""
    ref = _BYTES_OF.get(first_inner)
    return ref() if ref is not None else None


def new_bytes(inner=()) -> Notes:
    """Notes of a tensor over bytes of its own, its inner tensors ``inner`` (a quantize, clone, concatenation,
    gather, device copy): they are watched, and the compiled kernel op finds the record through the first."""
    record = Bytes(inner)
    if record.watched:
        _BYTES_OF[record.watched[0]] = weakref.ref(record)
    return Notes(record)


def watch(notes: Notes, tensors) -> None:
    """Code outside the library may write into ``tensors`` (views of these bytes): count their writes too.

    The state dict hands a quantized weight's inner tensors to a checkpoint
    loader this way; the loader's ``copy_`` bumps only their versions.
    """
    if notes.bytes is None:
        return
    watched = notes.bytes.watched
    for t in tensors:
        t = t if t._base is None else t._base  # a view made here shares its base's version counter
        if type(t) is torch.Tensor and not t.is_inference() and all(t is not w for w in watched):
            watched.append(t)


def refilled() -> Notes:
    """Notes of a tensor over bytes its owner frees and refills in place (FSDP2's all-gather buffers).

    Kernels prepare from them on every call: a cached copy would outlive each
    gather (an extra weight per layer) and miss the refill.
    """
    return Notes(Bytes(cache_kernels=False))


def factory(inner=()) -> Notes:
    """``new_zeros``/``empty_like``: new bytes, and rows past a leading narrow of them are padding."""
    return new_bytes(inner)._replace(from_factory=True)


def alias(src: Notes) -> Notes:
    """``detach``, same-shape ``view``, ``wait_tensor``: the same view of the same bytes (its inner tensors made).

    Not a factory's buffer any more: a narrow of the alias treats every row as an element.
    """
    if src.pending is None and not src.from_factory:
        return src
    return _record(Notes, (src.bytes, src.shared_outside, src.narrowed_from, False, src.weight, None))


def same_bytes(src: Notes, pending: tuple | None = None) -> Notes:
    """A view that is not a slice (``select`` of an expert, ``view(-1)``, a broadcast): it shares the bytes only.

    ``pending`` when its inner tensors are left to their first read (``view(-1)``)."""
    return _record(Notes, (src.bytes, (), 0, False, None, pending))


def transposed(src: Notes, q, pending: tuple | None = None) -> Notes:
    """``q.t()``/``transpose``: the same bytes and shared blocks; the weight it came from is kept for kernels.

    ``pending`` when the inner transposes are left to their first read.
    """
    weight = src.weight
    return _record(Notes, (src.bytes, src.shared_outside, 0, False, q if weight is None else weight, pending))


def broadcast(src: Notes) -> Notes:
    """A weight broadcast over batch dims (or back): kernels still find the weight it came from."""
    return Notes(src.bytes, weight=src.weight)


def moved(src: Notes, inner=()) -> Notes:
    """A device copy or pinned copy: new bytes, and still the same leading narrow of a padded buffer."""
    return new_bytes(inner)._replace(narrowed_from=src.narrowed_from)


def outside_cuts(rels, length: int, dim: int, start: int, stop: int, from_factory: bool) -> tuple:
    """The inner tensors (by index) that ``[start:stop]`` along ``dim`` shares with elements outside it.

    ``rels`` are the input's relation rows and ``length`` its length along
    ``dim``; past the end of a factory's buffer nothing is outside (those
    rows are padding). A pure function of the layout, so slicing memoises it.
    """
    end = stop if (dim == 0 and start == 0 and from_factory) else length
    if start == 0 and stop >= end:
        return ()
    return tuple(
        (i, (row[dim], dim, start, stop)) for i, row in enumerate(rels) if shares_outside(row[dim], start, stop, end)
    )


def sliced(src: Notes, outside: tuple, length: int, dim: int, start: int, stop: int) -> Notes:
    """``q[start:stop]`` along ``dim`` (length ``length``): the same bytes, and what it shares outside itself.

    ``outside`` is :func:`outside_cuts` of the cut (the inner tensors whose
    blocks reach outside the range: checked before any write into the view).
    A leading narrow of dim 0 remembers how many rows it was cut from.
    """
    shared = src.shared_outside
    if outside:
        merged = dict(shared)
        merged.update(outside)
        shared = tuple(sorted(merged.items(), key=lambda kv: kv[0]))
    narrowed = 0
    if dim == 0 and start == 0 and stop < length:
        narrowed = max(length, src.narrowed_from)
    elif (start, stop) == (0, length):
        narrowed = src.narrowed_from
    return _record(Notes, (src.bytes, shared, narrowed, False, None, None))


def stands_for(src: Notes, own: Notes) -> Notes:
    """``own``'s tensor holds ``src``'s rows in another form (a quantized shard of a dense one): same padding."""
    return own if own.narrowed_from == src.narrowed_from else own._replace(narrowed_from=src.narrowed_from)


def padded_rows(t: torch.Tensor) -> int:
    """Rows of the padded buffer that ``t`` (an FSDP2 shard) is a leading narrow of; its own rows if none."""
    return max(t.notes.narrowed_from, t.shape[0])


def wrote(notes: Notes) -> None:
    """A write into the tensor with these notes happened: what was derived from its bytes is stale."""
    if notes.bytes is not None:
        notes.bytes.writes += 1
