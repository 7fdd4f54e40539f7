"""Where a local quantized tensor sits in its weight, for the in-place initialisation of :mod:`dtensor_quant._ops.init`.

An init op (``normal_``, ``copy_`` from dense...) reaches the quantized
tensor as DTensor's *local* tensor: a shard, which does not know its mesh,
its placements or the global shape, all of which quantizing it needs (a row
scale under a column shard is reduced over the mesh). The parameter knows,
and the module that owns the parameter survives ``parallelize_module``,
``fully_shard`` and ``to_empty``: :func:`dtensor_quant.quantize_` records
every module it gives a quantized parameter (:func:`own`), and
:func:`quantize_like` finds the parameter whose local tensor is ``q`` (or
an alias of it) there. A trainable weight's link already holds the same.

A quantized tensor no recorded module owns (one made with
``dtensor_quant.quantize`` and kept as a plain tensor, or a scratch tensor
made with ``empty_like``) is initialised as a whole weight of its own shape.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._core.format import Reducer
from .._core.registry import provides
from .._core.tensor import QuantizedTensor
from .._parallel.shard_quant import MeshReducer, quantize_local
from .._training.trainable import resolve

_OWNERS: weakref.WeakSet = weakref.WeakSet()


def own(module: nn.Module) -> None:
    """Record ``module`` as the owner of quantized parameters (``quantize_`` calls it)."""
    _OWNERS.add(module)


def _same_bytes(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    if a.fmt != b.fmt or a.shape != b.shape or a.dims != b.dims:
        return False
    return all(
        x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
        for x, y in zip(a.inner.values(), b.inner.values())
    )


def owner(q: QuantizedTensor) -> torch.Tensor | None:
    """The parameter (a QuantizedTensor or a DTensor of one) whose local tensor is ``q`` or an alias of it."""
    found = None
    for module in list(_OWNERS):
        for p in module._parameters.values():
            local = p._local_tensor if isinstance(p, DTensor) else p
            if local is q:
                return p
            if found is None and isinstance(local, QuantizedTensor) and q.numel() and _same_bytes(local, q):
                found = p
    return found


@provides("quantize_like")  # asked by _ops/init.py
def quantize_like(q: QuantizedTensor, dense: torch.Tensor) -> QuantizedTensor:
    """``dense`` (``q``'s local shape) quantized as ``q``'s weight is: global shape, mesh statistics."""
    link = resolve(q)
    if link is not None:
        return quantize_local(q.fmt, dense, link.reducer, link.global_shape)
    p = owner(q)
    if isinstance(p, DTensor):
        reducer = MeshReducer.for_mesh(q.fmt, tuple(p.shape), p.device_mesh, tuple(p.placements))
        return quantize_local(q.fmt, dense, reducer, tuple(p.shape))
    return quantize_local(q.fmt, dense, Reducer(tuple(q.shape)), tuple(q.shape))
