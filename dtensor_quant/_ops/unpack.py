"""Dense values of a whole weight at memory speed: the formats' ``unpack`` kernels, in row chunks.

A format's ``dequantize`` is elementwise math on inner tensors repeated to one
value per element (:func:`dtensor_quant._ops.layout_ops.broadcastable`), which works for
any shard, partial block or orientation, but makes a full-size copy of every
blocked tensor and several passes over the weight. When a weight is in its
canonical ``[out, in]`` orientation and its packs and column blocks are whole -- a
quantized weight as built, and FSDP2's gathered weight -- a format may instead
write its values straight into a preallocated tensor from the stored inner
tensors (:meth:`~dtensor_quant.QuantFormat.unpack`: a table lookup per byte,
one broadcast multiply per block). The library hands it the weight in row
chunks of about :data:`CHUNK_ELEMENTS` elements (cut on the layout's row
blocks), so the kernel's temporaries stay a fraction of the result. The
values are the same bits ``dequantize`` gives: the tests compare them.
"""

from __future__ import annotations

import functools

import torch

from .._core.format import weight_layout
from .._core.layout import Blocked, Constant, FlatBlocked, InFlat, OneToOne, Packed, dim_factor
from .._core.tensor import QuantizedTensor
from .layout_ops import block_sizes, slice_dim

CHUNK_ELEMENTS = 1 << 20


def whole_blocks(q: QuantizedTensor) -> bool:
    """Whether ``q`` is laid out as a fresh canonical 2-D weight of its shape, packs and column blocks whole.

    The relations must be the ones the format gives a weight of ``q``'s shape
    (a slice through a block, or a gather whose blocks do not continue, has
    others): then every inner tensor holds its blocks in the order quantizing
    would, which is what a format's ``unpack`` assumes. A last row block may
    be partial.
    """
    if q.ndim != 2 or q.dims != ((0,), (1,)):
        return False
    try:
        fresh = weight_layout(q.fmt, q.shape)
    except ValueError:
        return False
    if q.rels != tuple(fresh[name] for name in q.fmt.inner_names):
        return False
    for rels in q.rels:
        for dim, (rel, n) in enumerate(zip(rels, q.shape)):
            if isinstance(rel, (Blocked, Packed)):
                if n % rel.factor and (dim == 1 or isinstance(rel, Packed)):
                    return False
            elif not isinstance(rel, (OneToOne, Constant, FlatBlocked, InFlat)):
                return False  # blocks over the flat index: the format checks its inner sizes
    return True


def unpack_into(q: QuantizedTensor, out: torch.Tensor) -> bool:
    """Write ``q``'s dense values into ``out`` (same shape; its dtype is the result's) if the format can.

    Returns False, having written nothing, when ``q`` is not whole-blocked or
    its format has no ``unpack`` kernel for this case; the caller then
    dequantizes.
    """
    if out.shape != q.shape or not whole_blocks(q) or any(t.device != out.device for t in q.inner.values()):
        return False
    rows, cols = q.shape
    if rows * cols == 0:
        return True  # nothing to write
    factor = dim_factor([rels[0] for rels in q.rels])
    step = max(factor, (CHUNK_ELEMENTS // max(cols, 1)) // factor * factor)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        piece = q if (start, stop) == (0, rows) else slice_dim(q, 0, start, stop)
        if not q.fmt.unpack(piece.inner, out[start:stop]):
            assert start == 0, "a format's unpack accepted one chunk and refused the next"
            return False
    return True


def dense(q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``q``'s dense values as a new tensor through the format's ``unpack``, or None if it cannot."""
    if not whole_blocks(q):
        return None
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    return out if unpack_into(q, out) else None


def dense_inner(fmt, inner: dict[str, torch.Tensor], blocks, shape, dtype: torch.dtype) -> torch.Tensor | None:
    """:func:`dense` for canonical inner tensors and their block sizes (the matmul kernels' view), or None.

    The same precondition as :func:`whole_blocks`, from what the kernel op
    carries: the block sizes and inner shapes of a fresh weight of ``shape``
    (slices start on block boundaries, so equal blocks and lengths mean the
    same blocks in the same order), and whole column blocks.
    """
    if not fresh_inner(fmt, tuple(blocks), tuple(shape), tuple(tuple(t.shape) for t in inner.values())):
        return None
    out = torch.empty(tuple(shape), dtype=dtype, device=next(iter(inner.values())).device)
    return out if out.numel() == 0 or fmt.unpack(inner, out) else None


@functools.lru_cache(maxsize=4096)
def fresh_inner(fmt, blocks: tuple[int, ...], shape: tuple[int, ...], inner_shapes: tuple[tuple[int, ...], ...]):
    """:func:`dense_inner`'s precondition, from hashable facts (cached: the matmul kernels ask it per call)."""
    try:
        fresh = weight_layout(fmt, shape)
    except ValueError:
        return False
    rels = [fresh[name] for name in fmt.inner_names]
    if block_sizes(rels) != list(blocks) or any(b > 0 and shape[1] % b for b in blocks[1::2]):
        return False
    return all(t == tuple(rel.inner_len(n) for rel, n in zip(row, shape)) for t, row in zip(inner_shapes, rels))
