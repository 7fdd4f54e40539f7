"""Slicing, splitting, concatenation, padding and indexing: what sharding and gathering issue.

``distribute_tensor`` and ``Replicate -> Shard`` split; gathers concatenate;
uneven shards pad and narrow; ``_StridedShard`` reorders with
``index_select``; a fused expert stack is indexed with ``select``/``index``.
"""

from __future__ import annotations

import torch

from .._core import notes as rules
from .._core.bits import is_tracing
from .._core.dispatch import UnsupportedOpError, implements
from .._core.layout import LayoutError
from .._core.memo import layout_key, memo
from .._core.tensor import QuantizedTensor, contiguous_strides
from .layout_ops import (
    canonical_dims,
    cat_dim,
    check_cuts,
    describe,
    matrix_dims,
    pad_end,
    rebuild,
    select_dim,
    slice_dim,
    sliced_layout,
    split_dim,
    transposed_dims,
)


def _resolve_slice(length: int, start, end) -> tuple[int, int]:
    start = 0 if start is None else start
    end = length if end is None else end
    start = start + length if start < 0 else start
    end = end + length if end < 0 else end
    start = min(max(start, 0), length)
    return start, min(max(end, start), length)


@implements("aten::slice")
def _slice(func, q, dim=0, start=None, end=None, step=1):
    if step != 1:
        raise LayoutError(f"{describe(q)}: strided slices (step={step}) cut packed elements and blocks")
    dim %= q.ndim
    return slice_dim(q, dim, *_resolve_slice(q.shape[dim], start, end))


@implements("aten::split")
def _split(func, q, split_size, dim=0):
    dim %= q.ndim
    return _split_sizes(func, q, split_lengths(q.shape[dim], split_size), dim)


@implements("aten::split_with_sizes")
def _split_sizes(func, q, split_sizes, dim=0):
    return split_dim(q, dim % q.ndim, split_sizes)


def split_lengths(length: int, size: int) -> list[int]:
    """The piece lengths of ``torch.split(t, size)`` along a dim of ``length`` (``[0]`` for an empty dim)."""
    return [min(size, length - s) for s in range(0, length, size)] or [0]


def chunk_sizes(length: int, chunks: int) -> list[int]:
    """The piece lengths of ``torch.chunk``: a split into ``ceil(length / chunks)`` (fewer pieces if short)."""
    return split_lengths(length, max(-(-length // chunks), 1))


def chunk_view(q: QuantizedTensor, dim: int, chunks: int, index: int) -> QuantizedTensor | None:
    """``torch.chunk(q, chunks, dim)[index]``, without building the other pieces.

    What the gloo fallback of ``Shard(i) -> Shard(j)`` keeps of the gathered
    tensor on every rank: the same checks first (a cut through a pack or
    block raises on every rank, whichever piece it keeps), then one slice.
    None where the piece is past the last one.
    """
    dim %= len(q.props[0])
    sizes = memo(
        ("chunk_view", *layout_key(q), dim, chunks),
        lambda: _checked_chunk_sizes(q, dim, chunks),
        q.rels,
        q.dims,
        q.fmt,
    )
    if index >= len(sizes):
        return None
    start = sum(sizes[:index])
    return slice_dim(q, dim, start, start + sizes[index])


def _checked_chunk_sizes(q: QuantizedTensor, dim: int, chunks: int) -> tuple[int, ...]:
    sizes = chunk_sizes(q.shape[dim], chunks)
    check_cuts(q, dim, sizes)
    return tuple(sizes)


def chunk_copy(q: QuantizedTensor, dim: int, chunks: int, index: int) -> QuantizedTensor | None:
    """``torch.chunk(q, chunks, dim)[index].clone()``, without building the other pieces.

    What ``Replicate -> Shard`` computes on every rank: the same checks first
    (a cut through a pack or block raises on every rank, whichever piece it
    keeps), then one narrow_copy (narrow and clone in one op) of each inner tensor, decided once
    per (layout, piece). None where the piece is past the last one
    (``torch.chunk`` gives fewer pieces when ``dim`` is short; DTensor's own
    code makes that empty piece).
    """
    dim %= len(q.props[0])
    factory = q.notes.from_factory
    plan = memo(
        ("chunk_copy", *layout_key(q), dim, chunks, index, factory),
        lambda: _chunk_plan(q, dim, chunks, index, factory),
        q.rels,
        q.dims,
        q.fmt,
    )
    if plan is None:
        return None
    cuts, rels, shape, stride = plan
    fmt, (_, _, dtype, device) = q.fmt, q.props
    # narrow_copy: the narrow and the contiguous clone in one op (one trip from Python per inner tensor, not two)
    inner = [getattr(q, name).narrow_copy(dim, i0, n) for name, (i0, n) in zip(fmt.inner_names, cuts)]
    return QuantizedTensor.make(inner, fmt, rels, q.dims, shape, stride, dtype, rules.new_bytes(inner), device)


def _chunk_plan(q: QuantizedTensor, dim: int, chunks: int, index: int, factory: bool):
    """Per inner its narrow, and the piece's relations, shape and strides as ``clone`` leaves them."""
    sizes = chunk_sizes(q.shape[dim], chunks)
    check_cuts(q, dim, sizes)
    if index >= len(sizes):
        return None
    start = sum(sizes[:index])
    cuts, rels, shape, stride, _ = sliced_layout(q, dim, start, start + sizes[index], factory)
    if torch.empty_strided(shape, stride, device="meta").is_contiguous():  # clone's rule, torch's test
        stride = contiguous_strides(shape)
    return cuts, rels, shape, stride


@implements("aten::cat")
def _cat(func, tensors, dim=0):
    tensors = [t for t in tensors if not (t.ndim == 1 and t.numel() == 0 and not isinstance(t, QuantizedTensor))]
    if not all(isinstance(t, QuantizedTensor) for t in tensors):
        raise LayoutError(
            "cannot concatenate quantized and dense tensors: that would dequantize or requantize "
            "silently. Quantize or dequantize them explicitly first."
        )
    return cat_dim(tensors, dim % tensors[0].ndim)


@implements("aten::constant_pad_nd")
def _pad(func, q, pad, value=0):
    if value != 0:
        raise LayoutError(f"{describe(q)}: only zero padding is supported, got value={value}")
    out = q
    for i in range(len(pad) // 2):
        dim = q.ndim - 1 - i
        lo, hi = pad[2 * i], pad[2 * i + 1]
        if lo != 0:
            raise LayoutError(f"{describe(q)}: padding in front of dim {dim} would shift every block")
        if hi < 0:
            out = slice_dim(out, dim, 0, out.shape[dim] + hi)
        elif hi > 0:
            out = pad_end(out, dim, hi)
    return out


@implements("aten::select")
def _select(func, q, dim, index):
    return select_dim(q, dim % q.ndim, index)


@implements("aten::unbind")
def _unbind(func, q, dim=0):
    dim %= q.ndim
    return [select_dim(q, dim, i) for i in range(q.shape[dim])]


@implements("aten::index")
def _index(func, q, indices):
    """``q[ids]`` with one integer index tensor on the leading (expert) dim: a stack of the chosen matrices."""
    indices = list(indices)
    if len(indices) != 1 or indices[0] is None or indices[0].dtype in (torch.bool, torch.uint8) or matrix_dims(q) < 1:
        raise UnsupportedOpError(
            f"{describe(q)}: only indexing the leading (expert) dim with one integer tensor is supported"
        )
    ids = indices[0]
    if is_tracing(ids):
        raise UnsupportedOpError(f"{describe(q)}: indexing needs concrete indices, not traced ones")
    flat = [select_dim(q, 0, i) for i in ids.reshape(-1).tolist()]
    inner = {
        n: torch.stack([getattr(p, n) for p in flat]).reshape(*ids.shape, *getattr(q, n).shape[1:])
        for n in q.fmt.inner_names
    }
    lead = (q.rels[0][0],) * ids.ndim
    rels = tuple(lead + row[1:] for row in q.rels)
    shape = (*ids.shape, *q.shape[1:])
    nd = len(shape)
    dims = canonical_dims(nd) if q.dims == canonical_dims(q.ndim) else transposed_dims(nd)
    return rebuild(q, inner, shape, rels=rels, dims=dims)


@implements("aten::index_select")
def _index_select(func, q, dim, index):
    """Gather whole blocks along ``dim`` (the reordering ``_StridedShard`` does after a gather)."""
    dim %= q.ndim
    if is_tracing(index):
        raise UnsupportedOpError(f"{describe(q)}: index_select needs concrete indices, not traced ones")
    runs = _runs(index.tolist())
    return cat_dim([slice_dim(q, dim, s, e) for s, e in runs], dim) if runs else slice_dim(q, dim, 0, 0)


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive positions, as ``[start, stop)``; each becomes one slice."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([p, p + 1])
    return [(s, e) for s, e in runs]
