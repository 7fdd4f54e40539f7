"""Dense values of a QuantizedTensor: the format's ``unpack`` kernel when it applies, else its math.

``QuantizedTensor.dequantize()``, ``dtensor_quant.dequantize`` (the custom
op) and the matmuls' fallback all end here. Whatever the orientation,
stacking or shard, a format only ever sees its canonical 2-D weight: a stack
of matrices is dequantized one matrix at a time, concatenated pieces with
grids of their own one piece at a time, and a transposed view as its
untransposed weight.
"""

from __future__ import annotations

import torch

from .._core.bits import is_tracing
from .._core.dispatch import UnsupportedOpError, implements_method
from .._core.layout import Stacked
from .._core.tensor import QuantizedTensor
from . import unpack
from .layout_ops import (
    broadcastable_for,
    canonical_dims,
    describe,
    is_transposed,
    map_inner,
    matrix_dims,
    select_dim,
    slice_dim,
)


@implements_method("dequantize")
def dequantize(q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """Dense values of ``q`` in ``dtype``, whatever its orientation or stacking.

    A stack of matrices (experts) dequantizes one matrix at a time with the
    format's 2-D math, so a user format's ``dequantize`` never sees N dims.
    """
    if matrix_dims(q):
        if q.shape[0] == 0:
            return torch.empty(q.shape, dtype=dtype, device=q.device)
        return torch.stack([dequantize(select_dim(q, 0, i), dtype) for i in range(q.shape[0])])
    for rel_row in q.rels:
        for dim, rel in enumerate(rel_row):
            if isinstance(rel, Stacked):  # each run has a grid of its own: one piece at a time
                run = rel.n
                pieces = [slice_dim(q, dim, s, min(s + run, q.shape[dim])) for s in range(0, q.shape[dim], run)]
                return torch.cat([dequantize(p, dtype) for p in pieces], dim)
    if q.dims == canonical_dims(q.ndim):
        fast = None if _traced(q) else unpack.dense(q, dtype)
        return fast if fast is not None else q.fmt.dequantize(broadcastable_for(q.inner, q.rels, q.shape), dtype)
    if is_transposed(q):
        rels = tuple(row[::-1] for row in q.rels)
        if not _traced(q):
            fast = unpack.dense(
                QuantizedTensor(map_inner(q, lambda t: t.t()), q.fmt, rels, canonical_dims(2), q.shape[::-1], q.dtype),
                dtype,
            )
            if fast is not None:
                return fast.t()
        inner = broadcastable_for(map_inner(q, lambda t: t.t()), rels, q.shape[::-1])
        return q.fmt.dequantize(inner, dtype).t()
    raise UnsupportedOpError(f"{describe(q)}: dequantize the tensor before view(-1), not after")


def _traced(q: QuantizedTensor) -> bool:
    return any(is_tracing(t) for t in q.inner.values())
