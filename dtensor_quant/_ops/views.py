"""Views: aliases, ``view``/``reshape``, ``as_strided``, transposes.

DTensor and autograd take same-shape aliases everywhere; FSDP2 calls
``view(-1)`` and narrows padded rows with ``as_strided``; ``F.linear``
transposes the weight; funcol's all-gather along a dim views the stacked
pieces side by side.
"""

from __future__ import annotations

import torch

from .._core import memo as decisions
from .._core.dispatch import UnsupportedOpError, implements
from .._core.notes import Notes
from .._core.tensor import QuantizedTensor, contiguous_strides
from .layout_ops import (
    FLAT_RECIPE,
    T_RECIPE,
    alias,
    canonical_dims,
    cat_dim,
    describe,
    flatten,
    rebatch,
    slice_dim,
    transpose,
    unflatten,
)


@implements("aten::detach", "aten::alias", "aten::lift_fresh")
def _alias(func, q, *args, **kwargs):
    return alias(q)


# The two views every decode step and FSDP2 step issue, ``t()`` and ``view(-1)``, are built here from the
# recipe their first call kept on the tensor (layout_ops.transpose / flatten: the decided layout, the deferred
# inner views' maker) when there is one: one dict lookup instead of the memo key's building and hashing, and no
# further Python call but the wrapper's. The notes are made from the tensor's at each call, as the rules do
# (notes.transposed, notes.same_bytes: the same fields, built inline). Off with the memo (memo.disabled()).
_wrapper = torch.Tensor._make_wrapper_subclass
_record = tuple.__new__  # a Notes from a full tuple of its fields in one C call (as notes.py builds them)


@implements("aten::view", "aten::_unsafe_view")
def _view(func, q, size):
    if len(size) == 1 and decisions.ENABLED:
        recipe = q.__dict__.get(FLAT_RECIPE)
        if recipe is not None and (size[0] == -1 or size[0] == recipe[3][0][0]):
            fmt, rels, dims, props, pending = recipe
            out = _wrapper(QuantizedTensor, props[0], strides=props[1], dtype=props[2], device=props[3])
            out.fmt, out.rels, out.dims, out.props = fmt, rels, dims, props
            out.notes = _record(Notes, (q.notes.bytes, (), 0, False, None, pending))  # notes.same_bytes
            return out
    shape = q.props[0]  # not q.shape: a subclass's getters cost more, and these two views run on every call
    if tuple(size) == shape:  # DTensor's to_local / from_local view_as, first: it runs on every full_tensor
        return alias(q)
    nd = len(shape)
    if len(size) == 1 and nd >= 2 and size[0] in (-1, shape.numel()) and q.dims == canonical_dims(nd):
        return flatten(q)  # FSDP2's view(-1) of every sharded parameter, first
    size = list(size)
    if -1 in size:
        known = 1
        for s in size:
            known *= s if s != -1 else 1
        size[size.index(-1)] = q.numel() // max(known, 1)
    if tuple(size) == tuple(q.shape):
        return _alias(func, q)
    if q.ndim > 2:  # a weight broadcast over a batch by torch.matmul (see matmul.py)
        out = rebatch(q, tuple(size))
        if out is not None:
            return out
    if len(size) == 1 and q.ndim >= 2 and q.dims == canonical_dims(q.ndim):
        return flatten(q)
    g = _gathered_dim(tuple(q.shape), tuple(size))
    if g is not None:
        # funcol's all-gather along dim g views [world, ..., n, ...] as [1, ..., world * n, ...].
        return cat_dim([slice_dim(q, 0, i, i + 1) for i in range(q.shape[0])], g)
    if q.ndim == 1 and len(q.dims[0]) == len(size) >= 2 and q.dims == (tuple(range(len(size))),):
        return unflatten(q, tuple(size))
    raise UnsupportedOpError(
        f"{describe(q)}: view/reshape to {tuple(size)} is not expressible in the quantized layout "
        "(only the same shape, and -1 for a canonical 2-D weight)"
    )


def _gathered_dim(shape: tuple, size: tuple) -> int | None:
    """The dim ``g`` when ``size`` is ``shape``'s leading pieces laid side by side along ``g``.

    That is ``shape = [world, 1, .., 1, n, rest]`` and ``size = [1, .., 1,
    world * n, rest]``: what funcol's all-gather along a dim whose leading
    dims are all 1 does instead of chunk + cat.
    """
    if len(size) != len(shape) or len(shape) < 2 or size[0] != 1:
        return None
    for g in range(1, len(shape)):
        if size[g] != 1 or shape[g] != 1:
            break
    else:
        return None
    if size[g] == shape[0] * shape[g] and size[g + 1 :] == shape[g + 1 :] and all(n == 1 for n in size[:g]):
        return g
    return None


@implements("aten::as_strided")
def _as_strided(func, q, size, stride, storage_offset=None):
    size, stride = tuple(size), tuple(stride)
    if storage_offset in (None, 0) and size == tuple(q.shape) and stride == tuple(q.stride()):
        return _alias(func, q)
    # FSDP2 narrows the padded rows of an unevenly sharded parameter away this way.
    if (
        storage_offset in (None, 0)
        and q.is_contiguous()
        and len(size) == q.ndim
        and size[1:] == tuple(q.shape[1:])
        and size[0] <= q.shape[0]
        and stride == contiguous_strides(size)
    ):
        return slice_dim(q, 0, 0, size[0])
    raise UnsupportedOpError(
        f"{describe(q)}: as_strided(size={size}, stride={stride}, offset={storage_offset}) "
        "is only supported as an identity or a leading-rows narrow"
    )


@implements("aten::t")
def _t(func, q):
    recipe = q.__dict__.get(T_RECIPE) if decisions.ENABLED else None
    if recipe is None:
        return transpose(q, 0, 1) if len(q.props[0]) == 2 else alias(q)
    fmt, rels, dims, props, fill = recipe
    out = _wrapper(QuantizedTensor, props[0], strides=props[1], dtype=props[2], device=props[3])
    out.fmt, out.rels, out.dims, out.props = fmt, rels, dims, props
    notes = q.notes  # notes.transposed: the same bytes and shared blocks, the weight it came from, pending
    weight = q if notes.weight is None else notes.weight
    out.notes = _record(Notes, (notes.bytes, notes.shared_outside, 0, False, weight, (fill, q, 0, 1)))
    return out


@implements("aten::transpose")
def _transpose(func, q, dim0, dim1):
    return transpose(q, dim0, dim1)


@implements("aten::permute")
def _permute(func, q, dims):
    dims = [d % q.ndim for d in dims]
    if dims == sorted(dims):
        return _alias(func, q)
    if dims == list(range(q.ndim - 2)) + [q.ndim - 1, q.ndim - 2]:
        return _transpose(func, q, q.ndim - 2, q.ndim - 1)
    raise UnsupportedOpError(
        f"{describe(q)}: permute({dims}) of a quantized tensor: only swapping the last two dims is a layout "
        "change (q.t() of a weight, q.transpose(-2, -1) of an expert stack); else dequantize first (q.dequantize())"
    )
