"""The local ops DTensor, FSDP2 and DCP issue on a QuantizedTensor, derived from its layout.

Each handler maps a logical op to the same op on every inner tensor, using
only the relations in ``QuantizedTensor.rels``; none of them knows a format.
The collectives live in :mod:`dtensor_quant.collectives` and the matmuls in
:mod:`dtensor_quant.matmul`; they register into the same table. Ops are keyed
by schema name (``"aten::slice"``), so ops registered lazily by torch (such as
``_c10d_functional::_wrap_tensor_autograd``) are matched when they first
arrive, not at import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from . import unpack, writes
from .layout import (
    Blocked,
    Constant,
    FlatBlocked,
    InFlat,
    LayoutError,
    OneToOne,
    Packed,
    Stacked,
    can_flatten,
    dim_factor,
    inner_slice,
    legal_chunk_counts,
)
from .tensor import QuantizedTensor, contiguous_strides

aten = torch.ops.aten
HANDLERS: dict[str, Callable] = {}


class UnsupportedOpError(NotImplementedError):
    """An op the quantized layout cannot express without dequantizing."""


def implements(*names: str):
    def register(fn):
        for name in names:
            HANDLERS[name] = fn
        _BY_OP.clear()
        return fn

    return register


_BY_OP: dict = {}  # OpOverload -> handler, filled on first use (schema names cost a lookup)


# dtensor_quant.fastpath sets this: it replays the hot ops' decisions made once per layout, or returns
# NotImplemented for the handler to run.
FAST_PATH: Callable | None = None


def dispatch(func, args, kwargs):
    if FAST_PATH is not None:
        out = FAST_PATH(func, args, kwargs)
        if out is not NotImplemented:
            return out
    handler = _BY_OP.get(func)
    if handler is None:
        handler = _BY_OP[func] = HANDLERS.get(func._schema.name)
    if handler is None and _composite(func):
        # Composite ops (chunk, linear, matmul, ...) normally decompose above us, but reach us
        # under inference mode or from inside another subclass's dispatch (a redistribute
        # DTensor runs while dispatching an op): decompose them into the ops defined here.
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    if handler is None:
        q = next(a for a in _flat(args, kwargs) if isinstance(a, QuantizedTensor))
        raise UnsupportedOpError(
            f"dtensor_quant: {func} is not defined on {q.fmt} quantized tensors: it would "
            "need dense values. Call .dequantize() first to work on a dense copy."
        )
    return handler(func, *args, **kwargs)


def _composite(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


def _flat(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


# -- helpers ---------------------------------------------------------------


def canonical_dims(ndim: int) -> tuple[tuple[int, ...], ...]:
    return tuple((i,) for i in range(ndim))


def transposed_dims(ndim: int) -> tuple[tuple[int, ...], ...]:
    """``dims`` of a weight ``[..., out, in]`` after ``transpose(-2, -1)``: ``[..., in, out]``."""
    return canonical_dims(ndim - 2) + ((ndim - 1,), (ndim - 2,))


def is_transposed(q: QuantizedTensor) -> bool:
    return q.ndim >= 2 and q.dims == transposed_dims(q.ndim)


def _strides(q: QuantizedTensor, shape, dims) -> tuple[int, ...]:
    """Logical strides for a result of ``q``: contiguous unless ``q`` was a transposed view."""
    n = len(shape)
    if q.is_contiguous() or n < 2 or dims != transposed_dims(n):
        return contiguous_strides(shape)
    swapped = contiguous_strides((*shape[:-2], shape[-1], shape[-2]))
    return (*swapped[:-2], swapped[-1], swapped[-2])


def matrix_dims(q: QuantizedTensor) -> int:
    """How many leading (expert) dims ``q`` has in front of its ``[out, in]`` (or ``[in, out]``) matrix.

    0 for a 2-D weight and for anything that is not a plain stack of
    matrices (a flat view, a weight broadcast over a batch by ``expand``).
    """
    k = q.ndim - 2
    if k <= 0 or q.dims not in (canonical_dims(q.ndim), transposed_dims(q.ndim)):
        return 0
    return k


# "fsdp_padded_rows": the rows of the buffer this tensor is a leading-rows narrow of
# (FSDP2 keeps an uneven shard as such a narrow of its zero-padded shard, and
# dtensor_quant.fsdp pads to it). Only aliases and device copies of the narrow keep it:
# a factory or clone of a split piece is not a narrow of anything.
PADDED_ROWS = "fsdp_padded_rows"


# "_dtensor_quant_view_of": the tensor an inner view was taken from. Views made inside
# __torch_dispatch__ have no ``_base`` (autograd's view tracking is below us), and a kernel
# caches its prepared weight on the viewed tensor (dtensor_quant.matmul), so the experts
# selected from a stack record the stack's inner tensor here.
VIEW_OF = "_dtensor_quant_view_of"


def _view_of(view: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    owner = t.__dict__.get(VIEW_OF)
    view.__dict__[VIEW_OF] = owner if owner is not None else (t._base if t._base is not None else t)
    return view


def _keep_padded_rows(src: QuantizedTensor, out: QuantizedTensor) -> QuantizedTensor:
    if PADDED_ROWS in src.__dict__ and out.shape == src.shape:
        out.__dict__[PADDED_ROWS] = src.__dict__[PADDED_ROWS]
    return out


def rebuild(q: QuantizedTensor, inner, shape, *, rels=None, dims=None, dtype=None, stride=None):
    dims = q.dims if dims is None else dims
    return QuantizedTensor(
        inner,
        q.fmt,
        q.rels if rels is None else rels,
        dims,
        tuple(shape),
        q.dtype if dtype is None else dtype,
        stride if stride is not None else _strides(q, shape, dims),
    )


def _map_inner(q: QuantizedTensor, fn) -> dict[str, torch.Tensor]:
    return {name: fn(t) for name, t in q.inner.items()}


def _with_rel(rels: tuple, dim: int, rel) -> tuple:
    return rels[:dim] + (rel,) + rels[dim + 1 :]


def _describe(q: QuantizedTensor) -> str:
    return f"{q.fmt} tensor of shape {tuple(q.shape)}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included; works for float8, which has no torch.equal on CPU)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        a, b = a.contiguous().view(_INT_OF_SIZE[a.element_size()]), b.contiguous().view(_INT_OF_SIZE[b.element_size()])
    return torch.equal(a, b)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tracing(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake, meta or functional tensor of a trace (no data to look at)."""
    if type(t) is torch.Tensor:  # the common eager case, without is_fake's cost
        return t.is_meta
    return is_fake(t) or t.device.type == "meta" or isinstance(t, torch.fx.Proxy)


# -- slicing, splitting, concatenation, padding -----------------------------


def slice_dim(q: QuantizedTensor, dim: int, start: int, stop: int) -> QuantizedTensor:
    """``q[..., start:stop, ...]`` along ``dim``; the inner tensors are views."""
    length = q.shape[dim]
    inner, rels = {}, []
    for (name, t), rel_row in zip(q.inner.items(), q.rels):
        try:
            i0, i1, rel = inner_slice(rel_row[dim], start, stop, length)
        except LayoutError as e:
            raise LayoutError(
                f"{_describe(q)}: cannot take [{start}:{stop}] of dim {dim}: inner '{name}' is "
                f"{rel_row[dim]} along it ({e}). dtensor_quant.check_placements() lists the mesh sizes "
                "whose shard boundaries are legal."
            ) from None
        inner[name] = t.narrow(dim, i0, i1 - i0)
        rels.append(_with_rel(rel_row, dim, rel))
    shape = list(q.shape)
    shape[dim] = stop - start
    out = rebuild(q, inner, shape, rels=tuple(rels))
    writes.note_slice(q, out, dim, start, stop)
    if dim == 0 and start == 0 and stop < length:
        out.__dict__[PADDED_ROWS] = max(length, q.__dict__.get(PADDED_ROWS, 0))
    elif dim != 0 or start == 0:
        _keep_padded_rows(q, out)
    return out


def _check_cuts(q: QuantizedTensor, dim: int, sizes: Sequence[int]) -> None:
    """Raise, naming the legal shard counts, if a split would cut a packed element or a block."""
    rels = {name: row[dim] for name, row in zip(q.fmt.inner_names, q.rels) if not isinstance(row[dim], Stacked)}
    try:
        factor = dim_factor(list(rels.values()))
    except LayoutError as e:
        raise LayoutError(f"{_describe(q)}: cannot split dim {dim} into pieces of {list(sizes)[:8]}: {e}") from None
    cuts = [sum(sizes[:i]) for i in range(1, len(sizes))]
    bad = next((c for c in cuts if factor > 1 and c % factor and c < q.shape[dim]), None)
    if bad is None:
        return
    why = ", ".join(f"'{n}' is {r}" for n, r in rels.items() if r.factor > 1)
    length = q.shape[dim]
    legal = legal_chunk_counts(length, factor)
    hint = (
        f"Sharding this dim over n ranks cuts only on multiples of {factor} for n = {', '.join(map(str, legal))}."
        if legal != [1]
        else "This dim cannot be sharded at all; shard another dim (check_placements lists the legal sizes)."
    )
    raise LayoutError(
        f"{_describe(q)}: cannot split dim {dim} (size {length}) into pieces of {list(sizes)[:8]}: the cut "
        f"at {bad} is not a multiple of {factor} ({why}). {hint}"
    )


def cat_dim(pieces: Sequence[QuantizedTensor], dim: int, joined: dict | None = None) -> QuantizedTensor:
    """Concatenate quantized pieces along ``dim`` (what every gather does after the collective).

    Any pieces of one format concatenate: where their blocks continue one grid
    the relation stays; where they do not (a piece ending in a partial block,
    constant inners that differ) the result is ``Stacked`` in runs of the
    piece length, which splitting at piece boundaries undoes. ``joined`` maps
    inner names to tensors that already hold the concatenation (an all-gather
    output the pieces are views of), used as they are instead of copied.
    """
    first = pieces[0]
    for p in pieces[1:]:
        if not isinstance(p, QuantizedTensor) or p.fmt != first.fmt or p.dims != first.dims:
            raise LayoutError(
                f"cannot concatenate {_describe(first)} with {p!r}: pieces must share format and orientation"
            )
    inner, rels = {}, []
    for i, name in enumerate(first.fmt.inner_names):
        parts = [getattr(p, name) for p in pieces]
        rel_rows = [p.rels[i] for p in pieces]
        if len(parts) > 1 and all(t is parts[0] for t in parts) and all(isinstance(r[dim], Constant) for r in rel_rows):
            # One tensor shared by every piece (a scale no collective sent): equal without
            # concatenating and comparing copies (a host sync on CUDA); cloned, as a cat would be.
            inner[name] = parts[0].clone()
            rels.append(rel_rows[0])
            continue
        if joined is not None and name in joined:
            whole = joined[name]
        else:
            whole = torch.cat(parts, dim) if len(parts) > 1 else parts[0]
        rel = _cat_relation(name, dim, pieces, [r[dim] for r in rel_rows], whole)
        inner[name] = whole.narrow(dim, 0, 1) if isinstance(rel, Constant) else whole
        rels.append(_with_rel(rel_rows[0], dim, rel))
    shape = list(first.shape)
    shape[dim] = sum(p.shape[dim] for p in pieces)
    return rebuild(first, inner, shape, rels=tuple(rels))


def _cat_relation(name, dim, pieces, rels, joined):
    """The relation along ``dim`` of the concatenation of ``pieces`` (inner ``name`` joined)."""
    runs = []  # (logical length, relation) of every run of one grid, in order
    for piece, rel in zip(pieces, rels):
        length = piece.shape[dim]
        if isinstance(rel, Stacked):
            full, rem = divmod(length, rel.n)
            runs += [(rel.n, rel.rel)] * full + ([(rem, rel.rel)] if rem else [])
        else:
            runs.append((length, rel))
    kinds = {r for _, r in runs}
    if len(kinds) != 1:
        raise LayoutError(f"cannot concatenate along dim {dim}: inner '{name}' is laid out as {sorted(map(str, kinds))}")
    (rel,) = kinds
    lengths = [n for n, _ in runs]
    if isinstance(rel, Constant):
        if len(runs) == 1 or _tracing(joined) or same_bits(joined, joined.narrow(dim, 0, 1).expand_as(joined)):
            return Constant()
    elif all(n % rel.factor == 0 for n in lengths[:-1]):
        return rel
    run = lengths[0]
    if any(n != run for n in lengths[:-1]) or lengths[-1] > run:
        raise LayoutError(
            f"cannot concatenate pieces of {_describe(pieces[0])} along dim {dim}: inner '{name}' is {rel} "
            f"and the pieces ({lengths[:8]}) neither continue its grid nor have equal lengths"
        )
    return Stacked(run, rel)


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
        raise LayoutError(f"{_describe(q)}: strided slices (step={step}) cut packed elements and blocks")
    dim %= q.ndim
    return slice_dim(q, dim, *_resolve_slice(q.shape[dim], start, end))


@implements("aten::split")
def _split(func, q, split_size, dim=0):
    dim %= q.ndim
    length = q.shape[dim]
    sizes = [min(split_size, length - s) for s in range(0, length, split_size)] or [0]
    return _split_sizes(func, q, sizes, dim)


@implements("aten::split_with_sizes")
def _split_sizes(func, q, split_sizes, dim=0):
    dim %= q.ndim
    _check_cuts(q, dim, split_sizes)
    out, start = [], 0
    for size in split_sizes:
        out.append(slice_dim(q, dim, start, start + size))
        start += size
    return out


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
        raise LayoutError(f"{_describe(q)}: only zero padding is supported, got value={value}")
    out = q
    for i in range(len(pad) // 2):
        dim = q.ndim - 1 - i
        lo, hi = pad[2 * i], pad[2 * i + 1]
        if lo != 0:
            raise LayoutError(f"{_describe(q)}: padding in front of dim {dim} would shift every block")
        if hi < 0:
            out = slice_dim(out, dim, 0, out.shape[dim] + hi)
        elif hi > 0:
            out = _pad_end(out, dim, hi)
    return out


def _pad_end(q: QuantizedTensor, dim: int, amount: int) -> QuantizedTensor:
    """Append ``amount`` zero elements to ``dim`` (what uneven shards are padded with)."""
    length = q.shape[dim]
    inner = {}
    flat = [f"'{n}' is {r[dim]}" for n, r in zip(q.fmt.inner_names, q.rels) if isinstance(r[dim], InFlat)]
    if flat:
        raise LayoutError(
            f"{_describe(q)}: padding dim {dim} would move blocks that run across it ({', '.join(flat)}); "
            "this dim cannot be sharded, shard another dim"
        )
    for (name, t), rel_row in zip(q.inner.items(), q.rels):
        rel = rel_row[dim]
        if isinstance(rel, Packed) and amount % rel.p:
            raise LayoutError(f"{_describe(q)}: padding dim {dim} by {amount} splits a packed element ({rel})")
        extra = rel.inner_len(length + amount) - t.shape[dim] if not isinstance(rel, Constant) else 0
        if extra > 0:
            widths = [0, 0] * (t.ndim - 1 - dim) + [0, extra]
            t = torch.nn.functional.pad(t, widths)
        inner[name] = t
    shape = list(q.shape)
    shape[dim] = length + amount
    return rebuild(q, inner, shape)


def select_dim(q: QuantizedTensor, dim: int, index: int) -> QuantizedTensor:
    """``q[..., index, ...]`` along a leading (expert) ``dim``: one matrix, or a smaller stack.

    Every inner tensor is one-to-one along a leading dim, so each is indexed
    the same way; the result is an ordinary quantized weight the linear
    kernels take (a 2-D one for a single expert).
    """
    k = matrix_dims(q)
    if dim >= k:
        raise UnsupportedOpError(
            f"{_describe(q)}: select along dim {dim} would cut the quantized [out, in] matrix; only its "
            f"{k} leading (expert) dim(s) can be indexed"
        )
    length = q.shape[dim]
    if not -length <= index < length:
        raise IndexError(f"index {index} is out of bounds for dim {dim} of size {length} ({_describe(q)})")
    index %= length
    for name, row in zip(q.fmt.inner_names, q.rels):
        if not isinstance(row[dim], OneToOne):
            raise LayoutError(f"{_describe(q)}: inner '{name}' is {row[dim]} along leading dim {dim}, not one-to-one")
    inner = _map_inner(q, lambda t: _view_of(t.select(dim, index), t))
    rels = tuple(row[:dim] + row[dim + 1 :] for row in q.rels)
    shape = tuple(q.shape[:dim]) + tuple(q.shape[dim + 1 :])
    dims = (canonical_dims if q.dims == canonical_dims(q.ndim) else transposed_dims)(q.ndim - 1)
    stride = tuple(q.stride()[:dim]) + tuple(q.stride()[dim + 1 :])
    return rebuild(q, inner, shape, rels=rels, dims=dims, stride=stride)


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
            f"{_describe(q)}: only indexing the leading (expert) dim with one integer tensor is supported"
        )
    ids = indices[0]
    if _tracing(ids):
        raise UnsupportedOpError(f"{_describe(q)}: indexing needs concrete indices, not traced ones")
    flat = [select_dim(q, 0, i) for i in ids.reshape(-1).tolist()]
    inner = {n: torch.stack([getattr(p, n) for p in flat]).reshape(*ids.shape, *getattr(q, n).shape[1:]) for n in q.fmt.inner_names}
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
    if _tracing(index):
        raise UnsupportedOpError(f"{_describe(q)}: index_select needs concrete indices, not traced ones")
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


# -- views, copies and factories --------------------------------------------


@implements("aten::detach", "aten::alias", "aten::lift_fresh")
def _alias(func, q, *args, **kwargs):
    out = rebuild(q, _map_inner(q, lambda t: t.detach()), q.shape, stride=q.stride())
    writes.keep_shared(q, out)
    return _keep_padded_rows(q, out)


@implements("aten::view", "aten::_unsafe_view")
def _view(func, q, size):
    size = list(size)
    if -1 in size:
        known = 1
        for s in size:
            known *= s if s != -1 else 1
        size[size.index(-1)] = q.numel() // max(known, 1)
    if tuple(size) == tuple(q.shape):
        return _alias(func, q)
    if q.ndim > 2:  # a weight broadcast over a batch by torch.matmul (see matmul.py)
        from .matmul import rebatch

        out = rebatch(q, tuple(size))
        if out is not None:
            return out
    if len(size) == 1 and q.ndim >= 2 and q.dims == canonical_dims(q.ndim):
        return _flatten(q)
    g = _gathered_dim(tuple(q.shape), tuple(size))
    if g is not None:
        # funcol's all-gather along dim g views [world, ..., n, ...] as [1, ..., world * n, ...].
        return cat_dim([slice_dim(q, 0, i, i + 1) for i in range(q.shape[0])], g)
    if q.ndim == 1 and len(q.dims[0]) == len(size) >= 2 and q.dims == (tuple(range(len(size))),):
        return _unflatten(q, tuple(size))
    raise UnsupportedOpError(
        f"{_describe(q)}: view/reshape to {tuple(size)} is not expressible in the quantized layout "
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


def _flatten(q: QuantizedTensor) -> QuantizedTensor:
    """``view(-1)`` (FSDP2 calls it on every sharded parameter); N dims fold from the last."""

    def flat(row):
        rel, length = row[-1], q.shape[-1]
        for dim in range(q.ndim - 2, -1, -1):
            rel = can_flatten(row[dim], rel, length) if not isinstance(rel, _Opaque) else None
            rel, length = rel or _Opaque(), length * q.shape[dim]
        return (rel,)

    rels = tuple(flat(r) for r in q.rels)
    inner = _map_inner(q, lambda t: t.reshape(-1))
    return rebuild(q, inner, (q.numel(),), rels=rels, dims=(tuple(range(q.ndim)),), stride=(1,))


def _unflatten(q: QuantizedTensor, size: tuple[int, ...]) -> QuantizedTensor:
    from .format import weight_layout

    rows = tuple(weight_layout(q.fmt, size).values())
    inner = {}
    for (name, t), rel_row in zip(q.inner.items(), rows):
        shape = tuple(r.inner_len(n) for r, n in zip(rel_row, size))
        if t.numel() != torch.Size(shape).numel():
            raise UnsupportedOpError(f"{_describe(q)}: cannot view as {size}: inner '{name}' does not match")
        inner[name] = t.reshape(shape)
    return rebuild(q, inner, size, rels=rows, dims=canonical_dims(len(size)), stride=contiguous_strides(size))


class _Opaque:
    """The relation of an inner tensor after a flatten that does not follow the flat index."""

    @property
    def factor(self):
        raise LayoutError("this flattened quantized view cannot be sliced or resized")

    def inner_len(self, n):
        return self.factor

    def __str__(self):
        return "not sliceable after view(-1)"


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
        f"{_describe(q)}: as_strided(size={size}, stride={stride}, offset={storage_offset}) "
        "is only supported as an identity or a leading-rows narrow"
    )


@implements("aten::t")
def _t(func, q):
    return _transpose(func, q, 0, 1) if q.ndim == 2 else _alias(func, q)


@implements("aten::transpose")
def _transpose(func, q, dim0, dim1):
    dim0, dim1 = dim0 % q.ndim, dim1 % q.ndim
    if dim0 == dim1:
        return _alias(func, q)

    def swap(seq):
        seq = list(seq)
        seq[dim0], seq[dim1] = seq[dim1], seq[dim0]
        return tuple(seq)

    inner = _map_inner(q, lambda t: _view_of(t.transpose(dim0, dim1), t))
    rels = tuple(swap(r) for r in q.rels)
    out = rebuild(q, inner, swap(q.shape), rels=rels, dims=swap(q.dims), stride=swap(q.stride()))
    writes.keep_shared(q, out)
    # Kernels cache their prepared weight on the persistent tensor, not on this view.
    out.__dict__["_transposed_from"] = q.__dict__.get("_transposed_from", q)
    return out


@implements("aten::permute")
def _permute(func, q, dims):
    dims = [d % q.ndim for d in dims]
    if dims == sorted(dims):
        return _alias(func, q)
    if dims == list(range(q.ndim - 2)) + [q.ndim - 1, q.ndim - 2]:
        return _transpose(func, q, q.ndim - 2, q.ndim - 1)
    raise UnsupportedOpError(f"{_describe(q)}: permute({dims}) of a quantized tensor")


@implements("aten::clone")
def _clone(func, q, memory_format=None):
    contiguous = memory_format == torch.contiguous_format or q.is_contiguous()
    inner = _map_inner(q, lambda t: t.clone(memory_format=torch.contiguous_format))
    return rebuild(q, inner, q.shape, stride=contiguous_strides(q.shape) if contiguous else q.stride())


@implements("aten::_to_copy")
def _to_copy(func, q, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    """Device moves copy the stored bytes; a dtype only changes the logical (dequantized) dtype."""
    if dtype is not None and not dtype.is_floating_point:
        raise LayoutError(f"{_describe(q)}: cannot convert to {dtype}; dequantize() first")

    def move(t):
        out = t.to(device=device, non_blocking=non_blocking, copy=True)
        return out.pin_memory() if pin_memory else out

    return _keep_padded_rows(q, rebuild(q, _map_inner(q, move), q.shape, dtype=dtype, stride=q.stride()))


def _factory(q: QuantizedTensor, size, fill, dtype=None, device=None):
    """A quantized tensor of logical ``size`` laid out like ``q``: zero (or empty) bytes.

    Except for the inner tensors whose blocks are the same as ``q``'s -- constant
    along every dim whose size changes (a per-tensor scale, a row scale of an
    empty column shard): those describe blocks the new tensor shares with
    ``q``, so they are copied. torch creates empty trailing shards with
    ``new_zeros``; zeroing their shared scales would make a later gather
    disagree with the other ranks.
    """
    size = tuple(size)
    if size == (0,) and q.ndim >= 2 and q.dims == canonical_dims(q.ndim):
        # FSDP2's placeholder for the ranks past torch.chunk's last piece.
        return _flatten(_factory(q, (0, *q.shape[1:]), fill, dtype, device))
    if len(size) != q.ndim:
        raise UnsupportedOpError(f"{_describe(q)}: cannot create a quantized tensor of shape {size}")
    inner = {}
    for (name, t), rel_row in zip(q.inner.items(), q.rels):
        try:
            shape = tuple(r.inner_len(n) for r, n in zip(rel_row, size))
        except LayoutError as e:
            raise LayoutError(f"{_describe(q)}: cannot create shape {size}: inner '{name}': {e}") from None
        if any(isinstance(r, InFlat) and n != n0 for r, n, n0 in zip(rel_row, size, q.shape)):
            raise LayoutError(f"{_describe(q)}: cannot create shape {size}: inner '{name}' has flat blocks across rows")
        shared = any(isinstance(r, Constant) for r in rel_row) and all(
            isinstance(r, Constant) or n == n0 for r, n, n0 in zip(rel_row, size, q.shape)
        )
        if shared and not t.is_meta:  # a meta weight (built on "meta", then to_empty) has nothing to copy
            inner[name] = t.clone().to(device or t.device)
        else:
            inner[name] = fill(shape, dtype=t.dtype, device=device or t.device)
    out = rebuild(q, inner, size, dtype=dtype, stride=contiguous_strides(size))
    out.__dict__[writes.FACTORY] = True
    return out


@implements("aten::empty_like")
def _empty_like(func, q, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _factory(q, q.shape, torch.empty, dtype, device)


@implements("aten::zeros_like")
def _zeros_like(func, q, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _factory(q, q.shape, torch.zeros, dtype, device)


@implements("aten::new_zeros")
def _new_zeros(func, q, size, dtype=None, layout=None, device=None, pin_memory=None):
    return _factory(q, size, torch.zeros, dtype, device)


@implements("aten::new_empty")
def _new_empty(func, q, size, dtype=None, layout=None, device=None, pin_memory=None):
    return _factory(q, size, torch.empty, dtype, device)


@implements("aten::copy_")
def _copy_(func, dst, src, non_blocking=False):
    if not isinstance(dst, QuantizedTensor) or not isinstance(src, QuantizedTensor):
        dense, quant = (dst, src) if isinstance(src, QuantizedTensor) else (src, dst)
        raise LayoutError(
            f"cannot copy between a dense {tuple(dense.shape)} tensor and a {_describe(quant)}: that "
            "would silently requantize or dequantize. Use dtensor_quant.quantize() or .dequantize()."
        )
    if dst.fmt != src.fmt or dst.shape != src.shape:
        raise LayoutError(f"cannot copy a {_describe(src)} into a {_describe(dst)}")
    for name in dst.fmt.inner_names:
        d, s = getattr(dst, name), getattr(src, name)
        if d.shape != s.shape or d.dtype != s.dtype:
            raise LayoutError(
                f"cannot copy into {_describe(dst)}: inner '{name}' is {tuple(s.shape)}:{s.dtype} in the "
                f"source and {tuple(d.shape)}:{d.dtype} in the destination"
            )
    keep = writes.check_copy(dst, src, _describe)  # every check before the first byte moves
    for name in dst.fmt.inner_names:
        if name in keep:
            continue
        d, s = getattr(dst, name), getattr(src, name)
        d.copy_(s, non_blocking=non_blocking)
        # In-place ops inside __torch_dispatch__ skip the version bump (the ADInplaceOrView key is
        # already past); bump it so caches keyed on versions (matmul's prepared weights) see the write.
        torch.autograd.graph.increment_version(d)
    return dst


@implements("aten::is_pinned")
def _is_pinned(func, q, device=None):
    return all(t.is_pinned() for t in q.inner.values())


@implements("aten::_pin_memory")
def _pin_memory(func, q, device=None):
    return _keep_padded_rows(q, rebuild(q, _map_inner(q, lambda t: t.pin_memory()), q.shape, stride=q.stride()))


@implements("aten::record_stream")
def _record_stream(func, q, stream):
    for t in q.inner.values():
        t.record_stream(stream)


# -- dequantize --------------------------------------------------------------


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
        return fast if fast is not None else q.fmt.dequantize(_broadcastable(q.inner, q.rels, q.shape), dtype)
    if is_transposed(q):
        rels = tuple(row[::-1] for row in q.rels)
        if not _traced(q):
            fast = unpack.dense(QuantizedTensor(_map_inner(q, lambda t: t.t()), q.fmt, rels, canonical_dims(2), q.shape[::-1], q.dtype), dtype)
            if fast is not None:
                return fast.t()
        inner = _broadcastable(_map_inner(q, lambda t: t.t()), rels, q.shape[::-1])
        return q.fmt.dequantize(inner, dtype).t()
    raise UnsupportedOpError(f"{_describe(q)}: dequantize the tensor before view(-1), not after")


def _traced(q: QuantizedTensor) -> bool:
    return any(_tracing(t) for t in q.inner.values())


def _broadcastable(inner: dict[str, torch.Tensor], rels, shape) -> dict[str, torch.Tensor]:
    """What a format's ``dequantize`` receives: see :func:`broadcastable`."""
    return broadcastable(inner, block_sizes(rels), shape)


def block_sizes(rels) -> list[int]:
    """The block size of every (inner tensor, dim) in order, 0 where the dim is not blocked.

    A block over the flat index of this and the later dims (``FlatBlocked``, not packed) is
    given as ``-b``: a list of ints is what the compiled kernel op can take.
    """
    return [_block_size(rel) for row in rels for rel in row]


def _block_size(rel) -> int:
    if isinstance(rel, Blocked):
        return rel.b
    return -rel.b if isinstance(rel, FlatBlocked) and not rel.packed else 0


def broadcastable(inner: dict[str, torch.Tensor], blocks: Sequence[int], shape) -> dict[str, torch.Tensor]:
    """Blocked inner tensors repeated to one value per logical element; constant ones stay size 1.

    This is what a format's ``dequantize`` receives, so its math is elementwise
    (broadcasting) whatever the shard, block size or partial last block.
    ``blocks`` is :func:`block_sizes` of the tensor's relations.
    """
    out, ndim = {}, len(shape)
    for i, (name, t) in enumerate(inner.items()):
        for dim in range(ndim):
            b = blocks[i * ndim + dim]
            if b > 0:
                t = t.repeat_interleave(b, dim).narrow(dim, 0, shape[dim])
            elif b < 0:  # blocks over the flat index of dims dim.. (their inner dims are 1 after dim)
                span = tuple(shape[dim:])
                flat = t.flatten(dim).repeat_interleave(-b, dim).narrow(dim, 0, math.prod(span))
                t = flat.unflatten(dim, span)
                break
        out[name] = t
    return out


def canonical_inner(q: QuantizedTensor) -> dict[str, torch.Tensor] | None:
    """Inner tensors in the format's ``[..., out, in]`` orientation, or None if ``q`` is not a plain weight view."""
    if any(isinstance(r, Stacked) for row in q.rels for r in row):
        return None
    if q.ndim >= 2 and q.dims == canonical_dims(q.ndim):
        return q.inner
    if is_transposed(q):
        return _map_inner(q, lambda t: _view_of(t.transpose(-2, -1), t))
    return None
