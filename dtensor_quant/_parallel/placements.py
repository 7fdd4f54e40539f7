"""Which DTensor placements a quantized layout can take, decided before any data exists.

The check simulates where DTensor's own placements cut each logical dim (so
uneven shards and ``_StridedShard`` are handled exactly as DTensor does) and
verifies every cut lands on a multiple of the dim's alignment: the least
common multiple of the pack factors and block sizes of the inner tensors
along it. It needs only shapes, so every rank reaches the same verdict
without communicating -- an error raised on some ranks only would hang the
others in their next collective.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .._core.format import QuantFormat, check_shape, weight_layout
from .._core.layout import MAX_LISTED_MESH_SIZE, LayoutError, chunk_boundaries, dim_factor, partial_refused


def shard_like(p: Placement) -> bool:
    """Whether ``p`` cuts its dim into pieces (``Shard``, or FSDP2+TP's ``_StridedShard``)."""
    return isinstance(p, (Shard, _StridedShard))


def dim_alignment(fmt: QuantFormat, shape: Sequence[int], dim: int) -> int:
    """The multiple every shard boundary along logical ``dim`` of a ``shape`` weight must fall on."""
    return _dim_alignment(fmt, tuple(shape), dim)


@functools.lru_cache(maxsize=65536)
def _dim_alignment(fmt: QuantFormat, shape: tuple, dim: int) -> int:
    return dim_factor([rels[dim] for rels in weight_layout(fmt, shape).values()])


def shard_pieces(length: int, cuts: Sequence[tuple[Placement, int]]) -> list[list[tuple[int, int]]]:
    """The logical ranges ``[(start, stop), ...]`` each shard holds after applying ``cuts`` in mesh order.

    ``cuts`` is ``((placement, mesh dim size), ...)`` for the placements that
    cut this dim, outermost mesh dim first. Used by :func:`bad_cut` where the
    shards are not contiguous, and by tests that check it against torch's own
    splitting.

    Pure arithmetic with DTensor's semantics: ``Shard`` is ``torch.chunk`` of
    the index sequence a shard already holds; ``_StridedShard(split_factor=s)``
    chunks it into ``s`` pieces, chunks each of those again, and gives shard
    ``i`` the ``i``-th sub-piece of every piece (see torch's
    ``_StridedShard._split_tensor``).
    """
    pieces = [[(0, length)]]
    for placement, ways in cuts:
        out = []
        for piece in pieces:
            total = sum(e - s for s, e in piece)
            if isinstance(placement, _StridedShard):
                firsts = chunk_boundaries(total, placement.split_factor)
                seconds = [(fa, chunk_boundaries(fb - fa, ways)) for fa, fb in firsts]
                for i in range(ways):
                    out.append([r for fa, cuts in seconds for r in _sub(piece, fa + cuts[i][0], fa + cuts[i][1])])
            else:
                out += [_sub(piece, a, b) for a, b in chunk_boundaries(total, ways)]
        pieces = out
    return pieces


def _sub(piece: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """Positions ``[a, b)`` of the index sequence ``piece`` (a list of ranges), as ranges."""
    out, pos = [], 0
    for s, e in piece:
        lo, hi = max(a, pos), min(b, pos + e - s)
        if lo < hi:
            out.append((s + lo - pos, s + hi - pos))
        pos += e - s
    return out


def _nested(length: int, cuts) -> tuple[int, ...] | None:
    """The piece counts of nested ``torch.chunk`` cuts equal to ``cuts`` (outermost first), else None.

    Nested ``Shard``s are chunks of chunks; FSDP2's ``_StridedShard(split_factor=tp)``
    on the dp dim followed by ``Shard`` on a tp dim of size tp is, by design, the
    dp chunk of each tp chunk when the tp chunks are equal. Anything else goes
    through :func:`_strided_bad_cut` or :func:`shard_pieces`.
    """
    if all(type(p) is Shard for p, _ in cuts):
        return tuple(ways for _, ways in cuts)
    if len(cuts) == 2 and isinstance(cuts[0][0], _StridedShard) and type(cuts[1][0]) is Shard:
        (strided, dp), (_, tp) = cuts
        if strided.split_factor == tp and length % tp == 0:  # equal tp chunks: torch splits each the same way
            return tp, dp
    return None


def _nested_bad_cut(offset: int, length: int, ways: tuple[int, ...], factor: int) -> int | None:
    """The first start not on a multiple of ``factor`` among nested chunks of ``[offset, offset + length)``.

    ``offset`` is aligned (a misaligned one was found first, by the caller).
    Without listing the pieces: the first piece is cut like every other full
    one, so once the second piece starts aligned only the first and the last
    (shorter) piece need a look -- two branches a level, not ``ways`` of them.
    """
    if not ways or length == 0:
        return None
    size = -(-length // ways[0])
    bad = _nested_bad_cut(offset, size, ways[1:], factor)  # inside the first piece
    if bad is not None or size >= length:
        return bad
    if size % factor:  # the second piece's start
        return offset + size
    full, rest = divmod(length, size)  # full pieces start aligned and are cut like the first
    return _nested_bad_cut(offset + full * size, rest, ways[1:], factor) if rest else None


@functools.lru_cache(maxsize=65536)
def bad_cut(length: int, cuts: tuple, factor: int) -> int | None:
    """The first shard boundary (the start of a run of consecutive indices) not on a multiple of ``factor``.

    One dim's half of :func:`first_bad_cut`: ``cuts`` as in :func:`shard_pieces`
    (a tuple, for the cache), ``factor`` the dim's alignment. None if every
    boundary is aligned. Pure arithmetic, no tensors.
    """
    ways = _nested(length, cuts)
    if ways is not None:
        return _nested_bad_cut(0, length, ways, factor)
    if isinstance(cuts[0][0], _StridedShard) and cuts[0][1] > 1:
        # The second dp shard starts at the end of the first's piece of the first split-factor chunk.
        first = -(-length // cuts[0][0].split_factor)
        end = -(-first // cuts[0][1])
        if end < first and end % factor:
            return end
    if len(cuts) == 2 and isinstance(cuts[0][0], _StridedShard) and type(cuts[1][0]) is Shard:
        return _strided_bad_cut(length, cuts[0][0].split_factor, cuts[0][1], cuts[1][1], factor)
    for piece in shard_pieces(length, cuts):
        prev = None
        for s, e in piece:
            if s != prev and s % factor:
                return s
            prev = e
    return None


def _strided_bad_cut(length: int, split: int, dp: int, tp: int, factor: int) -> int | None:
    """:func:`bad_cut` for FSDP2 + TP's ``(_StridedShard(split_factor=split), dp), (Shard, tp)`` on one dim.

    The uneven case (``length`` not a multiple of ``tp``) that is no nesting
    of chunks (:func:`_nested`), without listing every shard's
    ranges: dp shard ``i`` holds piece ``i`` of each of the ``split`` chunks
    (at most ``split`` ranges); its tp chunks start at positions of that
    concatenation, each mapped back to a global index by a prefix sum. A run
    starts at each tp chunk's first index and wherever a range does not
    continue the one before it. ``O(dp * (split + tp))`` instead of the
    ``O(dp * tp * split)`` lists of :func:`shard_pieces` (a 70B model's
    planner meets this for every uneven tp at dp up to 512).
    """
    firsts = _chunks(length, split)
    for i in range(dp):
        ranges = []
        for fa, fb in firsts:
            a, b = _chunks(fb - fa, dp)[i]
            if a < b:
                ranges.append((fa + a, fa + b))
        starts, total = [], 0
        for s, e in ranges:
            starts.append(total)
            total += e - s
        candidates = [(starts[r], s) for r, (s, _) in enumerate(ranges) if r == 0 or s != ranges[r - 1][1]]
        for a, b in _chunks(total, tp):
            if a < b:
                r = bisect.bisect_right(starts, a) - 1
                candidates.append((a, ranges[r][0] + a - starts[r]))
        bad = [g for _, g in sorted(candidates) if g % factor]
        if bad:
            return bad[0]
    return None


@functools.lru_cache(maxsize=65536)
def _chunks(length: int, pieces: int) -> tuple[tuple[int, int], ...]:
    return tuple(chunk_boundaries(length, pieces))


def check_placements(
    shape: Sequence[int],
    fmt: QuantFormat,
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
) -> None:
    """Raise :class:`LayoutError` unless ``fmt`` can hold a weight of ``shape`` under ``placements``.

    Needs no data and no process group::

        check_placements((4096, 4096), Int4Groupwise(128), (3,), [Shard(1)])
        # LayoutError: ... dim 1 (size 4096) ... legal sizes: 1, 2, 4, 8, 16, 32
    """
    shape, mesh_shape = tuple(shape), tuple(mesh_shape)
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{len(placements)} placements for a {len(mesh_shape)}-D mesh {mesh_shape}")
    check_shape(fmt, shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            raise partial_refused(f"a {fmt} weight", p, f" on mesh dim {mesh_dim}")
        if not (shard_like(p) or isinstance(p, Replicate)):
            raise LayoutError(f"{fmt}: unsupported placement {p}")
    problem = first_bad_cut(shape, fmt, mesh_shape, placements)
    if problem is not None:
        raise LayoutError(_explain(fmt, shape, mesh_shape, placements, *problem))


def first_bad_cut(shape, fmt, mesh_shape, placements) -> tuple[int, int, int] | None:
    """``(dim, index, alignment)`` of the first misaligned shard boundary, or None."""
    return _first_bad_cut_cached(tuple(shape), fmt, tuple(mesh_shape), tuple(placements))


@functools.lru_cache(maxsize=65536)
def _first_bad_cut_cached(shape, fmt, mesh_shape, placements) -> tuple[int, int, int] | None:
    for dim, length in enumerate(shape):
        cuts = tuple(
            (p, mesh_shape[m]) for m, p in enumerate(placements) if shard_like(p) and p.dim % len(shape) == dim
        )
        factor = dim_alignment(fmt, shape, dim)
        if not cuts or factor == 1:
            continue
        bad = bad_cut(length, cuts, factor)
        if bad is not None:
            return dim, bad, factor
    return None


def legal_mesh_sizes(
    shape: Sequence[int],
    fmt: QuantFormat,
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_dim: int,
    limit: int = MAX_LISTED_MESH_SIZE,
) -> list[int]:
    """Sizes of ``mesh_dim`` (up to ``limit``) under which ``placements`` are legal, the rest fixed."""
    legal = []
    for size in range(1, limit + 1):
        trial = list(mesh_shape)
        trial[mesh_dim] = size
        if first_bad_cut(tuple(shape), fmt, trial, placements) is None:
            legal.append(size)
    return legal


def _explain(fmt, shape, mesh_shape, placements, dim, bad, factor) -> str:
    why = ", ".join(f"'{n}' is {rels[dim]}" for n, rels in weight_layout(fmt, shape).items() if rels[dim].factor > 1)
    mesh_dims = [m for m, p in enumerate(placements) if shard_like(p) and p.dim % len(shape) == dim]
    hints = []
    for m in mesh_dims:
        sizes = legal_mesh_sizes(shape, fmt, mesh_shape, placements, m)
        hints.append(
            f"mesh dim {m} (now {mesh_shape[m]}) would be legal with size " + (", ".join(map(str, sizes)) or "none")
        )
    return (
        f"{fmt}: placements {list(placements)} on mesh {tuple(mesh_shape)} cut dim {dim} "
        f"(size {shape[dim]}) of a {tuple(shape)} weight at index {bad}, which is not a multiple of "
        f"{factor} ({why}). " + "; ".join(hints) + "."
    )


def check_redistribute(q, shape: Sequence[int], mesh_shape: Sequence[int], src, dst) -> bool:
    """Raise :class:`LayoutError` unless quantized local ``q`` of a ``shape`` DTensor can move ``src -> dst``.

    The one check every redistribute of a quantized DTensor makes before its first collective
    (``full_tensor``, ``redistribute`` between any placements, torch's steps and the library's shortcuts
    alike: :mod:`dtensor_quant._parallel.redistribute_check` calls it where they all start). From shapes
    alone, so every rank raises the same error, and without it a cut the target cannot hold raised only
    after the gathers had run, naming a padded intermediate. ``dst`` is held to
    :func:`check_placements` (the error names the legal mesh sizes); where ``src`` is not held to it
    (a layout the rule does not describe: a view that is no weight's orientation, a ``from_local`` of
    other pieces) nothing is decided here and the ops below check their own cuts.

    Returns whether a ``Shard(i) -> Shard(j)`` step would cut the padding DTensor adds to dim ``j``
    inside a partial block (:func:`padded_cut_splits_block`): legal, but only through ``Replicate``.
    """
    if not any(type(p) in SHARDS for p in dst):  # not isinstance: through the placements' metaclass, ~10 us
        return False  # a gather (full_tensor, -> Replicate): any pieces join; checked without a cache lookup
    problem = _redistribute_problem(q.fmt, q.dims, tuple(shape), tuple(mesh_shape), tuple(src), tuple(dst))
    if isinstance(problem, str):
        raise LayoutError(problem)
    return problem


#: The placements that cut a dim (by exact type: ``isinstance`` goes through the placements' metaclass).
SHARDS = (Shard, _StridedShard)


@functools.lru_cache(maxsize=65536)
def _redistribute_problem(fmt, dims, shape, mesh_shape, src, dst) -> str | bool:
    """:func:`check_redistribute`'s verdict, once per (layout, move): the error's message, or whether the
    move must go through ``Replicate``."""
    if any(isinstance(p, Partial) for p in src + dst) or any(len(d) != 1 for d in dims):
        return False  # Partial: refused where it is reduced (or by torch); a flattened view: its ops check
    to_storage = [d[0] for d in dims]  # logical dim -> the format's dim (a transposed weight's are swapped)
    storage_shape = [0] * len(shape)
    for logical, stored in enumerate(to_storage):
        storage_shape[stored] = shape[logical]
    src_s, dst_s = _in_storage(src, to_storage), _in_storage(dst, to_storage)
    try:
        check_placements(storage_shape, fmt, mesh_shape, src_s)
    except (LayoutError, ValueError):
        return False  # not a layout the rule describes (see the docstring)
    try:
        check_placements(storage_shape, fmt, mesh_shape, dst_s)
    except LayoutError as e:
        what = f"redistribute {list(src)} -> {list(dst)}"
        if dims != tuple((i,) for i in range(len(dims))):
            what += f" of a transposed view (the weight's placements {src_s} -> {dst_s})"
        return f"{what}: {e}"
    return padded_cut_splits_block(storage_shape, fmt, mesh_shape, src_s, dst_s)


def _in_storage(placements: tuple, to_storage: list[int]) -> tuple:
    out = []
    for p in placements:
        if isinstance(p, _StridedShard):
            p = _StridedShard(to_storage[p.dim % len(to_storage)], split_factor=p.split_factor)
        elif isinstance(p, Shard):
            p = Shard(to_storage[p.dim % len(to_storage)])
        out.append(p)
    return tuple(out)


def padded_cut_splits_block(shape, fmt, mesh_shape, src, dst) -> bool:
    """Whether a ``Shard(i) -> Shard(j)`` step of ``src -> dst`` cuts DTensor's padding of dim ``j`` in a block.

    torch pads dim ``j`` to ``n * ceil(length / n)`` before its all-to-all and cuts every ``ceil(length / n)``:
    when that chunk is no multiple of dim ``j``'s alignment the cut lands inside a (partial) block. A legal
    ``dst`` cuts that way between two non-empty chunks only where the dim holds one element, so only a
    dim of length 1 under a layout blocked along it meets this.
    """
    for m, (a, b) in enumerate(zip(src, dst)):
        if type(a) is not Shard or type(b) is not Shard or a.dim % len(shape) == b.dim % len(shape):
            continue
        j = b.dim % len(shape)
        factor = dim_alignment(fmt, shape, j)
        outer = tuple((p, mesh_shape[k]) for k, p in enumerate(dst[:m]) if shard_like(p) and p.dim % len(shape) == j)
        lengths = [sum(e - s for s, e in piece) for piece in shard_pieces(shape[j], outer)] if outer else [shape[j]]
        if factor > 1 and any((-(-n // mesh_shape[m])) % factor for n in lengths):
            return True
    return False
