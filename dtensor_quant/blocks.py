"""Block-wise reductions for format math: partial last blocks and empty shards included.

A sharded weight may hold an empty shard (``torch.chunk`` leaves trailing
chunks empty) or a partial last block; its statistics must still be the
identity of the reduction so that an all-reduce across shards gives the
statistic of the full weight.
"""

from __future__ import annotations

import torch

_IDENTITY = {"max": float("-inf"), "min": float("inf"), "sum": 0.0}


def block_reduce(x: torch.Tensor, dim: int, block: int | None, op: str) -> torch.Tensor:
    """Reduce ``x`` over blocks of ``block`` elements along ``dim`` (``None``: the whole dim).

    Returns float32 (float64 for ``"sum"``, so that a sum combined across shards
    in another order still rounds to the same weight-dtype value) with ``dim``
    of size ``ceil(len / block)`` (1 for ``None``).
    """
    x = x.double() if op == "sum" else x.float()
    length = x.shape[dim]
    n_blocks = 1 if block is None else -(-length // block)
    size = length if block is None else block
    if length == 0 or size == 0:
        shape = list(x.shape)
        shape[dim] = n_blocks if block is not None else 1
        return x.new_full(shape, _IDENTITY[op])
    pad = n_blocks * size - length
    if pad:
        widths = [0, 0] * (x.ndim - 1 - dim) + [0, pad]
        x = torch.nn.functional.pad(x, widths, value=_IDENTITY[op])
    x = x.unflatten(dim, (n_blocks, size))
    if op == "max":
        return x.amax(dim + 1)
    if op == "min":
        return x.amin(dim + 1)
    return x.sum(dim + 1)


def expand_blocks(s: torch.Tensor, dim: int, block: int, length: int) -> torch.Tensor:
    """Repeat each block statistic ``block`` times along ``dim`` and cut to ``length``."""
    return s.repeat_interleave(block, dim).narrow(dim, 0, length)
