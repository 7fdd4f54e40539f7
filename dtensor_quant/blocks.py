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


# -- unpack kernels (QuantFormat.unpack): whole blocks, written into a given tensor ---------

_EXACT_PRODUCT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def scaled_into(qdata: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out = (float(qdata) * float(scale)).to(out.dtype)`` with ``scale`` broadcast, in as few passes as exact.

    When ``out`` has the scale's dtype (bf16, fp16 or fp32) and the codes are
    exact in it (int8, float8), the product computed in ``out``'s dtype rounds
    once, from the same exact fp32 product: the same bits, one pass fewer.
    """
    if out.dtype == scale.dtype and out.dtype in _EXACT_PRODUCT_DTYPES:
        out.copy_(qdata)
        out.mul_(scale)
    else:
        out.copy_(qdata.float() * scale.float())


def _pair_table(values: tuple[float, ...], dtype: torch.dtype, device: torch.device, high_first: bool) -> torch.Tensor:
    key = (values, dtype, str(device), high_first)
    table = _PAIR_TABLES.get(key)
    if table is None:
        v = torch.tensor(values, dtype=dtype, device=device)
        byte = torch.arange(256, device=device)
        first, second = (byte >> 4, byte & 15) if high_first else (byte & 15, byte >> 4)
        pairs = torch.stack([v[first], v[second]], dim=-1).contiguous()  # [256, 2]
        table = _PAIR_TABLES[key] = pairs.view(_INT_OF_SIZE[2 * v.element_size()]).reshape(256)
    return table


_PAIR_TABLES: dict = {}
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def nibbles_into(qdata: torch.Tensor, values: tuple[float, ...], out: torch.Tensor, high_first: bool) -> None:
    """``out[r, 2j], out[r, 2j+1] = values[code]`` for the two 4-bit codes of byte ``qdata[r, j]``.

    One index_select of a 256-entry table whose entries are the two values of
    a byte, reinterpreted as one integer twice their size: a single gather per
    byte, no per-element index tensor. ``out`` must be contiguous.
    """
    table = _pair_table(values, out.dtype, out.device, high_first)
    torch.index_select(table, 0, qdata.reshape(-1).int(), out=out.view(table.dtype).view(-1))
