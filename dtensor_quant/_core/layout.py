"""How each inner tensor of a quantized weight follows the weight's logical dims.

A format declares, for every inner tensor (``qdata``, ``scale``, ...), one
relation per logical dim. Everything else in the library -- slicing,
concatenation, padding, the collectives, FSDP2's all-gather, checkpoint
entries and the placement planner -- is derived from these relations, so a
format never writes an op table.

=============  =====================================  ========================
relation       inner index for logical index ``i``    legal shard boundary
=============  =====================================  ========================
``OneToOne``   ``i``                                  anywhere
``Packed(p)``  ``i // p`` (``p`` values per element)  multiple of ``p``
``Blocked(b)`` ``i // b`` (last block may be partial) multiple of ``b``
``Constant``   ``0`` (inner has size 1 on this dim)   anywhere, inner is copied
=============  =====================================  ========================

Blocks over the *flattened* weight (NF4's per-64 scales and per-256-scale
factors, or any format ported from a library that blocks the flat tensor)
need one relation over several dims: ``FlatBlocked(b, row)`` on the first
dim it spans and ``InFlat(n)`` on each later one. Inner element ``k`` holds
flat (row-major) elements ``[k*b, (k+1)*b)``; the inner tensor has shape
``[ceil(rows*row/b), 1, ...]``. A cut at index ``i`` of the first dim is legal
iff ``i*row`` is a multiple of ``b`` (so ``factor = b / gcd(b, row)``); the
later dims cannot be cut at all, because every block runs across them.
:func:`flat_blocked` gives a format these relations, or the per-dim ones
above where they say the same thing (``(OneToOne, Blocked(b))`` when ``b``
divides a row, ``(Blocked(b/row), Constant)`` when a block is whole rows),
so that column shards stay legal wherever they can be expressed.

``Stacked(n)`` is internal: it is what an all-gather along a dim makes of an
inner that is ``Constant`` there but may differ between the gathered pieces
(one inner row per piece of ``n`` logical rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class LayoutError(ValueError):
    """A shape, placement or op that the quantized layout cannot express."""


def partial_refused(subject: str, placement, context: str = "") -> LayoutError:
    """The one error for a quantized tensor met with a ``Partial`` placement, wherever it is met.

    A quantized tensor cannot hold partial sums: adding codes and scales is
    not adding the values they stand for. The placement checks, the
    reducing collectives (``all_reduce``, ``reduce_scatter``) and the
    checkpoint entries all raise this, on every rank, before any collective.
    """
    placement = placement if isinstance(placement, str) else repr(placement)  # Partial(sum), not P(sum)
    return LayoutError(
        f"dtensor_quant: {subject} cannot be {placement}{context}: a quantized tensor holds no partial sums "
        "(adding codes and scales is not adding values). Reduce the dense tensor first, then quantize it "
        "(dtensor_quant.quantize takes a DTensor and reduces the scales it needs)."
    )


@dataclass(frozen=True)
class OneToOne:
    """One inner element per logical element."""

    factor = 1

    def inner_len(self, n: int) -> int:
        return n

    def __str__(self) -> str:
        return "one-to-one"


@dataclass(frozen=True)
class Packed:
    """``p`` logical elements share one inner element (e.g. two int4 per byte)."""

    p: int

    @property
    def factor(self) -> int:
        return self.p

    def inner_len(self, n: int) -> int:
        if n % self.p:
            raise LayoutError(f"a length of {n} cannot be packed {self.p} per element")
        return n // self.p

    def __str__(self) -> str:
        return f"packed by {self.p}"


@dataclass(frozen=True)
class Blocked:
    """One inner element per block of ``b`` logical elements (e.g. group scales)."""

    b: int

    @property
    def factor(self) -> int:
        return self.b

    def inner_len(self, n: int) -> int:
        return -(-n // self.b)

    def __str__(self) -> str:
        return f"blocked by {self.b}"


@dataclass(frozen=True)
class Constant:
    """The inner tensor is the same for every index of this dim (size 1)."""

    factor = 1

    def inner_len(self, n: int) -> int:
        return 1

    def __str__(self) -> str:
        return "constant"


@dataclass(frozen=True)
class Stacked:
    """Runs of ``n`` logical elements, each laid out by ``rel`` on its own grid.

    What an all-gather along another dim makes of this one: the ranks' pieces
    are stacked, and their blocks need not line up (a per-column scale stacked
    along rows, a row-blocked factor whose pieces end in a partial block).
    Splitting at run boundaries gives back ``rel``.
    """

    n: int
    rel: Relation = Constant()

    @property
    def factor(self) -> int:
        return self.n

    def inner_len(self, length: int) -> int:
        full, rem = divmod(length, self.n)
        return full * self.rel.inner_len(self.n) + (self.rel.inner_len(rem) if rem else 0)

    def __str__(self) -> str:
        return f"stacked in runs of {self.n} ({self.rel})"


@dataclass(frozen=True)
class FlatBlocked:
    """One inner element per ``b`` consecutive elements of the row-major flat index of this and later dims.

    ``row`` is the number of flat elements per index of this dim (the product
    of the later dims' lengths, which carry :class:`InFlat`). ``packed``: the
    elements are packs (``b`` values per inner element, no partial pack)
    rather than blocks (the last block may be partial).
    """

    b: int
    row: int
    packed: bool = False

    @property
    def factor(self) -> int:
        """Rows per cut: a cut at row ``i`` is legal iff ``i * row`` is a multiple of ``b``."""
        return self.b // math.gcd(self.b, self.row) if self.row else 1

    def inner_len(self, n: int) -> int:
        flat = n * self.row
        if self.packed and flat % self.b:
            raise LayoutError(f"{n} rows of {self.row} elements cannot be packed {self.b} per element")
        return -(-flat // self.b)

    def __str__(self) -> str:
        kind = "packed" if self.packed else "blocked"
        return f"{kind} by {self.b} over the flat index ({self.row} per row)"


@dataclass(frozen=True)
class InFlat:
    """A later dim (of logical length ``n``) spanned by an earlier :class:`FlatBlocked`: size 1, never cut."""

    n: int

    @property
    def factor(self) -> int:
        return max(self.n, 1)

    def inner_len(self, n: int) -> int:
        return 1

    def __str__(self) -> str:
        return f"blocked over the flattened weight, its blocks running across this dim's {self.n} elements"


class Opaque:
    """The relation of an inner tensor after a flatten that does not follow the flat index.

    What ``view(-1)`` (FSDP2 calls it on every sharded parameter) leaves when
    the inner tensor's own flattening does not line up with the logical one:
    any cut or resize of such a view raises ``LayoutError``.
    """

    @property
    def factor(self):
        raise LayoutError("this flattened quantized view cannot be sliced or resized")

    def inner_len(self, n):
        return self.factor

    def __str__(self):
        return "not sliceable after view(-1)"


Relation = OneToOne | Packed | Blocked | Constant | Stacked | FlatBlocked | InFlat


def flat_blocked(b: int, shape, dim: int = 0, packed: bool = False) -> tuple:
    """Relations, one per logical dim of ``shape``, for blocks of ``b`` over the flat index of ``shape[dim:]``.

    Dims before ``dim`` are one-to-one. The per-dim relations are used where
    they describe the same blocks (a block inside one row, or a block of whole
    rows), because they allow more cuts; otherwise ``FlatBlocked``/``InFlat``.
    """
    shape = tuple(shape)
    lead, span = (OneToOne(),) * dim, shape[dim:]
    unit = Packed(b) if packed else Blocked(b)
    if len(span) == 1 or span[-1] % b == 0:
        return lead + (OneToOne(),) * (len(span) - 1) + (unit,)
    row = math.prod(span[1:])
    if not packed and row and b % row == 0:
        return lead + (Blocked(b // row),) + (Constant(),) * (len(span) - 1)
    return lead + (FlatBlocked(b, row, packed),) + tuple(InFlat(n) for n in span[1:])


def inner_slice(rel: Relation, start: int, stop: int, length: int) -> tuple[int, int, Relation]:
    """Inner ``[i0, i1)`` holding logical ``[start, stop)`` of a dim of ``length``, and its relation.

    Raises LayoutError when a boundary cuts a packed element or a block. A
    blocked range may end inside a block (the block keeps its scale); only the
    very end of a packed dim may be partial.
    """
    if start == stop:
        if isinstance(rel, FlatBlocked):
            i = min(-(-start * rel.row // rel.b), -(-length * rel.row // rel.b))
            return i, i, rel
        i = min(rel.inner_len(start), rel.inner_len(length)) if not isinstance(rel, Constant) else 0
        return i, i + isinstance(rel, Constant), rel
    if isinstance(rel, Constant):
        return 0, 1, rel
    if isinstance(rel, InFlat):
        if (start, stop) != (0, length):
            raise LayoutError(
                f"[{start}:{stop}] of {length} cuts blocks that run across this dim ({rel}); "
                "only the dim that carries the flat blocks can be cut"
            )
        return 0, 1, rel
    if isinstance(rel, FlatBlocked):
        if start % rel.factor:
            raise LayoutError(
                f"start {start} puts {start * rel.row} flat elements before the cut, not a multiple of {rel.b} ({rel})"
            )
        if rel.packed and (stop * rel.row) % rel.b:
            raise LayoutError(f"end {stop} cuts a pack of {rel.b} ({rel})")
        return start * rel.row // rel.b, -(-stop * rel.row // rel.b), rel
    if isinstance(rel, Stacked):
        run = start // rel.n
        if stop <= (run + 1) * rel.n:  # inside one run: that run's own layout
            base = run * rel.rel.inner_len(rel.n)
            i0, i1, sub = inner_slice(rel.rel, start - run * rel.n, stop - run * rel.n, rel.n)
            return base + i0, base + i1, sub
        if start % rel.n:
            raise LayoutError(f"start {start} is inside a run of {rel.n} and the range spans runs ({rel})")
        i0 = rel.inner_len(start)
        return i0, i0 + rel.inner_len(stop - start), rel
    f = rel.factor
    if start % f:
        raise LayoutError(f"start {start} is not a multiple of {f} ({rel})")
    if isinstance(rel, Packed) and stop % f:
        raise LayoutError(f"end {stop} is not a multiple of {f} ({rel})")
    return start // f, -(-stop // f), rel


def inner_index(rel, x):
    """The inner index of logical index ``x`` (an int, or a tensor of them) along a dim laid out by ``rel``."""
    if isinstance(rel, OneToOne):
        return x
    if isinstance(rel, (Packed, Blocked)):
        return x // rel.factor
    if isinstance(rel, Constant):
        return x * 0
    if isinstance(rel, Stacked):
        return (x // rel.n) * rel.rel.inner_len(rel.n) + inner_index(rel.rel, x % rel.n)
    raise LayoutError(f"{rel}: this view cannot be written into (it has no per-element grid)")


def shares_outside(rel, start: int, stop: int, end: int) -> bool:
    """Whether the inner elements of ``[start, stop)`` along a dim laid out by ``rel`` also hold elements outside it.

    ``end`` is where the dim's elements end (the rows past a factory buffer's
    leading narrow are padding, not elements). A constant inner tensor covers
    every element; a block cut inside covers the elements on both sides.
    """
    if isinstance(rel, Constant):
        return end > 0
    if start == stop or isinstance(rel, (OneToOne, Packed)):  # slices cut whole packs only
        return False
    if isinstance(rel, FlatBlocked):  # a block of the flat index straddles a cut row boundary
        return (start > 0 and start * rel.row % rel.b != 0) or (stop < end and stop * rel.row % rel.b != 0)
    if isinstance(rel, InFlat):  # blocks run across the whole dim: any cut shares them
        return True
    if isinstance(rel, Stacked) and isinstance(rel.rel, FlatBlocked):  # each run has its own flat grid
        f, n = rel.rel, rel.n

        def inside(p):
            return p % n != 0 and (p % n) * f.row % f.b != 0

        return (start > 0 and inside(start)) or (stop < end and inside(stop))
    if isinstance(rel, Blocked):  # the start is on a block boundary (slicing checked it)
        return stop < end and stop % rel.b != 0
    # the element just outside on either side maps into the view's inner range
    return (start > 0 and inner_index(rel, start - 1) >= inner_index(rel, start)) or (
        stop < end and inner_index(rel, stop) <= inner_index(rel, stop - 1)
    )


def same_grid(a, b, length: int) -> bool:
    """Whether relations ``a`` and ``b`` put every logical index of a dim of ``length`` at the same inner index."""
    if a == b:
        return True
    x = torch.arange(length)
    try:
        return torch.equal(inner_index(a, x), inner_index(b, x))
    except LayoutError:
        return False


def can_flatten(outer: Relation, inner: Relation, inner_dim_len: int) -> Relation | None:
    """The relation of a 2-D inner tensor after flattening both logical dims.

    ``outer``/``inner`` are the relations of the leading and trailing dim and
    ``inner_dim_len`` the logical length of the trailing dim. Returns None when
    the flattened inner tensor does not follow the flat logical index in
    order (e.g. a per-column scale), so the flat view cannot be sliced.
    """
    if isinstance(outer, FlatBlocked) and isinstance(inner, InFlat):
        return Packed(outer.b) if outer.packed else Blocked(outer.b)
    if isinstance(inner, Constant):
        if isinstance(outer, Constant):
            return Constant()
        if isinstance(outer, OneToOne):
            return Blocked(inner_dim_len)
        if isinstance(outer, Blocked):
            return Blocked(outer.b * inner_dim_len)
        return None
    if not isinstance(outer, OneToOne):
        return None
    if isinstance(inner, (OneToOne, Packed)):
        return inner
    if isinstance(inner, Blocked) and inner_dim_len % inner.b == 0:
        return inner
    return None


def chunk_boundaries(length: int, pieces: int) -> list[tuple[int, int]]:
    """``torch.chunk`` ranges of ``length`` into ``pieces`` (trailing ones may be empty)."""
    size = -(-length // pieces) if length else 0
    return [(min(i * size, length), min((i + 1) * size, length)) for i in range(pieces)]


def legal_chunk(length: int, pieces: int, factor: int) -> bool:
    """Whether ``torch.chunk`` of ``length`` into ``pieces`` cuts only on multiples of ``factor``."""
    if pieces == 1 or factor == 1:
        return True
    return all(s % factor == 0 for s, e in chunk_boundaries(length, pieces) if s < e)


# How many mesh sizes an error message lists as legal alternatives.
MAX_LISTED_MESH_SIZE = 64


def legal_chunk_counts(length: int, factor: int) -> list[int]:
    """The shard counts (up to MAX_LISTED_MESH_SIZE) whose ``torch.chunk`` of ``length`` cuts on multiples of
    ``factor``."""
    return [n for n in range(1, MAX_LISTED_MESH_SIZE + 1) if legal_chunk(length, n, factor)]


def dim_factor(rels: list[Relation]) -> int:
    """The alignment a shard boundary needs so that every inner tensor can follow it."""
    return math.lcm(*(r.factor for r in rels)) if rels else 1
