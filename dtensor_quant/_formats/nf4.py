"""NF4: QLoRA's 4-bit NormalFloat with double-quantized block scales, on the flattened weight.

The algorithm and its dtype flow are torchao's ``to_nf4`` (QLoRA paper,
bitsandbytes, torchtune), defined on the row-major *flattened* weight:

* every ``block_size`` consecutive weights share a scale, their absolute
  maximum (in the weight's dtype); each weight becomes the index of the
  nearest of the 16 NF4 levels of ``w / scale`` (two codes per byte, first in
  the high nibble; ties go to the lower level);
* the scales are centred by their mean, and every ``scaler_block_size``
  consecutive scales share a factor ``256 / (2 * absmax)``; the centred
  scales are stored as ``round(scale * factor)`` in int8;
* dequantized: ``level * (scaler / factor + mean)``, in the weight's dtype.

What is bit-identical to torchao 0.18's ``to_nf4`` on the same finite input
without all-zero blocks: the codes, the int8 scalers, the factors, the mean
and the dequantized weight, for bf16 and fp16 weights; for fp32 the codes,
and everything else whenever torch's float32 mean rounds like ours (below). The 16 levels are torchao's table (the
paper's values rounded to 4 decimals, then to the weight's dtype); bitsandbytes
keeps the paper's float32 values, which in bf16 and fp16 differ from this
table in one level (-0.0911 vs -0.09105) by one ulp. The mean is the float64
sum of the scales divided by their count, rounded once to the dtype -- the
value torch's CPU ``mean`` gives unless its float32 accumulation rounds across
a dtype rounding boundary (not seen in the tests); it is the same on every
sharding because float64 sums of the scales are exact.

Layout (:func:`~dtensor_quant._core.layout.flat_blocked`, from the weight's shape):
``qdata`` packs 2 codes per byte and ``scaler`` blocks ``block_size`` weights,
``factor`` blocks ``block_size * scaler_block_size`` weights, all over the flat
index, and ``mean`` is constant. Where a block fits inside a row (or a factor
covers whole rows) the relations are the per-dim ones and column shards work
(row-parallel TP); otherwise the blocks run across rows and only row cuts
with a multiple of ``block_size * scaler_block_size`` elements before them
are legal -- torchao's own FSDP2 rule, plus uneven shards.

Extreme and non-finite input, where this departs from torchao (identical
otherwise):

* an all-zero block gets code 7 (level 0.0) and dequantizes to exact zeros
  (torchao divides 0/0 and keeps the code its NaN search gives);
* a block's scale is its finite values' maximum, so an Inf saturates to
  +-scale (level 1.0); the mean is over the *finite* block scales, so a NaN
  weight makes its own factor NaN and with it the ``block_size * scaler_block_size``
  weights that factor covers -- never fewer, because a block's own scale is
  an int8 that cannot hold NaN, and never more (in torchao the mean, and so
  the whole weight, becomes NaN);
* the factor is clamped to the dtype's max: in fp16 a factor's spread below
  128 / 65504 ~ 0.002 (weights of std ~1e-3) would make it Inf and every scale
  of its blocks the mean;
* a dequantized scale that rounds past the dtype's max (fp16 weights near
  65504) is clamped to it, so finite weights never dequantize to Inf;
* where ``2 * spread`` overflows (block scales spread over more than half the
  dtype's max: a weight near bf16's 3.4e38 or fp16's 65504 beside small ones)
  the factor is ``128 / spread`` -- torchao's 0 turns every weight the factor
  covers into NaN.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .._core import native
from .._core.format import FlatBlockedFormat, Reducer, int_params
from .._core.layout import Constant, flat_blocked
from .._core.reductions import block_stat_abs, expand_to, nibbles_into, reduce_to

# torchao's table (to_nf4): the QLoRA levels rounded to 4 decimals.
NF4_LEVELS = (
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
)  # fmt: skip


@dataclass(frozen=True)
class NF4(FlatBlockedFormat):
    block_size: int = 64
    scaler_block_size: int = 256

    inner_names = ("qdata", "scaler", "factor", "mean")
    block_size_params = ("block_size", "scaler_block_size")

    def __post_init__(self):
        int_params(self)
        if self.block_size < 2 or self.block_size % 2 or self.scaler_block_size < 1:
            raise ValueError(f"NF4 needs an even block_size >= 2 and scaler_block_size >= 1, got {self}")

    def layout_for(self, shape):
        self.check_shape(torch.Size(shape))
        return {
            "qdata": flat_blocked(2, shape, packed=True),
            "scaler": flat_blocked(self.block_size, shape),
            "factor": flat_blocked(self.block_size * self.scaler_block_size, shape),
            "mean": (Constant(), Constant()),
        }

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        dtype, shape = weight.dtype, weight.shape
        layout = self.layout_for(reduce.full_shape)
        # a block of whole rows spans a column cut: its maximum over every shard holding part of it
        absmax = reduce(reduce_to(block_stat_abs(weight), layout["scaler"], "max"), "max", "scaler").to(dtype)
        # The mean of the finite block scales: a NaN or Inf weight poisons its own factor's blocks, not all.
        finite = absmax.isfinite()
        stats = torch.stack([torch.where(finite, absmax, 0).double().sum(), finite.double().sum()])
        total, count = reduce(stats.reshape(1, 1, 2), "sum", "mean").reshape(2)
        mean = (total / count).to(dtype).reshape(1, 1)
        centred = absmax - mean
        # The factors' blocks, and each scale's factor, through the logical grid both follow.
        spread = reduce_to(expand_to(centred.abs(), layout["scaler"], shape), layout["factor"], "max")
        spread = reduce(spread, "max", "factor").to(dtype)
        twice = 2 * spread
        # torchao's 256 / (2 * spread), bit for bit -- except where 2 * spread overflows (weights near the
        # dtype's max beside small ones): there the factor was 0 and every weight it covers NaN (0 / 0);
        # 128 / spread is the same real number, and the factor is stored, so any finite one is exact.
        factor = torch.where(twice.isinf() & spread.isfinite(), 128 / spread, 256 / twice).to(dtype)
        # A spread below 128 / max (fp16: 0.002) would make the factor Inf and every scale the mean.
        factor = factor.clamp(max=torch.finfo(dtype).max)
        per_scale = reduce_to(expand_to(factor, layout["factor"], shape), layout["scaler"], "max").to(dtype)
        scaler = (centred * per_scale).round().clamp(-128, 127)
        scales = expand_to(absmax, layout["scaler"], shape)
        # a zero block: level 0.0, not 0/0; an Inf (not in its block's scale): +-1, the largest level
        codes = nearest_codes(torch.where(scales == 0, 0, weight / scales).clamp(-1, 1))
        pairs = codes.reshape(*(r.inner_len(n) for r, n in zip(layout["qdata"], shape)), 2)
        return {
            "qdata": (pairs[..., 0] << 4) | pairs[..., 1],
            "scaler": scaler.to(torch.int8),
            "factor": factor,
            "mean": mean,
        }

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        mean, factor = inner["mean"], inner["factor"]
        scale = (inner["scaler"] / factor).to(mean.dtype) + mean
        # A finite block of a weight near the dtype's max may round its scale past it: keep it finite
        # (a factor of 0 or NaN comes from an Inf or NaN weight, and stays non-finite).
        big = torch.finfo(mean.dtype).max
        scale = torch.where(factor.isfinite() & (factor > 0), scale.clamp(-big, big), scale)
        qdata = inner["qdata"]
        codes = torch.stack([qdata >> 4, qdata & 0xF], dim=-1).long().flatten(-2)  # scale broadcasts over it
        if any(c != s and s != 1 for c, s in zip(codes.shape[-2:], scale.shape[-2:])):
            # codes packed across rows (odd widths; the scales then vary per element): in flat order
            codes = codes.reshape(*codes.shape[:-2], *scale.shape[-2:])
        levels = torch.tensor(NF4_LEVELS, dtype=mean.dtype, device=qdata.device)
        return (levels[codes] * scale).to(dtype)

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """On the flat index: levels by table lookup (one per byte), times each block's scale.

        Every inner tensor, whatever its relations, stores its blocks in flat
        row-major order, so the scales are computed once per block (not per
        element) and broadcast over it. Needs whole scaler blocks.
        """
        scale = self.block_scales(inner, out.numel())
        if scale is None:
            return False
        mean = inner["mean"]
        fits = out.dtype == mean.dtype and out.is_contiguous()
        values = out if fits else torch.empty(out.shape, dtype=mean.dtype, device=out.device)
        nibbles_into(inner["qdata"], NF4_LEVELS, values, high_first=True)
        values.view(-1, self.block_size).mul_(scale.unsqueeze(-1))
        if not fits:
            out.copy_(values)
        return True

    def block_scales(self, inner: dict[str, torch.Tensor], numel: int) -> torch.Tensor | None:
        """Each block's dequantized scale, in flat order (the weight's dtype); None unless the blocks are whole."""
        mean, scaler, factor = inner["mean"], inner["scaler"].reshape(-1), inner["factor"].reshape(-1)
        if numel % self.block_size or scaler.numel() != numel // self.block_size or inner["qdata"].numel() * 2 != numel:
            return None
        per_scaler = factor.repeat_interleave(self.scaler_block_size).narrow(0, 0, scaler.numel())
        scale = (scaler / per_scaler).to(mean.dtype) + mean.reshape(())
        big = torch.finfo(mean.dtype).max  # the same clamp as dequantize: finite weights stay finite
        return torch.where(per_scaler.isfinite() & (per_scaler > 0), scale.clamp(-big, big), scale)

    # The kernels (nf4.cpp, built by dtensor_quant._core.native). One token: each block's 16 weights
    # bf16(level * scale) are one AVX-512 register (two with AVX2), each code picks its weight with vpermps, an FMA
    # adds weight * x in fp32: the codes are read once per token. More tokens: the tiles of native_tiles.h, each
    # weight dequantized once into a buffer in cache. No dense weight is ever written. The kernel reads its blocks
    # in flat order, so it needs a weight laid out as a fresh one of its shape:
    kernel_needs_whole_blocks = True

    def prepare(self, inner):
        """The kernels' inputs, built by the first call that runs one (:class:`~dtensor_quant._core.native.Lazy`)."""
        return native.Lazy(functools.partial(self.kernel_inputs, inner))

    def kernel_inputs(self, inner):
        """``(codes, block scales in fp32, levels in fp32, rounds)`` for the kernels, or None where they cannot run.

        ``rounds``: the weight is bf16, so dequantize rounds every weight to bf16
        whatever the activations. The kernels need whole blocks inside each row
        (``in % block_size == 0``, the library checks the rest:
        ``kernel_needs_whole_blocks``), a bf16 or fp32 weight (fp16 rounds each
        product to fp16 before the activation's dtype), and an x86 CPU with AVX2
        or AVX-512 where they were built.
        """
        dtype = inner["mean"].dtype
        if dtype not in _KERNEL_WEIGHT_DTYPES:
            return None
        return flat_kernel_inputs(self, inner, NF4_LEVELS, dtype, rounds=dtype == torch.bfloat16)

    def linear(self, x, prepared, bias):
        """bf16 or fp32 activations: the one-token kernel for one bf16 token, the tiles for up to
        ``native.TILES_MAX_TOKENS``; else None (dequantize + mm)."""
        return kernel_linear(x, prepared, bias, self.block_size)

    def __str__(self) -> str:
        return f"NF4(block_size={self.block_size}, scaler_block_size={self.scaler_block_size})"


def flat_kernel_inputs(fmt, inner: dict[str, torch.Tensor], levels: tuple[float, ...], dtype, rounds: bool):
    """``(codes, block scales in fp32, levels in fp32, rounds)`` for NF4's kernels, or None where they cannot run.

    For a format of 4-bit codes over the flat weight (NF4, BnbNF4, NF4BlockScales) whose
    ``fmt.block_scales(inner, numel)`` gives each block's scale as its dequantize computes it; ``levels`` are
    the format's table, rounded to ``dtype`` as its dequantize holds them. The kernels need whole blocks
    inside each row (``in % block_size == 0``, ``block_size % 32 == 0``; the library checks the rest:
    ``kernel_needs_whole_blocks``) and an x86 CPU with AVX2 or AVX-512 where they were built.
    """
    qdata, bs = inner["qdata"], fmt.block_size
    if qdata.device.type != "cpu" or qdata.ndim != 2 or bs % 32:
        return None
    rows, cols = qdata.shape[0], qdata.shape[1] * 2
    if not rows or cols % bs or kernel() is None:
        return None
    scale = fmt.block_scales(inner, rows * cols)
    if scale is None:
        return None
    scale = scale.float().reshape(rows, cols // bs).contiguous()
    return qdata.contiguous(), scale, torch.tensor(levels, dtype=dtype).float(), rounds


def nearest_codes(normalized: torch.Tensor) -> torch.Tensor:
    """The index of the NF4 level nearest each value (ties to the lower level), as uint8."""
    levels = torch.tensor(NF4_LEVELS, dtype=normalized.dtype, device=normalized.device)
    return (normalized.unsqueeze(-1) - levels).abs().min(dim=-1).indices.to(torch.uint8)


# fp16 weights round each product to fp16 first; the kernels round once, to bf16.
_KERNEL_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)
# The one-token kernel reads the codes once per token: from 2 tokens on the tiles, which read them once, win.
_ONE_TOKEN_MAX = 1

KERNEL = native.declare("nf4", Path(__file__).with_name("nf4.cpp"), native.MATMUL_PROBE | {"bs": 64})


def kernel():
    """``(the kernels' entry point, the best vector level of the tiles here)``, built on first use; None where it
    cannot run. Levels: 1 AVX2, 2 AVX-512, 3 AVX-512 BF16, 4 AMX (the one-token kernel stops at 2)."""
    return native.load(KERNEL)


def _check_width(x: torch.Tensor, codes: torch.Tensor) -> None:
    if x.shape[1] != codes.shape[1] * 2:
        raise ValueError(f"NF4 kernel: activation width {x.shape[1]} != weight width {codes.shape[1] * 2}")


def fused_linear(x: torch.Tensor, prepared, block_size: int, max_level: int | None = None) -> torch.Tensor | None:
    """``x @ W.T`` in bf16 through the one-token kernel, from :meth:`NF4.kernel_inputs` (bf16 ``x``, one pass over
    the codes per token); None if refused. ``max_level`` caps the vector path (1: AVX2, 2: AVX-512)."""
    codes, scale, levels, _ = prepared
    _check_width(x, codes)
    return native.matmul(
        kernel(), (codes, scale, levels), x, codes.shape[0], (block_size,), tiles=False, max_level=max_level
    )


def tiled_linear(x: torch.Tensor, prepared, block_size: int, max_level: int | None = None) -> torch.Tensor | None:
    """``x @ W.T`` in ``x``'s dtype (bf16 or fp32) through the tiled kernel (native_tiles.h: each weight dequantized
    once into a tile in cache), from :meth:`NF4.kernel_inputs`; None if refused. ``max_level`` caps the vector path
    (1: AVX2, 2: AVX-512, 3: AVX-512 BF16, 4: AMX, bf16 ``x`` only)."""
    codes, scale, levels, rounds = prepared
    _check_width(x, codes)
    rounds = rounds or x.dtype == torch.bfloat16
    return native.matmul(
        kernel(),
        (codes, scale, levels),
        x,
        codes.shape[0],
        (block_size,),
        tiles=True,
        round_weights=rounds,
        max_level=max_level,
    )


def kernel_linear(x: torch.Tensor, prepared, bias, block_size: int) -> torch.Tensor | None:
    """``linear`` of every format that runs NF4's kernels (NF4, BnbNF4, MXFP4), from a
    :class:`~dtensor_quant._core.native.Lazy` of ``(codes, block scales, levels, rounds)``: the one-token kernel
    for one bf16 token, the tiles for bf16 or fp32 activations up to ``native.TILES_MAX_TOKENS``; else None."""
    inputs = native.inputs_for(x, prepared)
    if inputs is None:
        return None
    if x.dtype == torch.bfloat16 and x.shape[0] <= _ONE_TOKEN_MAX:
        out = fused_linear(x, inputs, block_size)
    else:
        out = tiled_linear(x, inputs, block_size)
    return out + bias if bias is not None and out is not None else out
