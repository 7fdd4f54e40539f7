"""core/layout: each relation against its definition, element by element.

A relation says which inner element holds each logical index of a dim. The
reference here is that definition written out as a table -- the inner index of
every logical element, computed by hand for small shapes -- and every
function of the module (lengths, slices and their legality, views that share
elements with their outside, grids, flattening, chunk boundaries) is
compared with what the table says.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtensor_quant._core.layout import (
    Blocked,
    Constant,
    FlatBlocked,
    InFlat,
    LayoutError,
    OneToOne,
    Packed,
    Stacked,
    can_flatten,
    chunk_boundaries,
    dim_factor,
    flat_blocked,
    inner_index,
    inner_slice,
    legal_chunk,
    legal_chunk_counts,
    partial_refused,
    same_grid,
    shares_outside,
)


def table(rel, length: int) -> list[int]:
    """The inner index of each logical index ``0 .. length-1`` along a dim laid out by ``rel``, by definition."""
    if isinstance(rel, OneToOne):
        return list(range(length))
    if isinstance(rel, (Packed, Blocked)):
        step = rel.p if isinstance(rel, Packed) else rel.b
        return [i // step for i in range(length)]
    if isinstance(rel, Constant):
        return [0] * length
    if isinstance(rel, Stacked):  # runs of rel.n, each on its own grid, one after the other
        out, base = [], 0
        for start in range(0, length, rel.n):
            run = table(rel.rel, min(rel.n, length - start))
            out += [base + i for i in run]
            base += max(run) + 1 if run else 0
        return out
    raise AssertionError(rel)


# relations of one dim (FlatBlocked/InFlat span two dims: tested on 2-D tables below)
DIM_RELATIONS = st.one_of(
    st.just(OneToOne()),
    st.just(Constant()),
    st.builds(Packed, st.integers(1, 4)),
    st.builds(Blocked, st.integers(1, 6)),
    st.builds(Stacked, st.integers(1, 5), st.sampled_from([Constant(), Blocked(2), Blocked(3), OneToOne()])),
)


def fits(rel, length: int) -> bool:
    """Packed needs whole packs; so does each run of a Stacked."""
    if isinstance(rel, Packed):
        return length % rel.p == 0
    if isinstance(rel, Stacked) and isinstance(rel.rel, Packed):
        return length % rel.rel.p == 0 and rel.n % rel.rel.p == 0
    return True


@settings(max_examples=300, deadline=None)
@given(rel=DIM_RELATIONS, length=st.integers(1, 30))
def test_inner_len_and_inner_index_follow_the_definition(rel, length):
    if not fits(rel, length):
        return
    t = table(rel, length)
    assert rel.inner_len(length) == max(t) + 1
    assert inner_index(rel, torch.arange(length)).tolist() == t
    assert [inner_index(rel, i) for i in range(length)] == t


def test_packed_refuses_a_partial_pack():
    with pytest.raises(LayoutError, match="cannot be packed 2 per element"):
        Packed(2).inner_len(7)
    with pytest.raises(LayoutError, match="cannot be packed 4 per element"):
        FlatBlocked(4, 3, packed=True).inner_len(5)  # 15 flat elements


PLAIN_RELATIONS = st.one_of(
    st.just(OneToOne()),
    st.just(Constant()),
    st.builds(Packed, st.integers(1, 4)),
    st.builds(Blocked, st.integers(1, 6)),
)


@settings(max_examples=500, deadline=None)
@given(rel=PLAIN_RELATIONS, length=st.integers(1, 30), a=st.integers(0, 30), b=st.integers(0, 30))
def test_inner_slice_is_the_range_the_table_holds_and_refuses_exactly_the_cut_elements(rel, length, a, b):
    """A slice is legal unless its start (or, packed, its end) cuts an inner element in two; a blocked range may end
    inside a block, which keeps its scale; a constant element is shared by every slice."""
    if not fits(rel, length):
        return
    start, stop = sorted((min(a, length), min(b, length)))
    if start == stop:
        return  # empty ranges: placed at the nearest inner index, never refused
    t = table(rel, length)
    cuts_start = 0 < start and t[start - 1] == t[start]
    cuts_end = stop < length and t[stop - 1] == t[stop]
    if not isinstance(rel, Constant) and (cuts_start or (cuts_end and isinstance(rel, Packed))):
        with pytest.raises(LayoutError):
            inner_slice(rel, start, stop, length)
        return
    i0, i1, sub = inner_slice(rel, start, stop, length)
    held = t[start:stop]
    assert (i0, i1) == (min(held), max(held) + 1), (rel, start, stop, t)
    assert sub == rel and [i0 + i for i in table(sub, stop - start)] == held


@pytest.mark.parametrize("sub", [Constant(), Blocked(2), OneToOne()], ids=str)
@pytest.mark.parametrize("start,stop", [(0, 12), (4, 8), (5, 7), (8, 10), (4, 10), (5, 9), (0, 3)])
def test_inner_slice_of_stacked_runs(sub, start, stop):
    """Runs of 4, each on its own grid: a range inside one run takes that run's relation; a range across runs must
    start at a run's start (it keeps the runs), and ends where the last run's relation lets it."""
    rel, length = Stacked(4, sub), 12
    t = table(rel, length)
    run = start // 4
    if stop <= (run + 1) * 4:  # inside one run
        local = table(sub, 4)[start - 4 * run : stop - 4 * run]
        cut = start % 4 and local and table(sub, 4)[start % 4 - 1] == local[0] and not isinstance(sub, Constant)
        if cut:
            with pytest.raises(LayoutError):
                inner_slice(rel, start, stop, length)
            return
        i0, i1, got = inner_slice(rel, start, stop, length)
        assert got == sub and (i0, i1) == (min(t[start:stop]), max(t[start:stop]) + 1)
        return
    if start % 4:
        with pytest.raises(LayoutError, match="inside a run"):
            inner_slice(rel, start, stop, length)
        return
    i0, i1, got = inner_slice(rel, start, stop, length)
    assert got == rel and (i0, i1) == (min(t[start:stop]), max(t[start:stop]) + 1)


def test_constant_and_inflat_slices():
    assert inner_slice(Constant(), 3, 7, 10) == (0, 1, Constant())
    assert inner_slice(InFlat(8), 0, 8, 8) == (0, 1, InFlat(8))
    with pytest.raises(LayoutError, match="cuts blocks that run across this dim"):
        inner_slice(InFlat(8), 0, 4, 8)


def flat_table(rels, shape) -> list[list[int]]:
    """Inner element of each ``[r, c]`` of a 2-D weight: a 2-D inner tensor indexed row-major, or the flat blocks."""
    (r0, r1), (rows, cols) = rels, shape
    if isinstance(r0, FlatBlocked):
        return [[(r * cols + c) // r0.b for c in range(cols)] for r in range(rows)]
    t0, t1 = table(r0, rows), table(r1, cols)
    width = r1.inner_len(cols)
    return [[t0[r] * width + t1[c] for c in range(cols)] for r in range(rows)]


def partition(t: list[list[int]]) -> set[frozenset]:
    """Which logical elements share an inner element (the grouping, whatever the numbering)."""
    groups: dict[int, set] = {}
    for r, row in enumerate(t):
        for c, i in enumerate(row):
            groups.setdefault(i, set()).add((r, c))
    return {frozenset(g) for g in groups.values()}


@settings(max_examples=300, deadline=None)
@given(b=st.integers(1, 40), rows=st.integers(1, 8), cols=st.integers(1, 40))
def test_flat_blocked_relations_group_the_flat_blocks(b, rows, cols):
    """Whatever flat_blocked picks (per-dim relations where they can say it), each inner element holds exactly one
    block of ``b`` consecutive elements of the row-major flat index."""
    rels = flat_blocked(b, (rows, cols))
    want = partition([[(r * cols + c) // b for c in range(cols)] for r in range(rows)])
    assert partition(flat_table(rels, (rows, cols))) == want, rels
    if cols % b == 0:
        assert rels == (OneToOne(), Blocked(b))  # a block inside one row: column cuts stay legal
    elif b % cols == 0:
        assert rels == (Blocked(b // cols), Constant())  # a block of whole rows
    else:
        assert rels == (FlatBlocked(b, cols), InFlat(cols))
        # a row cut is legal iff the elements before it are a multiple of b
        legal = [i for i in range(1, rows) if (i * cols) % b == 0]
        assert [i for i in range(1, rows) if i % rels[0].factor == 0] == legal


@pytest.mark.parametrize("b,row", [(64, 96), (16384, 14336), (256, 5632), (4, 6)])
def test_flat_blocked_slices_by_the_flat_index(b, row):
    rel, rows = FlatBlocked(b, row), 3 * b // math.gcd(b, row)
    f = rel.factor
    assert f == b // math.gcd(b, row) and rel.inner_len(rows) == -(-rows * row // b)
    assert inner_slice(rel, f, 2 * f, rows) == (f * row // b, 2 * f * row // b, rel)
    if f > 1:
        with pytest.raises(LayoutError, match="not a multiple of"):
            inner_slice(rel, 1, f, rows)
    assert inner_slice(rel, 0, 1, rows)[:2] == (0, -(-row // b))  # one row ends inside a block: it keeps it


@settings(max_examples=400, deadline=None)
@given(rel=DIM_RELATIONS, end=st.integers(1, 24), a=st.integers(0, 24), b=st.integers(0, 24))
def test_shares_outside_says_whether_the_views_inner_elements_hold_outside_elements(rel, end, a, b):
    """For the legal slices of a dim: whether an element outside ``[start, stop)`` maps into the view's inner range."""
    if not fits(rel, end):
        return
    start, stop = sorted((min(a, end), min(b, end)))
    try:
        inner_slice(rel, start, stop, end)
    except LayoutError:
        return  # refused before any write could ask
    t = table(rel, end)
    inside = set(t[start:stop])
    outside = [t[i] for i in range(end) if not start <= i < stop]
    expected = bool(inside & set(outside))
    if isinstance(rel, Constant):  # documented: it covers every element, so any view shares it (whole dim included)
        expected = True
    elif start == stop:
        expected = False
    assert shares_outside(rel, start, stop, end) == expected, (rel, start, stop, end, t)


@settings(max_examples=300, deadline=None)
@given(a=DIM_RELATIONS, b=DIM_RELATIONS, length=st.integers(1, 24))
def test_same_grid_is_equal_tables(a, b, length):
    if not (fits(a, length) and fits(b, length)):
        return
    assert same_grid(a, b, length) == (table(a, length) == table(b, length))


def test_same_grid_examples():
    assert same_grid(Blocked(4), Stacked(4, Constant()), 12)  # one value per run of 4 is one block of 4
    assert not same_grid(Blocked(4), Stacked(3, Constant()), 12)
    assert same_grid(Stacked(8, Blocked(4)), Blocked(4), 16)  # runs that continue the grid
    assert not same_grid(Stacked(6, Blocked(4)), Blocked(4), 12)  # a run ends in a partial block


ROW_RELATIONS = [OneToOne(), Constant(), Blocked(2), Blocked(3)]
COL_RELATIONS = [OneToOne(), Constant(), Packed(2), Blocked(2), Blocked(4)]


@pytest.mark.parametrize("outer", ROW_RELATIONS, ids=str)
@pytest.mark.parametrize("inner", COL_RELATIONS, ids=str)
@pytest.mark.parametrize("shape", [(4, 8), (6, 12), (3, 4)])
def test_can_flatten_gives_the_relation_of_the_row_major_flat_inner_tensor(outer, inner, shape):
    """Flattening a 2-D inner tensor row-major: a relation returned maps the flat logical index to the flat inner
    index. None is returned where no relation does (the flat inner tensor does not follow the flat index), and --
    conservatively, never wrongly -- where a column relation holds one element per row without being Constant."""
    rows, cols = shape
    t = flat_table((outer, inner), shape)
    flat = [t[r][c] for r in range(rows) for c in range(cols)]
    rel = can_flatten(outer, inner, cols)
    if rel is not None:
        assert table(rel, rows * cols) == flat, (outer, inner, rel)
        return
    per_row = isinstance(inner, Constant) or (inner.inner_len(cols) > 1 and cols % inner.factor == 0)
    if per_row:  # the layouts formats declare: then None means that no relation exists
        candidates = [OneToOne(), Constant(), *(Blocked(k) for k in range(1, rows * cols + 1))]
        assert not any(table(r, rows * cols) == flat for r in candidates), (outer, inner, flat)


def test_can_flatten_refuses_a_per_column_scale():
    assert can_flatten(Constant(), OneToOne(), 16) is None  # what _ColumnInt8's scale is (tests/ops)
    assert can_flatten(FlatBlocked(64, 96), InFlat(96), 96) == Blocked(64)
    assert can_flatten(FlatBlocked(64, 96, packed=True), InFlat(96), 96) == Packed(64)


@pytest.mark.parametrize("length", [0, 1, 5, 10, 16, 29568])
@pytest.mark.parametrize("pieces", [1, 2, 3, 4, 7, 8])
def test_chunk_boundaries_are_torch_chunks(length, pieces):
    chunks = torch.chunk(torch.arange(length), pieces) if length else ()
    ranges, start = [], 0
    for c in chunks:
        ranges.append((start, start + c.numel()))
        start += c.numel()
    ranges += [(length, length)] * (pieces - len(ranges))  # torch.chunk leaves trailing ranks empty
    assert chunk_boundaries(length, pieces) == ranges
    for factor in (1, 2, 4, 128):
        legal = all(s % factor == 0 for s, e in ranges if s < e)
        assert legal_chunk(length, pieces, factor) == legal


def test_legal_chunk_counts_and_dim_factor():
    def by_torch(length, factor):  # the shard counts whose torch.chunk starts every piece on a multiple of factor
        counts = []
        for n in range(1, 65):
            starts = torch.tensor([0] + [c.numel() for c in torch.chunk(torch.arange(length), n)]).cumsum(0)[:-1]
            counts += [n] if bool((starts % factor == 0).all()) else []
        return counts

    for length, factor in [(29568, 128), (29696, 128), (4096, 128), (14336, 8), (10, 4)]:
        assert legal_chunk_counts(length, factor) == by_torch(length, factor), (length, factor)
    assert legal_chunk_counts(29568, 128)[:4] == [1, 3, 7, 11]  # 231 groups of 128: TP 2, 4 and 8 cut one
    assert dim_factor([OneToOne(), Packed(2), Blocked(32), Constant()]) == 32
    assert dim_factor([Blocked(6), Blocked(4)]) == 12
    assert dim_factor([]) == 1


def test_partial_refused_is_one_layout_error():
    e = partial_refused("a quantized weight", "Partial(sum)", " on mesh dim 1")
    assert isinstance(e, LayoutError) and isinstance(e, ValueError)
    assert str(e).startswith("dtensor_quant: a quantized weight cannot be Partial(sum) on mesh dim 1:")
    assert "Reduce the dense tensor first" in str(e)
