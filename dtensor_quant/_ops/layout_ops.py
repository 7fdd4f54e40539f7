"""Layout operations on QuantizedTensors: slice, split, concatenate, pad, select, flatten, create.

Each one maps a logical operation to the same operation on every inner
tensor, using only the relations in ``QuantizedTensor.rels`` (no format
knows them, none of them knows a format). They are the vocabulary of
everything above: the aten handlers (:mod:`dtensor_quant._ops`) are thin
wrappers over them, the collectives join received pieces with
:func:`cat_dim`, FSDP2's hooks pad short shards with :func:`pad_end`, the
matmuls select experts with :func:`select_dim`, and dequantizing hands a
format :func:`broadcastable` inner tensors. A cut that would split a packed
element or a block raises :class:`~dtensor_quant.LayoutError` naming the
legal shard counts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch.utils import _python_dispatch

from .._core import memo as decisions
from .._core import notes as rules
from .._core.bits import is_tracing, same_bits
from .._core.dispatch import UnsupportedOpError
from .._core.format import weight_layout
from .._core.layout import (
    Blocked,
    Constant,
    FlatBlocked,
    InFlat,
    LayoutError,
    OneToOne,
    Opaque,
    Packed,
    Stacked,
    can_flatten,
    dim_factor,
    inner_slice,
    legal_chunk_counts,
)
from .._core.memo import layout_key, memo, remember
from .._core.tensor import VIEW_RECIPES, QuantizedTensor, contiguous_strides

#: ``q.__dict__`` keys of ``q.t()``'s and ``q.view(-1)``'s recipes (kept by :func:`transpose` and :func:`flatten`,
#: read by the handlers in :mod:`dtensor_quant._ops.views`).
T_RECIPE, FLAT_RECIPE = VIEW_RECIPES

# -- orientation and construction ---------------------------------------------


@functools.cache
def canonical_dims(ndim: int) -> tuple[tuple[int, ...], ...]:
    """``dims`` of a weight as quantized: logical dim i is the format's dim i (one tuple object per ndim)."""
    return tuple((i,) for i in range(ndim))


@functools.cache
def transposed_dims(ndim: int) -> tuple[tuple[int, ...], ...]:
    """``dims`` of a weight ``[..., out, in]`` after ``transpose(-2, -1)``: ``[..., in, out]``."""
    return canonical_dims(ndim - 2) + ((ndim - 1,), (ndim - 2,))


def is_transposed(q: QuantizedTensor) -> bool:
    """Whether ``q`` is a weight viewed through ``.t()`` / ``.mT`` (the orientation ``F.linear`` uses)."""
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


def rebuild(q: QuantizedTensor, inner, shape, *, rels=None, dims=None, dtype=None, stride=None, notes=None):
    """A QuantizedTensor of ``q``'s format over ``inner``; what is not given is ``q``'s.

    The logical strides default to contiguous, or to a transposed view's when
    ``q`` is one and the result keeps its orientation. ``notes`` default to
    new bytes (:func:`dtensor_quant._core.notes.new_bytes`): pass the rule's
    notes for a view.
    """
    dims = q.dims if dims is None else dims
    return QuantizedTensor(
        inner,
        q.fmt,
        q.rels if rels is None else rels,
        dims,
        tuple(shape),
        q.dtype if dtype is None else dtype,
        stride if stride is not None else _strides(q, shape, dims),
        notes=notes,
    )


def map_inner(q: QuantizedTensor, fn) -> dict[str, torch.Tensor]:
    """``fn`` applied to every inner tensor, by name."""
    return {name: fn(t) for name, t in q.inner.items()}


def _with_rel(rels: tuple, dim: int, rel) -> tuple:
    return rels[:dim] + (rel,) + rels[dim + 1 :]


def describe(q: QuantizedTensor) -> str:
    """How error messages name a quantized tensor: its format and logical shape."""
    return f"{q.fmt} tensor of shape {tuple(q.shape)}"


def alias(q: QuantizedTensor) -> QuantizedTensor:
    """A new wrapper over the same inner tensors (``detach``, same-shape ``view``).

    The very same inner tensor objects (they carry no autograd history to
    drop): the state dict's ``param.detach()`` then hands a checkpoint loader
    the weight's own inner tensors, whose versions its kernel caches watch,
    and the compiled kernel op finds the weight's bytes record through them.
    """
    fmt, inner = q.fmt, []
    for n in fmt.inner_names:  # a loop, not a comprehension: one call less (DTensor aliases on every gather)
        t = getattr(q, n)
        inner.append(t.detach() if t.requires_grad else t)
    return QuantizedTensor.make_view(fmt, q.rels, q.dims, q.props, rules.alias(q.notes), inner)


def transpose(q: QuantizedTensor, dim0: int, dim1: int) -> QuantizedTensor:
    """``q.transpose(dim0, dim1)`` (``F.linear``'s ``w.t()``): a view with swapped relations and orientation.

    The inner transposes of a plain weight are made when first read
    (``Notes.pending``): the ``mm`` that follows ``t()`` in every ``F.linear``
    reads the weight's own inner tensors (``Notes.weight``), so they are
    mostly never made. Formats with an inner name that is also a Tensor
    attribute (NF4's ``mean``) get them at once.
    """
    # A subclass's tensor properties cost several times a dense tensor's: read them off q.props
    # (this runs for every F.linear).
    props = q.props
    nd = len(props[0])
    dim0, dim1 = dim0 % nd, dim1 % nd
    if dim0 == dim1:
        return alias(q)
    fmt = q.fmt
    # (memo.memo inlined; the key is layout_key's, with the device: the decision holds the result's props)
    key = ("transpose", id(q.rels), id(q.dims), id(fmt), *props, dim0, dim1)
    hit = decisions.TABLE.get(key) if decisions.ENABLED else None
    decision = None if hit is None else hit[0]
    if decision is None:
        decision = remember(key, _transposed_layout(q, dim0, dim1), q.rels, q.dims, fmt)
    rels, dims, props, deferrable = decision
    first = getattr(q, fmt.inner_names[0])
    if deferrable and type(first) is torch.Tensor and not first.is_meta:
        if nd == 2 and dim0 == 0 and decisions.ENABLED:
            # q.t() from now on (views.py): this decision, read off q itself. Nothing in it holds q.
            q.__dict__[T_RECIPE] = (fmt, rels, dims, props, _make_transposes)
        notes = rules.transposed(q.notes, q, (_make_transposes, q, dim0, dim1))
        return QuantizedTensor.make_view(fmt, rels, dims, props, notes)
    inner = [getattr(q, name).transpose(dim0, dim1) for name in fmt.inner_names]
    return QuantizedTensor.make_view(fmt, rels, dims, props, rules.transposed(q.notes, q), inner)


def _transposed_layout(q: QuantizedTensor, dim0: int, dim1: int):
    def swap(seq):
        seq = list(seq)
        seq[dim0], seq[dim1] = seq[dim1], seq[dim0]
        return tuple(seq)

    deferrable = not any(hasattr(QuantizedTensor, n) for n in q.fmt.inner_names)
    shape, stride, dtype, device = q.props
    props = (torch.Size(swap(shape)), swap(stride), dtype, device)
    return tuple(swap(r) for r in q.rels), swap(q.dims), props, deferrable


def _make_transposes(out: QuantizedTensor, q: QuantizedTensor, dim0: int, dim1: int) -> None:
    """Set ``out``'s deferred inner tensors: ``q``'s, transposed, made below autograd and any mode as in dispatch."""
    with torch._C._AutoDispatchBelowADInplaceOrView(), _python_dispatch._disable_current_modes():
        for name in q.fmt.inner_names:
            setattr(out, name, getattr(q, name).transpose(dim0, dim1))


# -- slicing, splitting, concatenation, padding -----------------------------


def slice_dim(q: QuantizedTensor, dim: int, start: int, stop: int) -> QuantizedTensor:
    """``q[..., start:stop, ...]`` along ``dim``; the inner tensors are views."""
    q_notes, fmt = q.notes, q.fmt
    factory = q_notes.from_factory
    cuts, rels, shape, stride, outside = memo(
        ("slice", *layout_key(q), dim, start, stop, factory),
        lambda: sliced_layout(q, dim, start, stop, factory),
        q.rels,
        q.dims,
        fmt,
    )
    q_shape, _, dtype, device = q.props
    inner = [getattr(q, name).narrow(dim, i0, n) for name, (i0, n) in zip(fmt.inner_names, cuts)]
    notes = rules.sliced(q_notes, outside, q_shape[dim], dim, start, stop)
    return QuantizedTensor.make(inner, fmt, rels, q.dims, shape, stride, dtype, notes, device)


def sliced_layout(q: QuantizedTensor, dim: int, start: int, stop: int, factory: bool):
    """Per inner ``(start, length)`` of its narrow, the result's relations, shape and strides, and which inner
    tensors reach outside the range (:func:`dtensor_quant._core.notes.outside_cuts`)."""
    length = q.shape[dim]
    cuts, rels = [], []
    for name, rel_row in zip(q.fmt.inner_names, q.rels):
        try:
            i0, i1, rel = inner_slice(rel_row[dim], start, stop, length)
        except LayoutError as e:
            raise LayoutError(
                f"{describe(q)}: cannot take [{start}:{stop}] of dim {dim}: inner '{name}' is "
                f"{rel_row[dim]} along it ({e}). dtensor_quant.check_placements() lists the mesh sizes "
                "whose shard boundaries are legal."
            ) from None
        cuts.append((i0, i1 - i0))
        rels.append(_with_rel(rel_row, dim, rel))
    shape = list(q.shape)
    shape[dim] = stop - start
    outside = rules.outside_cuts(q.rels, length, dim, start, stop, factory)
    return tuple(cuts), tuple(rels), torch.Size(shape), _strides(q, shape, q.dims), outside


def split_dim(q: QuantizedTensor, dim: int, sizes: Sequence[int]) -> list[QuantizedTensor]:
    """``torch.split(q, sizes, dim)``: views, one per piece; a cut through a pack or block raises.

    Decided once per (layout, sizes): each piece's layout and, per inner
    tensor, its cuts -- one ``split_with_sizes`` where they tile it.
    """
    sizes = tuple(sizes)
    factory = q.notes.from_factory
    pieces, per_inner = memo(
        ("split", *layout_key(q), dim, sizes, factory),
        lambda: _split_layout(q, dim, sizes, factory),
        q.rels,
        q.dims,
        q.fmt,
    )
    columns = []  # per inner tensor, its piece of every output
    for name, (tiling, cuts) in zip(q.fmt.inner_names, per_inner):
        t = getattr(q, name)
        if tiling is not None and t.shape[dim] == tiling[1]:
            columns.append(t.split_with_sizes(tiling[0], dim))
        else:
            columns.append([t.narrow(dim, i0, n) for i0, n in cuts])
    out, start, length = [], 0, q.shape[dim]
    for i, (rels, shape, stride, outside) in enumerate(pieces):
        stop = start + sizes[i]
        notes = rules.sliced(q.notes, outside, length, dim, start, stop)
        out.append(
            QuantizedTensor.make([c[i] for c in columns], q.fmt, rels, q.dims, shape, stride, q.dtype, notes, q.device)
        )
        start = stop
    return out


def _split_layout(q: QuantizedTensor, dim: int, sizes: tuple, factory: bool):
    """Per piece ``(relations, shape, strides, outside cuts)``; per inner ``(tiling or None, its narrows)``.

    A tiling is ``(sizes, total)`` when an inner tensor's pieces follow one another from 0 to
    ``total`` (one ``split_with_sizes``); a constant inner is not cut, so every piece narrows all of it.
    """
    check_cuts(q, dim, sizes)
    pieces, narrows, start = [], [[] for _ in q.rels], 0
    for size in sizes:
        cuts, rels, shape, stride, outside = sliced_layout(q, dim, start, start + size, factory)
        for mine, cut in zip(narrows, cuts):
            mine.append(cut)
        pieces.append((rels, shape, stride, outside))
        start += size
    per_inner = []
    for cuts in narrows:
        ends = [i0 + n for i0, n in cuts]
        tiles = bool(cuts) and cuts[0][0] == 0 and all(i0 == end for (i0, _), end in zip(cuts[1:], ends))
        per_inner.append(((tuple(n for _, n in cuts), ends[-1]) if tiles else None, tuple(cuts)))
    return tuple(pieces), tuple(per_inner)


def check_cuts(q: QuantizedTensor, dim: int, sizes: Sequence[int]) -> None:
    """Raise, naming the legal shard counts, if a split would cut a packed element or a block."""
    rels = {name: row[dim] for name, row in zip(q.fmt.inner_names, q.rels) if not isinstance(row[dim], Stacked)}
    try:
        factor = dim_factor(list(rels.values()))
    except LayoutError as e:
        raise LayoutError(f"{describe(q)}: cannot split dim {dim} into pieces of {list(sizes)[:8]}: {e}") from None
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
        f"{describe(q)}: cannot split dim {dim} (size {length}) into pieces of {list(sizes)[:8]}: the cut "
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

    Decided once per (pieces' layouts, which inner tensors they share): what
    to join and each relation; whether constant inner tensors of different
    pieces agree is read from the data on every call, and the result's layout
    is then decided once per outcome (a gather that reshards ``Shard(1)``
    concatenates new pieces on every call).
    """
    first = pieces[0]
    for p in pieces[1:]:
        if not isinstance(p, QuantizedTensor) or p.fmt != first.fmt or p.dims != first.dims:
            raise LayoutError(
                f"cannot concatenate {describe(first)} with {p!r}: pieces must share format and orientation"
            )
    names = first.fmt.inner_names
    parts_by_name = [[getattr(p, name) for p in pieces] for name in names]
    # One tensor shared by every piece, constant along dim (a scale no collective sent): equal without
    # concatenating and comparing copies (a host sync on CUDA); cloned, as a cat would be.
    shared = tuple(len(parts) > 1 and all(t is parts[0] for t in parts) for parts in parts_by_name)
    key = ("cat", dim, shared, tuple(joined) if joined else (), *(layout_key(p) for p in pieces))
    pins = [x for p in pieces for x in (p.rels, p.dims, p.fmt)]
    checked = memo(key, lambda: _cat_checked(pieces, dim, shared), *pins)
    inner, equal = [], []
    for name, parts, check in zip(names, parts_by_name, checked):
        if check == "shared":
            inner.append(parts[0].clone())
            continue
        given = joined[name] if joined is not None and name in joined else None
        if check:  # a constant inner of several pieces: the pieces agree, or the result is Stacked
            same = is_tracing(parts[0]) or all(same_bits(t, parts[0]) for t in parts[1:])
            equal.append(same)
            if same:  # the first piece's copy, as new bytes (a view of the gathered buffer when given)
                inner.append(given.narrow(dim, 0, 1) if given is not None else parts[0].clone())
                continue
        if given is None:
            given = torch.cat(parts, dim) if len(parts) > 1 else parts[0]
        inner.append(given)
    rels, shape, stride = memo((*key, tuple(equal)), lambda: _cat_layout(pieces, dim, checked, equal), *pins)
    # One piece is the piece itself (its bytes); joined pieces are new bytes.
    notes = rules.same_bytes(first.notes) if len(pieces) == 1 else rules.new_bytes(inner)
    return QuantizedTensor.make(inner, first.fmt, rels, first.dims, shape, stride, first.dtype, notes, first.device)


def _cat_checked(pieces, dim: int, shared: tuple) -> tuple:
    """Per inner tensor: ``"shared"`` (one tensor in every piece, constant along ``dim``), True if whether
    the pieces' copies agree decides its relation, else False; raises for pieces that do not concatenate."""
    out = []
    for i, name in enumerate(pieces[0].fmt.inner_names):
        rels = [p.rels[i][dim] for p in pieces]
        if shared[i] and all(isinstance(r, Constant) for r in rels):
            out.append("shared")
            continue
        rel, runs = _cat_runs(name, dim, pieces, rels)
        if not isinstance(rel, Constant):
            _cat_relation(name, dim, pieces, rels, True)  # raises where the grids neither continue nor repeat
        out.append(isinstance(rel, Constant) and len(runs) > 1)
    return tuple(out)


def _cat_layout(pieces, dim: int, checked: tuple, equal: list) -> tuple:
    """The concatenation's relations, shape and strides, given which constant inner tensors agreed."""
    first, outcomes, rels = pieces[0], iter(equal), []
    for i, (name, check) in enumerate(zip(first.fmt.inner_names, checked)):
        row = first.rels[i]
        if check == "shared":
            rels.append(row)
            continue
        same = next(outcomes) if check else True
        rels.append(_with_rel(row, dim, _cat_relation(name, dim, pieces, [p.rels[i][dim] for p in pieces], same)))
    shape = list(first.shape)
    shape[dim] = sum(p.shape[dim] for p in pieces)
    shape = torch.Size(shape)
    return tuple(rels), shape, _strides(first, shape, first.dims)


def _cat_runs(name, dim, pieces, rels):
    """The one relation of every run of one grid along ``dim``, and the runs' ``(length, relation)``."""
    runs = []
    for piece, rel in zip(pieces, rels):
        length = piece.shape[dim]
        if isinstance(rel, Stacked):
            full, rem = divmod(length, rel.n)
            runs += [(rel.n, rel.rel)] * full + ([(rem, rel.rel)] if rem else [])
        else:
            runs.append((length, rel))
    kinds = {r for _, r in runs}
    if len(kinds) != 1:
        raise LayoutError(
            f"cannot concatenate along dim {dim}: inner '{name}' is laid out as {sorted(map(str, kinds))}"
        )
    (rel,) = kinds
    return rel, runs


def _cat_relation(name, dim, pieces, rels, equal: bool):
    """The relation along ``dim`` of the concatenation of ``pieces`` (``equal``: their constant copies agree)."""
    rel, runs = _cat_runs(name, dim, pieces, rels)
    lengths = [n for n, _ in runs]
    if isinstance(rel, Constant):
        if len(runs) == 1 or equal:
            return Constant()
    elif all(n % rel.factor == 0 for n in lengths[:-1]):
        return rel
    run = lengths[0]
    if any(n != run for n in lengths[:-1]) or lengths[-1] > run:
        raise LayoutError(
            f"cannot concatenate pieces of {describe(pieces[0])} along dim {dim}: inner '{name}' is {rel} "
            f"and the pieces ({lengths[:8]}) neither continue its grid nor have equal lengths"
        )
    return Stacked(run, rel)


def pad_end(q: QuantizedTensor, dim: int, amount: int) -> QuantizedTensor:
    """Append ``amount`` zero elements to ``dim`` (what uneven shards are padded with)."""
    length = q.shape[dim]
    inner = {}
    flat = [f"'{n}' is {r[dim]}" for n, r in zip(q.fmt.inner_names, q.rels) if isinstance(r[dim], InFlat)]
    if flat:
        raise LayoutError(
            f"{describe(q)}: padding dim {dim} would move blocks that run across it ({', '.join(flat)}); "
            "this dim cannot be sharded, shard another dim"
        )
    for (name, t), rel_row in zip(q.inner.items(), q.rels):
        rel = rel_row[dim]
        if isinstance(rel, Packed) and amount % rel.p:
            raise LayoutError(f"{describe(q)}: padding dim {dim} by {amount} splits a packed element ({rel})")
        extra = rel.inner_len(length + amount) - t.shape[dim] if not isinstance(rel, Constant) else 0
        if extra > 0:
            widths = [0, 0] * (t.ndim - 1 - dim) + [0, extra]
            t = torch.nn.functional.pad(t, widths)
        inner[name] = t
    shape = list(q.shape)
    shape[dim] = length + amount
    # The inner tensors not padded are q's own: writes through the result reach q's record too.
    return rebuild(q, inner, shape, notes=rules.same_bytes(q.notes))


def select_dim(q: QuantizedTensor, dim: int, index: int) -> QuantizedTensor:
    """``q[..., index, ...]`` along a leading (expert) ``dim``: one matrix, or a smaller stack.

    Every inner tensor is one-to-one along a leading dim, so each is indexed
    the same way; the result is an ordinary quantized weight the linear
    kernels take (a 2-D one for a single expert).
    """
    k = matrix_dims(q)
    if dim >= k:
        raise UnsupportedOpError(
            f"{describe(q)}: select along dim {dim} would cut the quantized [out, in] matrix; only its "
            f"{k} leading (expert) dim(s) can be indexed"
        )
    length = q.shape[dim]
    if not -length <= index < length:
        raise IndexError(f"index {index} is out of bounds for dim {dim} of size {length} ({describe(q)})")
    index %= length
    for name, row in zip(q.fmt.inner_names, q.rels):
        if not isinstance(row[dim], OneToOne):
            raise LayoutError(f"{describe(q)}: inner '{name}' is {row[dim]} along leading dim {dim}, not one-to-one")
    inner = map_inner(q, lambda t: t.select(dim, index))
    rels = tuple(row[:dim] + row[dim + 1 :] for row in q.rels)
    shape = tuple(q.shape[:dim]) + tuple(q.shape[dim + 1 :])
    dims = (canonical_dims if q.dims == canonical_dims(q.ndim) else transposed_dims)(q.ndim - 1)
    stride = tuple(q.stride()[:dim]) + tuple(q.stride()[dim + 1 :])
    return rebuild(q, inner, shape, rels=rels, dims=dims, stride=stride, notes=rules.same_bytes(q.notes))


# -- flat views --------------------------------------------------------------


def flatten(q: QuantizedTensor) -> QuantizedTensor:
    """``view(-1)`` (FSDP2 calls it on every sharded parameter); N dims fold from the last.

    Where every inner tensor is contiguous (its ``reshape(-1)`` a view, the same whenever it is made) the
    inner views are left to their first read (``Notes.pending``), as :func:`transpose` leaves its own:
    made from the inner tensor objects ``q`` holds now, so a later change to ``q`` does not reach them.
    """

    def flat(row):
        rel, length = row[-1], q.shape[-1]
        for dim in range(q.ndim - 2, -1, -1):
            rel = can_flatten(row[dim], rel, length) if not isinstance(rel, Opaque) else None
            rel, length = rel or Opaque(), length * q.shape[dim]
        return (rel,)

    def decide():
        rels = tuple(flat(r) for r in q.rels)
        opaque = any(isinstance(row[0], Opaque) for row in rels)
        deferrable = not any(hasattr(QuantizedTensor, n) for n in q.fmt.inner_names)
        props = (torch.Size((q.numel(),)), (1,), q.props[2], q.props[3])
        return rels, (tuple(range(q.ndim)),), props, opaque, deferrable

    fmt = q.fmt
    # (memo.memo inlined; the key is layout_key's, with the device: the decision holds the result's props)
    key = ("flatten", id(q.rels), id(q.dims), id(fmt), *q.props)
    hit = decisions.TABLE.get(key) if decisions.ENABLED else None
    decision = None if hit is None else hit[0]
    if decision is None:
        decision = remember(key, decide(), q.rels, q.dims, fmt)
    rels, dims, props, opaque, deferrable = decision
    if opaque:
        # An Opaque equals only itself: a fresh one per result, so two results never look like one grid.
        rels = tuple((Opaque(),) if isinstance(row[0], Opaque) else row for row in rels)
    inner, contiguous = [], deferrable
    for name in fmt.inner_names:  # a loop, not a comprehension: one call less, on every view(-1)
        t = getattr(q, name)
        inner.append(t)
        contiguous = contiguous and t.is_contiguous()  # else its reshape copies: made now, from these bytes
    if contiguous and type(inner[0]) is torch.Tensor and not inner[0].is_meta:
        pending = (_make_flat, inner)
        if not opaque and decisions.ENABLED and q.dims == canonical_dims(len(q.props[0])):  # views.py's case
            # q.view(-1) from now on (views.py): this decision and q's own inner tensors, read off q itself (the
            # inner tensors are set once, and replaced only by ``.data =``, which drops the recipe).
            q.__dict__[FLAT_RECIPE] = (fmt, rels, dims, props, pending)
        return QuantizedTensor.make_view(fmt, rels, dims, props, rules.same_bytes(q.notes, pending))
    inner = [t.reshape(-1) for t in inner]
    return QuantizedTensor.make_view(fmt, rels, dims, props, rules.same_bytes(q.notes), inner)


def _make_flat(out: QuantizedTensor, inner: list[torch.Tensor]) -> None:
    """Set ``out``'s deferred inner tensors: ``inner`` (contiguous) viewed flat, below autograd and any mode."""
    with torch._C._AutoDispatchBelowADInplaceOrView(), _python_dispatch._disable_current_modes():
        for name, t in zip(out.fmt.inner_names, inner):
            setattr(out, name, t.reshape(-1))


def unflatten(q: QuantizedTensor, size: tuple[int, ...]) -> QuantizedTensor:
    """A flat view (``view(-1)`` of a canonical weight) viewed back as a weight of ``size``, with its layout."""
    rows = tuple(weight_layout(q.fmt, size).values())
    inner = {}
    for (name, t), rel_row in zip(q.inner.items(), rows):
        shape = tuple(r.inner_len(n) for r, n in zip(rel_row, size))
        if t.numel() != torch.Size(shape).numel():
            raise UnsupportedOpError(f"{describe(q)}: cannot view as {size}: inner '{name}' does not match")
        inner[name] = t.reshape(shape)
    dims, stride = canonical_dims(len(size)), contiguous_strides(size)
    return rebuild(q, inner, size, rels=rows, dims=dims, stride=stride, notes=rules.same_bytes(q.notes))


# -- a weight broadcast over a batch (torch.matmul of a batched activation) ---


def broadcast_batch(q: QuantizedTensor, batch: tuple[int, ...]) -> QuantizedTensor:
    """``q`` viewed as ``batch`` identical matrices: size-1 inner dims, ``Constant`` along the batch dims."""
    k = len(batch)
    inner = {n: t.reshape((1,) * k + tuple(t.shape)) for n, t in q.inner.items()}
    rels = tuple((Constant(),) * k + row for row in q.rels)
    dims = ((),) * k + q.dims
    shape, stride = batch + tuple(q.shape), (0,) * k + q.stride()
    return QuantizedTensor(inner, q.fmt, rels, dims, shape, q.dtype, stride, notes=rules.broadcast(q.notes))


def is_broadcast_batch(q: QuantizedTensor) -> bool:
    """Whether ``q`` is a 2-D weight broadcast over leading batch dims (what ``expand`` makes)."""
    k = q.ndim - 2
    return k > 0 and all(d == () for d in q.dims[:k])


def unbroadcast(q: QuantizedTensor) -> QuantizedTensor:
    """The single 2-D weight every batch entry of a broadcast ``q`` holds."""
    k = q.ndim - 2
    inner = {n: t.reshape(tuple(t.shape[k:])) for n, t in q.inner.items()}
    rels = tuple(row[k:] for row in q.rels)
    shape, stride = tuple(q.shape[k:]), tuple(q.stride()[k:])
    return QuantizedTensor(inner, q.fmt, rels, q.dims[k:], shape, q.dtype, stride, notes=rules.broadcast(q.notes))


def rebatch(q: QuantizedTensor, size: tuple[int, ...]) -> QuantizedTensor | None:
    """``view``/``reshape`` of a broadcast weight that only regroups its batch dims, else None."""
    if not is_broadcast_batch(q) or len(size) < 3 or tuple(size[-2:]) != tuple(q.shape[-2:]):
        return None
    return broadcast_batch(unbroadcast(q), tuple(size[:-2]))


# -- new tensors -------------------------------------------------------------


def factory(q: QuantizedTensor, size, fill, dtype=None, device=None):
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
        return flatten(factory(q, (0, *q.shape[1:]), fill, dtype, device))
    if len(size) != q.ndim:
        raise UnsupportedOpError(f"{describe(q)}: cannot create a quantized tensor of shape {size}")
    inner = {}
    for (name, t), rel_row in zip(q.inner.items(), q.rels):
        try:
            shape = tuple(r.inner_len(n) for r, n in zip(rel_row, size))
        except LayoutError as e:
            raise LayoutError(f"{describe(q)}: cannot create shape {size}: inner '{name}': {e}") from None
        if any(isinstance(r, InFlat) and n != n0 for r, n, n0 in zip(rel_row, size, q.shape)):
            raise LayoutError(f"{describe(q)}: cannot create shape {size}: inner '{name}' has flat blocks across rows")
        shared = any(isinstance(r, Constant) for r in rel_row) and all(
            isinstance(r, Constant) or n == n0 for r, n, n0 in zip(rel_row, size, q.shape)
        )
        if shared and not t.is_meta:  # a meta weight (built on "meta", then to_empty) has nothing to copy
            inner[name] = t.clone().to(device or t.device)
        else:
            inner[name] = fill(shape, dtype=t.dtype, device=device or t.device)
    notes = rules.factory(list(inner.values()))
    return rebuild(q, inner, size, dtype=dtype, stride=contiguous_strides(size), notes=notes)


# -- what a format's math receives -------------------------------------------


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


def broadcastable_for(inner: dict[str, torch.Tensor], rels, shape) -> dict[str, torch.Tensor]:
    """What a format's ``dequantize`` receives: see :func:`broadcastable`."""
    return broadcastable(inner, block_sizes(rels), shape)


def canonical_inner(q: QuantizedTensor) -> dict[str, torch.Tensor] | None:
    """Inner tensors in the format's ``[..., out, in]`` orientation, or None if ``q`` is not a plain weight view."""
    if any(isinstance(r, Stacked) for row in q.rels for r in row):
        return None
    if q.ndim >= 2 and q.dims == canonical_dims(q.ndim):
        return q.inner
    if is_transposed(q):
        return map_inner(q, lambda t: t.transpose(-2, -1))
    return None
