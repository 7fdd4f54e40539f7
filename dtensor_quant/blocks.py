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


def reduce_to(x: torch.Tensor, rels, op: str) -> torch.Tensor:
    """Reduce a logical-shaped ``x`` to one value per inner element of an inner tensor laid out by ``rels``.

    The statistic a format stores per block (a scale per group, a factor per
    block of scales), for any of the relations in :mod:`dtensor_quant.layout`
    except packing. Float32 (float64 for ``"sum"``), like :func:`block_reduce`.
    """
    from .layout import Blocked, Constant, FlatBlocked, OneToOne

    x = x.double() if op == "sum" else x.float()
    for dim, rel in enumerate(rels):
        if isinstance(rel, OneToOne):
            continue
        if isinstance(rel, Blocked):
            x = block_reduce(x, dim, rel.b, op)
        elif isinstance(rel, Constant):
            x = block_reduce(x, dim, None, op)
        elif isinstance(rel, FlatBlocked) and not rel.packed:
            flat = block_reduce(x.flatten(dim), dim, rel.b, op)
            return flat.reshape(*flat.shape, *(1,) * (x.ndim - dim - 1))
        else:
            raise ValueError(f"cannot reduce a statistic to an inner tensor that is {rel} along dim {dim}")
    return x


def expand_to(s: torch.Tensor, rels, shape) -> torch.Tensor:
    """The inverse of :func:`reduce_to`: each inner element repeated over its block of a ``shape`` tensor.

    Constant dims stay of size 1 (broadcastable).
    """
    from .layout import Blocked, FlatBlocked

    for dim, rel in enumerate(rels):
        if isinstance(rel, Blocked):
            s = expand_blocks(s, dim, rel.b, shape[dim])
        elif isinstance(rel, FlatBlocked):
            span = tuple(shape[dim:])
            n = 1
            for v in span:
                n *= v
            return expand_blocks(s.flatten(dim), dim, rel.b, n).unflatten(dim, span)
    return s


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
