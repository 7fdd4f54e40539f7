"""In-place initialisation of quantized tensors: ``nn.init`` on a quantized weight is the dense init, quantized.

Trainers build a model on ``meta``, convert it, parallelize it, ``to_empty``
it and only then initialise the weights in place (torchtitan's order), so a
quantized weight must accept what ``nn.init`` issues: ``normal_``,
``uniform_``, ``fill_``, ``zero_`` and ``copy_`` from a dense tensor. Each is
derived from the layout the same way:

* the op runs on a dense tensor of the weight's (local) shape and logical
  dtype -- so it draws from the generator exactly what the op on a dense
  weight of that shape would draw -- and the result is quantized into the
  weight's own inner tensors with the format's statistics (round to nearest),
  reduced over the mesh dims whose shards share them, as
  ``dtensor_quant.quantize`` of a DTensor does. The bytes equal quantizing
  the same dense init. A trainable weight's requantization count is not
  advanced: initialising is not an update.
* the dense values stay **open** while the initialisation goes on: pointwise
  ops that read the weight (``w < lo`` in ``trunc_normal_``'s rejection
  loop, ``torch.where``) read them, and pointwise in-place ops on it apply to
  them and quantize again (``trunc_normal_``'s narrow branch runs ``sub_``,
  ``div_``, ``pow_``, ``log_`` on scratch tensors made with ``empty_like``).
  So any ``nn.init`` function -- whatever pointwise sequence it runs --
  equals the dense init quantized (the pointwise ops reach :func:`continue_open`
  and :func:`initial_values` through the one pointwise handler,
  :mod:`dtensor_quant._training.pointwise`). Any other op on a quantized tensor (a
  matmul, a view, a collective: :data:`dtensor_quant._core.dispatch.EPOCH`)
  closes every open initialisation, and at most :data:`OPEN_LIMIT` stay open
  (the memory of a few dense weights, never of the model).

Where a local tensor sits in its weight (the global shape and the mesh
reducer) is known above this layer: the slot ``"quantize_like"``
(:mod:`dtensor_quant._core.registry`) is provided by
:mod:`dtensor_quant._model.placed` on import, as ``"trainable"``
(``_ops/factories.py``) is by :mod:`dtensor_quant._training.trainable`.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from .._core.dispatch import EPOCH, KEEPS_INITIAL, implements
from .._core.layout import LayoutError
from .._core.registry import declare
from .._core.tensor import QuantizedTensor
from . import writes
from .layout_ops import canonical_dims, describe

_QUANTIZE_LIKE = declare(
    "quantize_like",
    "(q, dense) -> dense (q's local shape and logical dtype) quantized as q's weight would be: its format, "
    "its global shape, the statistics reduced over the shards that share them",
)

OPEN_LIMIT = 4  # initialisations whose dense values stay open at once
_OPEN: OrderedDict = OrderedDict()  # key(q) -> (weakref to its bytes record, stamp, epoch, dense values)


def _key(q: QuantizedTensor):
    first = next(iter(q.inner.values()))
    return (id(q.notes.bytes), first.data_ptr(), first.storage_offset(), tuple(q.shape), tuple(q.stride()))


def initial_values(q: QuantizedTensor) -> torch.Tensor | None:
    """The dense values of ``q``'s open initialisation (see the module docstring), or None."""
    if not _OPEN or q.notes.bytes is None:
        return None
    entry = _OPEN.get(_key(q))
    if entry is None:
        return None
    ref, stamp, epoch, dense = entry
    record = ref()
    if record is None or epoch != EPOCH[0] or record.stamp() != stamp:
        del _OPEN[_key(q)]
        return None
    return dense


def keep_open(q: QuantizedTensor, dense: torch.Tensor) -> None:
    """Keep ``dense`` as the values of ``q``'s open initialisation (``q``'s bytes are its quantization)."""
    if q.notes.bytes is None or q.is_meta:
        return
    for key in [k for k, (_, _, epoch, _) in _OPEN.items() if epoch != EPOCH[0]]:
        del _OPEN[key]
    key = _key(q)
    _OPEN.pop(key, None)
    _OPEN[key] = (weakref.ref(q.notes.bytes), q.notes.bytes.stamp(), EPOCH[0], dense)
    while len(_OPEN) > OPEN_LIMIT:
        _OPEN.popitem(last=False)


def write_dense(q: QuantizedTensor, dense: torch.Tensor) -> QuantizedTensor:
    """Quantize ``dense`` (``q``'s shape) into ``q``'s own bytes, as its weight would be; keep it open."""
    if tuple(dense.shape) != tuple(q.shape):
        raise LayoutError(f"{describe(q)}: cannot initialise it from a {tuple(dense.shape)} tensor")
    if q.is_meta:
        return q  # no data (a model built on "meta"): nothing to draw or write
    if q.dims != canonical_dims(q.ndim):
        raise LayoutError(
            f"{describe(q)}: a transposed view is not initialised in place; initialise the dense [out, in] "
            "weight and quantize it (dtensor_quant.quantize)."
        )
    if _QUANTIZE_LIKE.fn is None:
        raise LayoutError(f"{describe(q)}: in-place initialisation needs dtensor_quant._model (import dtensor_quant)")
    with torch.no_grad():
        fresh = _QUANTIZE_LIKE(q, dense)
        keep = writes.check_copy(q, fresh, describe)
        pairs = [(getattr(q, n), getattr(fresh, n)) for n in q.fmt.inner_names if n not in keep]
        for dst, src in pairs:
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise LayoutError(
                    f"{describe(q)}: quantizing its init gave inner {tuple(src.shape)}:{src.dtype}, "
                    f"it holds {tuple(dst.shape)}:{dst.dtype}"
                )
        writes.write_inner(q, pairs)
    keep_open(q, dense)
    return q


def fresh_dense(q: QuantizedTensor) -> torch.Tensor:
    """An empty dense tensor of ``q``'s shape, logical dtype and device: what an init op runs on."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@implements("aten::normal_", "aten::uniform_", "aten::fill_", "aten::zero_")
def _init(func, q, *args, **kwargs):
    """The op on a dense tensor of ``q``'s shape and dtype (the same draws from the generator), quantized in."""
    if not isinstance(q, QuantizedTensor):  # fill_(dense, quantized 0-d value): never a weight's init
        raise LayoutError(f"{func}: a quantized fill value has no meaning; pass a number")
    if q.is_meta:
        return q
    dense = fresh_dense(q)
    func(dense, *args, **kwargs)
    return write_dense(q, dense)


def continue_open(func, q: QuantizedTensor, dense: torch.Tensor, args, kwargs, read) -> QuantizedTensor:
    """A pointwise in-place op on ``q`` while its initialisation is open: on the dense values, quantized again."""
    func(dense, *read(args), **read(kwargs))
    return write_dense(q, dense)


KEEPS_INITIAL.add(_init)
