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

``Stacked(n)`` is internal: it is what an all-gather along a dim makes of an
inner that is ``Constant`` there but may differ between the gathered pieces
(one inner row per piece of ``n`` logical rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class LayoutError(ValueError):
    """A shape, placement or op that the quantized layout cannot express."""


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
    rel: "Relation" = Constant()

    @property
    def factor(self) -> int:
        return self.n

    def inner_len(self, length: int) -> int:
        full, rem = divmod(length, self.n)
        return full * self.rel.inner_len(self.n) + (self.rel.inner_len(rem) if rem else 0)

    def __str__(self) -> str:
        return f"stacked in runs of {self.n} ({self.rel})"


Relation = OneToOne | Packed | Blocked | Constant | Stacked


def inner_slice(rel: Relation, start: int, stop: int, length: int) -> tuple[int, int, Relation]:
    """Inner ``[i0, i1)`` holding logical ``[start, stop)`` of a dim of ``length``, and its relation.

    Raises LayoutError when a boundary cuts a packed element or a block. A
    blocked range may end inside a block (the block keeps its scale); only the
    very end of a packed dim may be partial.
    """
    if start == stop:
        i = min(rel.inner_len(start), rel.inner_len(length)) if not isinstance(rel, Constant) else 0
        return i, i + isinstance(rel, Constant), rel
    if isinstance(rel, Constant):
        return 0, 1, rel
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


def can_flatten(outer: Relation, inner: Relation, inner_dim_len: int) -> Relation | None:
    """The relation of a 2-D inner tensor after flattening both logical dims.

    ``outer``/``inner`` are the relations of the leading and trailing dim and
    ``inner_dim_len`` the logical length of the trailing dim. Returns None when
    the flattened inner tensor does not follow the flat logical index in
    order (e.g. a per-column scale), so the flat view cannot be sliced.
    """
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
    """The shard counts (up to MAX_LISTED_MESH_SIZE) whose ``torch.chunk`` of ``length`` cuts on multiples of ``factor``."""
    return [n for n in range(1, MAX_LISTED_MESH_SIZE + 1) if legal_chunk(length, n, factor)]


def dim_factor(rels: list[Relation]) -> int:
    """The alignment a shard boundary needs so that every inner tensor can follow it."""
    return math.lcm(*(r.factor for r in rels)) if rels else 1
