"""BlockFloat8 and BlockLog4: optimizer states (Adam's moments) in 8 and 4 bits, one scale per block of a row.

An optimizer state has the shape of its parameter; these formats cut each
row into blocks of ``block_size`` values along the last dim and keep one
float32 absolute maximum per block, so a state shards like its parameter
(any row cut; a column cut on a block boundary) and its blocks never depend
on how it is sharded.

Layout: ``codes`` ``[out, in]`` (uint8: the bits of an 8-bit float for
BlockFloat8; two 4-bit codes per byte along ``in``, low nibble first, for
BlockLog4) and ``absmax`` float32 ``[out, ceil(in / block_size)]``, blocked
along ``in``.

Math. Adam's moments span orders of magnitude inside a block, so the codes
are logarithmic, not linear. BlockFloat8 stores ``x / absmax * 448`` as an
e4m3fn value (3 significant bits over 2**17.8 of range), rounded to nearest
even; BlockLog4 stores the nearest of ``0, 2**-6 .. 2**0`` (with a sign)
times the block's maximum. ``nonnegative=True`` is for second moments: the
values are never negative, they span twice the orders of magnitude of the
gradients they average, and coding one as zero would blow up its update. So
BlockFloat8 codes them as e5m2 (``x / absmax * 57344``: 2 significant bits
over 2**31.8 of range) and BlockLog4 as the nearest power of two ``2**0 ..
2**-15`` of the maximum in log terms; a value below the smallest code gets
the smallest code, never zero (it damps its update instead).

Extremes. A block's maximum is taken over its finite values, so an Inf or a
NaN never costs the rest of its block its precision, and a block of tiny
values (down to float32's smallest subnormal: Adam's second moment of
gradients of 1e-19 is 1e-41) is first multiplied by 2**64 (exact), so that
``top / absmax`` and ``1 / absmax`` stay finite; unpack multiplies such a block
back by 2**-64 after the scale, rounding once. A non-finite element is then
coded by the format's own arithmetic: BlockFloat8 keeps NaN (both codes have
it), keeps Inf in e5m2 and saturates it to +-448 in e4m3fn (torch's
conversion); a block that holds an Inf has a maximum of at least 2**-149, so
the Inf survives a block of zeros. BlockLog4 has neither code: a NaN takes the
zero code (signed) or the largest one (nonnegative), a signed Inf saturates to
+-absmax, and a nonnegative block with an Inf keeps absmax = Inf (every value
of the block reads Inf: for Adam's second moment, no step for that block, as
torch's dense state gives no step for the element itself; its finite maximum
would instead give the element a step of ``m / sqrt(finite max)``, unbounded).

All of it is exact arithmetic (a division, a multiply, round-to-nearest-even,
comparisons of exponent and fraction bits), so the C++ kernels below give
the torch expressions' bits on any machine, and a block's codes do not depend
on the shard or the vector width that computed them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .._core import native
from .._core.format import QuantFormat, Reducer
from .._core.layout import Blocked, OneToOne, Packed
from .._core.reductions import (
    RESCALE,
    RESCALE_BELOW,
    block_reduce,
    block_stat_abs,
    canonical_nan,
    expand_blocks,
    nibbles_into,
    rescaled,
)
from .._core.stochastic import Noise

# The least block maximum of a block that holds an Inf (float32's smallest subnormal): a block of zeros and an Inf
# would otherwise scale by 0 and read the Inf back as 0 * Inf = NaN.
_INF_AT_LEAST = 2.0**-149
# (torch dtype, its largest finite value, its smallest positive value) of BlockFloat8's two codes
_E4M3 = (torch.float8_e4m3fn, 448.0, 2.0**-9)
_E5M2 = (torch.float8_e5m2, 57344.0, 2.0**-16)


def _per_element(s: torch.Tensor, block: int, x: torch.Tensor) -> torch.Tensor:
    """Block statistic ``s`` ``[rows, blocks]`` times ``x`` ``[rows, cols]``, block by block."""
    rows, cols = x.shape
    if cols % block == 0:
        return (x.view(rows, cols // block, block) * s.unsqueeze(-1)).view(rows, cols)
    return x * expand_blocks(s, 1, block, cols)


def _scaled_(out: torch.Tensor, factor: torch.Tensor, block: int) -> None:
    """``out *= factor`` per block of the last dim."""
    rows, cols = out.shape
    if cols % block == 0:
        out.view(rows, cols // block, block).mul_(factor.unsqueeze(-1))
    else:
        out.mul_(expand_blocks(factor, 1, block, cols))


_VALUES: dict[torch.dtype, torch.Tensor] = {}


def _values(dtype: torch.dtype) -> torch.Tensor:
    """float32 value of every code of an 8-bit float dtype, as torch converts it."""
    if dtype not in _VALUES:
        _VALUES[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return _VALUES[dtype]


# BlockFloat8's two kernels (block_float8.h, an entry point each): the torch expressions of quantize and unpack,
# one pass each, the same bits. The encoders round to nearest even as torch's float -> float8 conversions do for
# the values these formats code (|x| <= the format's maximum, times one ulp).
BF8_KERNELS = {
    "quantize": native.declare(
        "block_float8_quantize", Path(__file__).with_name("block_float8_quantize.cpp"), {"b": 1, "gc": 1}
    ),
    "unpack": native.declare("block_float8_unpack", Path(__file__).with_name("block_float8_unpack.cpp"), {"b": 1}),
}


def _float8_sr(y: torch.Tensor, u: torch.Tensor, e5m2: bool) -> torch.Tensor:
    """``y`` (within the code's range) stochastically rounded to e4m3fn or e5m2 codes with noise ``u``, as uint8.

    A normal value adds the top ``k`` bits of ``u`` to the ``k`` fraction bits
    it drops (20 for e4m3, 21 for e5m2), then drops them: it rounds up with
    probability their value. A subnormal one is ``floor(y / 2**-s + u)``.
    """
    k, limit, steps, bias, top = (
        (21, 2.0**-14, 65536.0, 112 << 2, 0x7B) if e5m2 else (20, 2.0**-6, 512.0, 120 << 3, 0x7E)
    )
    y = y.contiguous()
    a = y.abs()
    normal = ((a.view(torch.int32) + (u * float(1 << k)).to(torch.int32)) >> k) - bias
    sub = torch.floor(a * steps + u).to(torch.int32)
    code = torch.where(a < limit, sub, normal).clamp_(max=top)
    if e5m2:
        code.masked_fill_(a == float("inf"), 0x7C)  # Inf's neighbours are Inf (e4m3fn saturates, as torch's `to`)
    code.masked_fill_(a.isnan(), 0x7F)
    return (code | ((y.view(torch.int32) < 0).to(torch.int32) << 7)).to(torch.uint8)


@dataclass(frozen=True)
class BlockFloat8(QuantFormat):
    """8-bit float codes scaled by each block's absolute maximum: e4m3fn, or e5m2 never zero for ``nonnegative``."""

    block_size: int = 256
    nonnegative: bool = False

    def check_weight(self, shape, dtype):
        """A float64 parameter's moments too: the statistics and codes are computed in float32 (weights: no)."""
        super().check_weight(shape, torch.float32 if dtype == torch.float64 else dtype)

    @property
    def layout(self):
        return {"codes": (OneToOne(), OneToOne()), "absmax": (OneToOne(), Blocked(self.block_size))}

    @property
    def _code(self):
        return _E5M2 if self.nonnegative else _E4M3

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        fast = self._quantize_kernel(weight, reduce)
        if fast is not None:
            return fast
        y, amax = self._scaled(weight, reduce)
        return {"codes": y.to(self._code[0]).view(torch.uint8), "absmax": amax}

    def quantize_stochastic(self, weight, reduce, noise: Noise, dtype):
        """The codes of ``quantize`` rounded at random between their two neighbours (the same maxima)."""
        fast = self._quantize_kernel(weight, reduce, noise)
        if fast is not None:
            return fast
        y, amax = self._scaled(weight, reduce)
        return {"codes": _float8_sr(y, noise.uniform(), self.nonnegative), "absmax": amax}

    def _scaled(self, weight, reduce):
        """``(weight scaled per block to the code's range, the block maxima)``, as float32."""
        _, top, tiny = self._code
        x = weight.float()
        stat = block_stat_abs(x, inf_as=_INF_AT_LEAST, keep_nan=False)
        amax = reduce(block_reduce(stat, 1, self.block_size, "max"), "max", "absmax")
        xs, scaled = rescaled(x, amax, lambda f, t: _per_element(f, self.block_size, t))
        factor = torch.where(scaled > 0, top / scaled, torch.zeros_like(scaled))
        y = _per_element(factor, self.block_size, xs)  # within +-top up to an ulp, which rounds to top
        if self.nonnegative:
            y = y.clamp_(min=tiny)  # never a zero code (a zero block stays zero: its absmax is 0)
        return y, amax

    def _quantize_kernel(self, weight: torch.Tensor, reduce: Reducer, noise: Noise | None = None):
        """The C++ kernel's result (None where it cannot run): the maxima, reduced, then the codes.

        The block maxima go through ``reduce`` as in the torch path; a reducer
        that changes them (none of the library's: the blocks never span shards)
        gets a second pass that codes with the reduced ones.
        """
        if weight.device.type != "cpu" or weight.ndim != 2 or (noise is not None and noise.values is not None):
            return None
        loaded = native.load(BF8_KERNELS["quantize"])
        if loaded is None:
            return None
        x = weight.float().contiguous()
        rows, cols = x.shape
        codes = torch.empty((rows, cols), dtype=torch.uint8)
        local = torch.empty((rows, -(-cols // self.block_size)), dtype=torch.float32)
        sr = (0, 0, 0, 0, 1, 0) if noise is None else (1, noise.key, *noise.offsets, noise.global_shape[1], noise.wide)
        args = (rows, cols, self.block_size, int(self.nonnegative))
        loaded[0](x, codes, local, *args, 0, *map(int, sr), native.level_out())
        local = canonical_nan(local)
        absmax = reduce(local, "max", "absmax")
        if absmax is not local:
            absmax = absmax.contiguous()
            loaded[0](x, codes, absmax, *args, 1, *map(int, sr), native.level_out())
        return {"codes": codes, "absmax": absmax}

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        code_dtype, top, _ = self._code
        absmax = inner["absmax"]
        tiny = absmax < RESCALE_BELOW
        if not bool(tiny.any()):
            return (inner["codes"].view(code_dtype).float() * (absmax / top)).to(dtype)
        scale = (absmax * torch.where(tiny, RESCALE, 1.0)) / top
        values = inner["codes"].view(code_dtype).float() * scale * torch.where(tiny, 1 / RESCALE, 1.0)
        return values.to(dtype)

    def unpack(self, inner, out):
        if out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu":
            return False
        code_dtype, top, _ = self._code
        codes, absmax = inner["codes"].contiguous(), inner["absmax"].contiguous()
        loaded = native.load(BF8_KERNELS["unpack"])
        if loaded is not None:
            rows, cols = out.shape
            loaded[0](codes, absmax, _values(code_dtype), out, rows, cols, self.block_size, int(self.nonnegative),
                      native.level_out())  # fmt: skip
            return True
        torch.index_select(_values(code_dtype), 0, codes.reshape(-1).int(), out=out.view(-1))
        tiny = absmax < RESCALE_BELOW
        if not bool(tiny.any()):
            _scaled_(out, absmax / top, self.block_size)
            return True
        _scaled_(out, (absmax * torch.where(tiny, RESCALE, 1.0)) / top, self.block_size)
        _scaled_(out, torch.where(tiny, 1 / RESCALE, 1.0), self.block_size)
        return True

    def __str__(self) -> str:
        return f"BlockFloat8(block_size={self.block_size}{', nonnegative=True' if self.nonnegative else ''})"


# BlockLog4's 16 codes. Signed: bit 3 the sign, bits 0-2 the magnitude 2**-j (j = 7: zero). Nonnegative: all
# four bits the magnitude 2**-k, k = 0..15 (no zero).
_SIGNED = tuple([2.0**-j for j in range(7)] + [0.0] + [-(2.0**-j) for j in range(7)] + [0.0])
_POWERS = tuple(2.0**-k for k in range(16))
# Fraction bits of 1.f at 1.5 and at sqrt(2): where the nearest code changes within an octave, in linear and
# in log terms. The comparison uses the bits, so it is exact.
_HALF = 1 << 22
_ROOT2 = 0x3504F3  # the fraction bits of float32(sqrt(2)) = 1.41421353...


@dataclass(frozen=True)
class BlockLog4(QuantFormat):
    """4-bit codes on a power-of-two grid scaled by each block's absolute maximum; ``nonnegative``: log rounding,
    no zero."""

    block_size: int = 128
    nonnegative: bool = False

    def check_weight(self, shape, dtype):
        """A float64 parameter's moments too: the statistics and codes are computed in float32 (weights: no)."""
        super().check_weight(shape, torch.float32 if dtype == torch.float64 else dtype)

    @property
    def layout(self):
        return {"codes": (OneToOne(), Packed(2)), "absmax": (OneToOne(), Blocked(self.block_size))}

    def check_shape(self, shape: torch.Size) -> None:
        super().check_shape(shape)
        if shape[1] % 2:
            raise ValueError(f"{self} packs two codes per byte along the last dim; got width {shape[1]}")

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        return self._quantize(weight, reduce, None)

    def quantize_stochastic(self, weight, reduce, noise: Noise, dtype):
        """Each value rounded at random between the two codes around it (the same maxima): unbiased."""
        return self._quantize(weight, reduce, noise.uniform())

    def _quantize(self, weight, reduce, u: torch.Tensor | None) -> dict[str, torch.Tensor]:
        x = weight.float()
        if self.nonnegative:  # an Inf sets the maximum (see the module docstring); NaN is skipped
            stat = torch.where(x.isnan(), 0.0, x.abs())
        else:
            stat = block_stat_abs(x, keep_nan=False)
        amax = reduce(block_reduce(stat, 1, self.block_size, "max"), "max", "absmax")
        xs, scaled = rescaled(x.abs(), amax, lambda f, t: _per_element(f, self.block_size, t))
        factor = torch.where(scaled > 0, 1.0 / scaled, torch.zeros_like(scaled))
        # in [0, 1], NaN stays NaN; Inf where it saturates (a finite maximum); NaN where the maximum is Inf
        a = _per_element(factor, self.block_size, xs).contiguous()
        # a = 1.f * 2**e: exponent and fraction bits decide the code exactly (no log, no rounding of one). Between
        # 2**e and 2**(e+1) the fraction f / 2**23 is how far up a is: nearest rounding compares it with a
        # threshold, stochastic rounding with the noise.
        bits = a.view(torch.int32)
        minus_e, f = 127 - (bits >> 23), bits & 0x7FFFFF
        if u is None:
            up = f >= (_ROOT2 if self.nonnegative else _HALF)  # in log terms (1.f against sqrt 2), or linear (1.5)
        else:
            up = u * float(1 << 23) < f
        codes = minus_e.sub_(up.int())
        if self.nonnegative:  # below 2**-15 the smallest code, never zero
            codes = codes.clamp_(0, 15).to(torch.uint8)
        else:  # below 2**-6: zero (code 7) or 2**-6, by nearest or by chance; bit 3 the sign
            codes = codes.clamp_(0, 6).to(torch.uint8)
            low = a < 2.0**-6
            zero = a < 2.0**-7 if u is None else u * 2.0**-6 >= a
            codes.masked_fill_(low & zero, 7).masked_fill_(low & ~zero, 6).masked_fill_(a.isnan(), 7)  # NaN: zero
            codes.bitwise_or_((x < 0).to(torch.uint8) << 3)
        return {"codes": codes[:, 0::2] | (codes[:, 1::2] << 4), "absmax": amax}

    def _levels(self) -> tuple[float, ...]:
        return _POWERS if self.nonnegative else _SIGNED

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        packed = inner["codes"]
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()
        levels = torch.tensor(self._levels(), dtype=torch.float32, device=packed.device)
        return (levels[codes] * inner["absmax"]).to(dtype)

    def unpack(self, inner, out):
        if out.dtype != torch.float32 or not out.is_contiguous():
            return False
        nibbles_into(inner["codes"], self._levels(), out, high_first=False)
        _scaled_(out, inner["absmax"], self.block_size)
        return True

    def __str__(self) -> str:
        return f"BlockLog4(block_size={self.block_size}{', nonnegative=True' if self.nonnegative else ''})"
