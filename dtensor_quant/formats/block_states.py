"""BlockFloat8 and BlockLog4: optimizer states (Adam's moments) in 8 and 4 bits, one scale per block of a row.

An optimizer state has the shape of its parameter; these formats cut each
row into blocks of ``block_size`` values along the last dim and keep one
float32 absolute maximum per block, so a state shards like its parameter
(any row cut; a column cut on a block boundary) and its blocks never depend
on how it is sharded.

Layout: ``codes`` ``[out, in]`` (uint8 view of e4m3fn for BlockFloat8; two
4-bit codes per byte along ``in``, low nibble first, for BlockLog4) and
``absmax`` float32 ``[out, ceil(in / block_size)]``, blocked along ``in``.

Math. Adam's moments span orders of magnitude inside a block, so the codes
are logarithmic, not linear: BlockFloat8 stores ``x / absmax * 448`` as an
e4m3fn value (3 significant bits over 2**17.8 of range, rounded to nearest);
BlockLog4 stores the nearest of ``0, 2**-6 .. 2**0`` (with a sign) times the
block's maximum. ``sqrt=True`` is for second moments (never negative): the
square root is coded instead (half the range in log terms, and what Adam
divides by), and never as zero -- values too small for the codes become the
smallest one, so a tiny second moment cannot blow up an update, it only
damps it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.format import QuantFormat, Reducer
from ..core.layout import Blocked, OneToOne, Packed
from ..core.reductions import block_reduce, expand_blocks, nibbles_into
from .float8 import codes_into, table_fits

_E4M3_MAX = 448.0
_E4M3_TINY = 2.0**-9  # the smallest positive e4m3fn value (a subnormal)


def _per_element(s: torch.Tensor, block: int, x: torch.Tensor) -> torch.Tensor:
    """Block statistic ``s`` ``[rows, blocks]`` repeated along the last dim to ``x``'s shape (a view when whole)."""
    rows, cols = x.shape
    if cols % block == 0:
        return s.unsqueeze(-1).expand(rows, cols // block, block).reshape(rows, cols)
    return expand_blocks(s, 1, block, cols)


def _scaled_into(out: torch.Tensor, factor: torch.Tensor, block: int) -> None:
    """``out *= factor`` per block of the last dim (whole blocks: a broadcast over a view)."""
    rows, cols = out.shape
    if cols % block == 0:
        out.view(rows, cols // block, block).mul_(factor.unsqueeze(-1))
    else:
        out.mul_(expand_blocks(factor, 1, block, cols))


def _magnitude(weight: torch.Tensor, sqrt: bool) -> torch.Tensor:
    x = weight.float()
    return x.clamp(min=0).sqrt() if sqrt else x


@dataclass(frozen=True)
class BlockFloat8(QuantFormat):
    """e4m3fn codes scaled by each block's absolute maximum; ``sqrt``: the square root is coded."""

    block_size: int = 256
    sqrt: bool = False

    @property
    def layout(self):
        return {"codes": (OneToOne(), OneToOne()), "absmax": (OneToOne(), Blocked(self.block_size))}

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        x = _magnitude(weight, self.sqrt)
        amax = reduce(block_reduce(x.abs(), 1, self.block_size, "max"), "max", "absmax")
        factor = torch.where(amax > 0, _E4M3_MAX / amax, torch.zeros_like(amax))
        y = x * _per_element(factor, self.block_size, x)
        if self.sqrt:
            y = y.clamp_(min=_E4M3_TINY)  # never a zero code (a zero block stays zero: its absmax is 0)
        return {"codes": y.clamp_(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8), "absmax": amax}

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        x = inner["codes"].view(torch.float8_e4m3fn).float() * (inner["absmax"] / _E4M3_MAX)
        return (x * x if self.sqrt else x).to(dtype)

    def unpack(self, inner, out):
        if not table_fits(out):
            return False
        values = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
        codes_into(inner["codes"].view(torch.float8_e4m3fn), values)
        _scaled_into(values, inner["absmax"] / _E4M3_MAX, self.block_size)
        if self.sqrt:
            values.mul_(values)
        if values is not out:
            out.copy_(values)
        return True

    def __str__(self) -> str:
        return f"BlockFloat8(block_size={self.block_size}{', sqrt=True' if self.sqrt else ''})"


# BlockLog4's 16 codes: signed, bit 3 the sign and bits 0-2 the magnitude 2**-j (j = 7: zero); with sqrt,
# all 4 bits the magnitude 2**(-k/2), k = 0..15 (no zero).
_SIGNED = tuple([2.0**-j for j in range(7)] + [0.0] + [-(2.0**-j) for j in range(7)] + [0.0])
_ROOTS = tuple(2.0 ** (-k / 2) for k in range(16))
# Fraction bits of 1.f at 1.5, 2**0.25 and 2**0.75: where the nearest code changes within an octave.
_HALF = 1 << 22
_QUARTER = round((2**0.25 - 1) * 2**23)
_THREE_QUARTERS = round((2**0.75 - 1) * 2**23)


@dataclass(frozen=True)
class BlockLog4(QuantFormat):
    """4-bit codes on a power-of-two grid scaled by each block's absolute maximum; ``sqrt``: the root is coded."""

    block_size: int = 128
    sqrt: bool = False

    @property
    def layout(self):
        return {"codes": (OneToOne(), Packed(2)), "absmax": (OneToOne(), Blocked(self.block_size))}

    def check_shape(self, shape: torch.Size) -> None:
        super().check_shape(shape)
        if shape[1] % 2:
            raise ValueError(f"{self} packs two codes per byte along the last dim; got width {shape[1]}")

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        x = _magnitude(weight, self.sqrt)
        amax = reduce(block_reduce(x.abs(), 1, self.block_size, "max"), "max", "absmax")
        factor = torch.where(amax > 0, 1.0 / amax, torch.zeros_like(amax))
        a = (x.abs() * _per_element(factor, self.block_size, x)).contiguous()  # in [0, 1]
        # a = 1.f * 2**e: exponent and fraction bits decide the code exactly (no log, no rounding of one)
        bits = a.view(torch.int32)
        minus_e, f = 127 - (bits >> 23), bits & 0x7FFFFF
        if self.sqrt:  # nearest half-octave 2**(-k/2) in log terms: 1.f against 2**0.25 and 2**0.75
            k = minus_e.mul_(2).sub_((f >= _QUARTER).int()).sub_((f >= _THREE_QUARTERS).int())
            codes = k.clamp_(0, 15).to(torch.uint8)  # a = 0 has the smallest exponent field: code 15
        else:  # nearest power of two in linear terms (1.f against 1.5); zero below 2**-7 (code 7), bit 3 the sign
            codes = minus_e.sub_((f >= _HALF).int()).clamp_(0, 6).to(torch.uint8)
            codes.masked_fill_(a < 2.0**-7, 7)
            codes.bitwise_or_((x < 0).to(torch.uint8) << 3)
        return {"codes": codes[:, 0::2] | (codes[:, 1::2] << 4), "absmax": amax}

    def _values(self) -> tuple[float, ...]:
        return _ROOTS if self.sqrt else _SIGNED

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        packed = inner["codes"]
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()
        x = torch.tensor(self._values(), dtype=torch.float32, device=packed.device)[codes] * inner["absmax"]
        return (x * x if self.sqrt else x).to(dtype)

    def unpack(self, inner, out):
        if out.dtype != torch.float32 or not out.is_contiguous():
            return False
        nibbles_into(inner["codes"], self._values(), out, high_first=False)
        _scaled_into(out, inner["absmax"], self.block_size)
        if self.sqrt:
            out.mul_(out)
        return True

    def __str__(self) -> str:
        return f"BlockLog4(block_size={self.block_size}{', sqrt=True' if self.sqrt else ''})"
