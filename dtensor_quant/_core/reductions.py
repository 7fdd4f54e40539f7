"""Block-wise reductions for format math: partial last blocks and empty shards included.

A sharded weight may hold an empty shard (``torch.chunk`` leaves trailing
chunks empty) or a partial last block; its statistics must still be the
identity of the reduction so that an all-reduce across shards gives the
statistic of the full weight.
"""

from __future__ import annotations

import torch

from .layout import Blocked, Constant, FlatBlocked, OneToOne

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
        return canonical_nan(x.amax(dim + 1))
    if op == "min":
        return canonical_nan(x.amin(dim + 1))
    return canonical_nan(x.sum(dim + 1))


def block_stat_abs(x: torch.Tensor, inf_as: float = 0.0, keep_nan: bool = True) -> torch.Tensor:
    """``|x|`` for a block maximum that an infinite element does not decide (float32).

    A block's scale is set by its finite values, so they keep the precision
    they would have without the Inf beside them; the Inf itself is then coded
    by the format's arithmetic with that scale (it saturates to the largest
    code, or stays Inf where the code has one). Each ``|x| = inf`` counts as
    ``inf_as``; NaN stays NaN (``keep_nan``: the block's statistic is NaN, for
    codes that cannot say NaN) or counts as 0 (the code says NaN by itself).
    """
    a = x.float().abs()
    if keep_nan:
        return torch.where(a == float("inf"), inf_as, a)
    return torch.where(a < float("inf"), a, torch.where(a == float("inf"), inf_as, 0.0))


def finite_or_nan(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each +-Inf as 0: a signed block's min and max (a range) that an Inf does not decide; NaN stays."""
    return torch.where(x.isinf(), 0.0, x)


# Block statistics below this are multiplied by 2**64 (exact) before a reciprocal: 1 / amax overflows float32 for
# amax below 2**-128, and top / amax for amax below top * 2**-128.
RESCALE_BELOW = 2.0**-64
RESCALE = 2.0**64


def rescaled(x: torch.Tensor, stat: torch.Tensor, per_element) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, stat)`` with every block whose ``stat`` is below ``RESCALE_BELOW`` multiplied by ``RESCALE``.

    Exact (a power of two on values below 2**-64: subnormals become normal,
    nothing overflows), so ``x / stat`` is unchanged in value while ``1 / stat``
    stays finite. ``per_element(factor, x)`` applies one factor per block.
    Blocks at or above the threshold keep their bits.
    """
    tiny = stat < RESCALE_BELOW
    if not bool(tiny.any()):
        return x, stat
    factor = torch.where(tiny, RESCALE, 1.0)
    return per_element(factor, x), stat * factor


def canonical_nan(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every NaN as the one canonical NaN.

    The input's sign and payload would depend on which shard held it.
    """
    return torch.where(x.isnan(), torch.full_like(x, float("nan")), x)


def canonical_nans(t: torch.Tensor) -> torch.Tensor:
    """A stored inner tensor with every NaN as one bit pattern.

    Vectorized and scalar loops (a shard's length decides which runs) leave
    different NaN payloads and signs; canonical NaNs keep quantizing a shard
    bit-identical to quantizing the full tensor. Integer tensors pass through.
    """
    if t.dtype == torch.float8_e4m3fn:  # NaN is S.1111.111: drop the sign
        b = t.view(torch.uint8)
        return torch.where(b == 0xFF, torch.full_like(b, 0x7F), b).view(t.dtype)
    if t.dtype.is_floating_point and t.element_size() > 1:
        return canonical_nan(t)
    return t


def reduce_nan_aware(stat: torch.Tensor, op: str, all_reduce) -> torch.Tensor:
    """``all_reduce(stat, op)`` that is NaN wherever any rank's ``stat`` is (gloo's MAX/MIN may drop NaN).

    Same bytes, one collective: a float32 max/min travels as int32 keys in
    IEEE total order, where the canonical (positive) NaN sorts above +inf, so
    an integer MAX keeps it (a min is the max of the negation).
    """
    if op == "sum" or stat.dtype != torch.float32:
        return canonical_nan(all_reduce(stat, op))
    sign = 1.0 if op == "max" else -1.0
    key = _ordered(canonical_nan(stat * sign))
    return canonical_nan(_unordered(all_reduce(key, "max")) * sign)


def reduce_magnitude_max(stat: torch.Tensor, all_reduce) -> torch.Tensor:
    """:func:`reduce_nan_aware` ``(stat, "max")`` for float32 magnitudes whose sign bits are clear: no tensor op.

    ``stat`` holds values ``>= +0`` or NaN, every sign bit clear (a maximum of ``|x|`` taken on the bits, as
    :func:`dtensor_quant._core.activations.token_absmax` does). Such a float's bits, read as an int32, are
    ordered as its value, and every NaN's lie above +inf, so ``all_reduce(key, "max")`` of the bits
    themselves is the maximum, NaN wherever any rank's ``stat`` is (with the largest payload, the same on
    every rank). ``all_reduce`` may work in place: ``stat`` is then overwritten. The per-token maxima of a
    row-parallel matmul take this path once per call; the general transform costs some fifteen small ops.
    """
    return all_reduce(stat.view(torch.int32), "max").view(torch.float32)


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 whose signed order is the floats' order (NaN, positive, above +inf)."""
    bits = x.contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _unordered(key: torch.Tensor) -> torch.Tensor:
    return torch.where(key < 0, key ^ 0x7FFFFFFF, key).view(torch.float32)


def safe_scale(
    amax: torch.Tensor, qmax: float, dtype: torch.dtype, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``amax / qmax`` in ``dtype``: never zero, and ``qmax * scale`` never overflows ``dtype`` or ``out_dtype``.

    The floor is ``dtype``'s smallest subnormal, not its smallest normal, so
    tiny fp16 rows keep their precision, and it is rounded up, so no code is
    clipped: the error stays within half a (rounded) scale, for fp16 at most
    ``amax / (2 * qmax)`` plus half a scale ulp. Where rounding to ``dtype`` pushes
    ``qmax * scale`` (computed in float32, as dequantize does) past the limit,
    the scale steps down one ulp, so finite weights near the dtype's range
    never dequantize to Inf. The limit is the largest value of ``dtype`` that
    is finite in ``out_dtype`` too (the weight's dtype: dequantize rounds the
    product to ``dtype``, then to the weight's; for fp16 weights with bf16
    scales 65280, as 65504 rounds to bf16 65536): ``amax`` above it saturates
    there (fp32 weights above bf16's 3.39e38 lose 0.4%; above 65504 with fp16
    scales, everything above). A non-finite ``amax`` (NaN in the block) stays
    non-finite: that block dequantizes to NaN rather than to silently wrong
    finite values.
    """
    info = torch.finfo(dtype)
    limit = largest_finite(dtype, out_dtype)
    finite = amax.isfinite()
    scale = (amax.clamp(max=limit) / qmax).clamp(min=info.smallest_normal * info.eps).to(dtype)
    # Rounded up where rounding went down, so |w| / scale <= qmax and no code is clipped.
    under = finite & (scale.float() * qmax < amax.clamp(max=limit))
    scale = torch.where(under, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    over = finite & (scale.float() * qmax > limit)
    return torch.where(over, torch.nextafter(scale, torch.zeros_like(scale)), scale)


def largest_finite(dtype: torch.dtype, out_dtype: torch.dtype | None) -> float:
    """The largest value of ``dtype`` that converts to a finite ``out_dtype`` value (``dtype``'s max if None)."""
    limit = torch.finfo(dtype).max
    if out_dtype is None or torch.finfo(out_dtype).max >= limit:
        return limit
    top = torch.tensor(torch.finfo(out_dtype).max, dtype=torch.float32)
    rounded = top.to(dtype)
    if rounded.float() > top:
        rounded = torch.nextafter(rounded, torch.zeros_like(rounded))
    return rounded.item()


def expand_blocks(s: torch.Tensor, dim: int, block: int, length: int) -> torch.Tensor:
    """Repeat each block statistic ``block`` times along ``dim`` and cut to ``length``."""
    return s.repeat_interleave(block, dim).narrow(dim, 0, length)


def reduce_to(x: torch.Tensor, rels, op: str) -> torch.Tensor:
    """Reduce a logical-shaped ``x`` to one value per inner element of an inner tensor laid out by ``rels``.

    The statistic a format stores per block (a scale per group, a factor per
    block of scales), for any of the relations in :mod:`dtensor_quant._core.layout`
    except packing. Float32 (float64 for ``"sum"``), like :func:`block_reduce`.
    """
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
    elif out.dtype == torch.float32 and not qdata.dtype.is_floating_point:
        torch.mul(qdata, scale.float(), out=out)  # the same float32 product, in one pass
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
    torch.index_select(table, 0, qdata.reshape(-1).int(), out=out.view(-1).view(table.dtype))  # odd widths too
