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

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .format import QuantFormat, check_weight, weight_layout
from .layout import MAX_LISTED_MESH_SIZE, LayoutError, dim_factor


def _shard_like(p: Placement) -> bool:
    return isinstance(p, (Shard, _StridedShard))


def dim_alignment(fmt: QuantFormat, shape: Sequence[int], dim: int) -> int:
    """The multiple every shard boundary along logical ``dim`` of a ``shape`` weight must fall on."""
    return dim_factor([rels[dim] for rels in weight_layout(fmt, shape).values()])


def _pieces(length: int, cuts: Sequence[tuple[Placement, int]]) -> list[torch.Tensor]:
    """Logical indices of ``[0, length)`` held by each shard after applying ``cuts`` in mesh order."""
    pieces = [torch.arange(length)]
    for placement, ways in cuts:
        splitter = _StridedShard(0, split_factor=placement.split_factor) if isinstance(placement, _StridedShard) else Shard(0)
        pieces = [c for p in pieces for c in splitter._split_tensor(p, ways, with_padding=False)[0]]
    return pieces


def _bad_cut(length: int, cuts, factor: int) -> int | None:
    """The first shard boundary not on a multiple of ``factor``, or None."""
    for idx in _pieces(length, cuts):
        if idx.numel() == 0:
            continue
        starts_run = torch.cat([idx.new_ones(1, dtype=torch.bool), idx[1:] != idx[:-1] + 1])
        bad = idx[starts_run & (idx % factor != 0)]
        if bad.numel():
            return int(bad[0])
    return None


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
    check_weight(fmt, shape, torch.bfloat16)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            raise LayoutError(
                f"{fmt}: Partial placement on mesh dim {mesh_dim}: a quantized tensor cannot hold "
                "partial sums. Reduce the dense tensor first, then quantize it."
            )
        if not (_shard_like(p) or isinstance(p, Replicate)):
            raise LayoutError(f"{fmt}: unsupported placement {p}")
    problem = _first_bad_cut(shape, fmt, mesh_shape, placements)
    if problem is not None:
        raise LayoutError(_explain(fmt, shape, mesh_shape, placements, *problem))


def _first_bad_cut(shape, fmt, mesh_shape, placements) -> tuple[int, int, int] | None:
    """``(dim, index, alignment)`` of the first misaligned shard boundary, or None."""
    for dim, length in enumerate(shape):
        cuts = [(p, mesh_shape[m]) for m, p in enumerate(placements) if _shard_like(p) and p.dim % len(shape) == dim]
        factor = dim_alignment(fmt, shape, dim)
        if not cuts or factor == 1:
            continue
        bad = _bad_cut(length, cuts, factor)
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
        if _first_bad_cut(tuple(shape), fmt, trial, placements) is None:
            legal.append(size)
    return legal


def _explain(fmt, shape, mesh_shape, placements, dim, bad, factor) -> str:
    why = ", ".join(f"'{n}' is {rels[dim]}" for n, rels in weight_layout(fmt, shape).items() if rels[dim].factor > 1)
    mesh_dims = [m for m, p in enumerate(placements) if _shard_like(p) and p.dim % len(shape) == dim]
    hints = []
    for m in mesh_dims:
        sizes = legal_mesh_sizes(shape, fmt, mesh_shape, placements, m)
        hints.append(f"mesh dim {m} (now {mesh_shape[m]}) would be legal with size " + (", ".join(map(str, sizes)) or "none"))
    return (
        f"{fmt}: placements {list(placements)} on mesh {tuple(mesh_shape)} cut dim {dim} "
        f"(size {shape[dim]}) of a {tuple(shape)} weight at index {bad}, which is not a multiple of "
        f"{factor} ({why}). " + "; ".join(hints) + "."
    )
