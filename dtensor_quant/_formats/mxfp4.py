"""MXFP4: OCP microscaling FP4, e2m1 codes with one power-of-two (e8m0) scale per 32 inputs.

The layout of compressed-tensors' ``mxfp4-pack-quantized`` checkpoints
(``weight_packed`` uint8 ``[out, in/2]``, ``weight_scale`` uint8 ``[out,
in/32]``) and of gpt-oss's MXFP4 experts (``*_blocks`` uint8 ``[E, out, in/32,
16]``, the same bytes, and ``*_scales`` uint8 ``[E, out, in/32]``): a loader
copies their bytes as they are.

Layout: ``qdata`` uint8 ``[out, in/2]`` holds two e2m1 codes per byte along
``in`` (the even index in the low nibble; bit 3 of a code is its sign, bits
0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6); ``scale`` uint8 ``[out, in/32]`` holds
one biased exponent ``e`` per 32 inputs (``2 ** (e - 127)``; 255 is NaN in
the OCP spec and ``2 ** 128 = inf`` in every reference dequantizer, so a
block with it dequantizes to +-Inf, or NaN for a zero code). ``in`` must be a
multiple of 32, so column shards start on a block; a fused expert stack
``[E, out, in]`` shards along its experts like any format.

Math: ``w = e2m1[code] * 2 ** (e - 127)``. The product is exact in float32
and in bfloat16 (a 2-bit significand times a power of two within their
exponent range), so rounding it once into the output dtype is what
transformers' ``convert_moe_packed_tensors`` (``ldexp`` in the model's dtype)
and compressed-tensors' decompressor (bf16 ``q * scale``) compute.

Quantize, as compressed-tensors' and vLLM's reference quantizer: the block's
absolute maximum rounded to a power of two (up when its significand is at
least 1.75), minus 2 (e2m1's largest exponent) gives the scale's exponent,
clamped to the e8m0 range; each value divided by the scale rounds to the
nearest e2m1 value, ties to even, saturating at +-6. An all-zero block gets
exponent 0. The block maximum is over finite values, so an Inf saturates at
+-6 times its block's scale and the rest of the block keeps its precision; a
block with a NaN gets exponent 255 and code 0 throughout, so every value of it
is 0 * inf = NaN in every reference dequantizer (a nonzero code would read
+-Inf).

Kernels: NF4's (the one-token kernel for one bf16 token, the tiles for more
and for fp32 activations) with the e2m1 values as levels and each block's
power of two as its scale, on a nibble-swapped copy of the codes: each
weight they use is ``dequantize``'s value bit for bit
(tests/core/test_native.py, tests/core/test_native_tiles.py). Where the reference would
round a finite block past the weight dtype's maximum (fp16 weights near
65504; 6 * 2**126 in bf16 or fp32) the block takes the next smaller exponent
and saturates, so finite weights never dequantize to Inf.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._core import native
from .._core.format import QuantFormat, Reducer
from .._core.layout import Blocked, OneToOne, Packed
from .._core.producers import COMPRESSED_TENSORS, CT_BASE_ARGS, GPT_OSS_MXFP4, Holds, ProducerLayout, StoredAs
from .._core.reductions import block_reduce, block_stat_abs, expand_blocks, nibbles_into
from .nf4 import kernel as nf4_kernel
from .nf4 import kernel_linear

#: The e2m1 values of codes 0-15 (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
# Round to nearest, ties to even, on |x|: the code counts the boundaries below it; ties at the
# boundaries 0.25, 1.25, 2.5 and 5 go down (to 0, 1, 2, 4), at 0.75, 1.75 and 3.5 up (to 1, 2, 4).
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)

_SCALES: dict = {}


def scale_values(device) -> torch.Tensor:
    """``2 ** (e - 127)`` in float32 for each of the 256 exponents (2 ** -127 is subnormal; 255 gives inf)."""
    key = str(device)
    if key not in _SCALES:
        exps = torch.arange(256, dtype=torch.float64, device=device) - 127
        _SCALES[key] = torch.exp2(exps).to(torch.float32)
    return _SCALES[key]


@dataclass(frozen=True)
class MXFP4(QuantFormat):
    layout = {"qdata": (OneToOne(), Packed(2)), "scale": (OneToOne(), Blocked(BLOCK))}
    block_size = BLOCK  # values per scale: the OCP block, a constant rather than a parameter
    block_size_params = ()  # so nothing for the planner to shrink

    producer_notes = {COMPRESSED_TENSORS: "MXFP4"}
    #: compressed-tensors' mxfp4 and gpt-oss's MXFP4 experts: the OCP codes and e8m0 exponents as they are.
    producer_holds = (
        Holds(COMPRESSED_TENSORS, ("mxfp4-pack-quantized",), (("num_bits", 4), ("type", "float"),
              ("strategy", "group"), ("group_size", BLOCK), ("symmetric", True), ("scale_dtype", torch.uint8))),
        Holds(GPT_OSS_MXFP4, ("experts",)),
    )  # fmt: skip

    def producer_layout(self, producer, dtype):
        """compressed-tensors: mxfp4 (``mxfp4-pack-quantized``): codes and e8m0 exponents as they are, any model
        dtype. gpt-oss: each expert's codes as ``{key}_blocks`` ``[..., in/32, 16]``, the exponents as
        ``{key}_scales``."""
        if producer == GPT_OSS_MXFP4:
            inner = (("qdata", StoredAs("reshaped", "{key}_blocks", torch.uint8, (("inner", 16),))),
                     ("scale", StoredAs("same", "{key}_scales", torch.uint8)))  # fmt: skip
            return ProducerLayout(producer, "experts", {}, inner)
        if producer != COMPRESSED_TENSORS:
            return None
        args = dict(CT_BASE_ARGS, num_bits=4, type="float", strategy="group", group_size=BLOCK)
        args["scale_dtype"] = "torch.uint8"
        inner = (("qdata", StoredAs("same", "{key}_packed", torch.uint8)),
                 ("scale", StoredAs("same", "{key}_scale", torch.uint8)))  # fmt: skip
        return ProducerLayout(producer, "mxfp4-pack-quantized", args, inner)

    def check_shape(self, shape):
        super().check_shape(shape)
        if shape[1] % BLOCK:
            raise ValueError(
                f"{self}: dim 1 of a {tuple(shape)} weight is not a multiple of {BLOCK} (one e8m0 scale per "
                f"{BLOCK} values); pad it (dtensor_quant.pad_for_tp) or use another format"
            )

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        amax = reduce(block_reduce(block_stat_abs(weight), 1, BLOCK, "max"), "max", "scale")  # Inf saturates at 6
        mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2 ** exponent, mantissa in [0.5, 1)
        biased = exponent - 1 + (mantissa >= 0.875).int() - 2 + 127  # floor(log2) rounded up from 1.75
        biased = torch.where(amax == 0, 0, biased.clamp(0, 254))
        biased = torch.where(amax.isfinite(), biased, 255)
        codes = self._codes(weight, biased)
        if not weight.is_meta:
            # A block whose largest value rounds past the weight dtype's maximum (fp16 near 65504, or
            # bf16/fp32 near 3.4e38, where the reference's scale would be 2**126 and 6 * 2**126 is Inf)
            # takes the next smaller scale: its top values saturate at 6 instead of dequantizing to Inf.
            top = block_reduce(self._values(codes, biased).abs(), 1, BLOCK, "max")
            over = amax.isfinite() & (top > torch.finfo(weight.dtype).max)
            if bool(over.any()):
                biased = torch.where(over, biased - 1, biased)
                codes = self._codes(weight, biased)
        return {"qdata": codes[:, ::2] | (codes[:, 1::2] << 4), "scale": biased.to(torch.uint8)}

    @staticmethod
    def _codes(weight: torch.Tensor, biased: torch.Tensor) -> torch.Tensor:
        """Each value over its block's power of two, rounded to the nearest e2m1 code (ties to even)."""
        inverse = torch.exp2(127 - biased.double()).float()  # exact powers of two
        x = weight.float() * expand_blocks(inverse, 1, BLOCK, weight.shape[1])
        mag = x.abs()
        index = sum((mag > b).int() for b in _TIES_DOWN) + sum((mag >= b).int() for b in _TIES_UP)
        codes = (torch.where(x < 0, 8, 0) + index).to(torch.uint8)
        poisoned = expand_blocks(biased == 255, 1, BLOCK, weight.shape[1])  # code 0: NaN (0 * inf) throughout
        return torch.where(x.isnan() | poisoned, 0, codes).to(torch.uint8)

    @staticmethod
    def _values(codes: torch.Tensor, biased: torch.Tensor) -> torch.Tensor:
        """Unpacked codes ``[out, in]`` and exponents ``[out, in/32]`` -> the values in float64 (exact)."""
        values = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=codes.device)[codes.long()]
        return values * expand_blocks(torch.exp2(biased.double() - 127), 1, BLOCK, codes.shape[1])

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        packed, device = inner["qdata"], inner["qdata"].device
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)[codes]
        return (values * scale_values(device)[inner["scale"].long()]).to(dtype)

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """Codes by table lookup (one per byte) in fp32, times each block's power of two, as ``dequantize``."""
        fits = out.dtype == torch.float32 and out.is_contiguous()
        values = out if fits else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        nibbles_into(inner["qdata"], E2M1_VALUES, values, high_first=False)
        scale = scale_values(out.device)[inner["scale"].long()]
        values.view(out.shape[0], -1, BLOCK).mul_(scale.unsqueeze(-1))
        if not fits:
            out.copy_(values)
        return True

    # NF4's kernels (dtensor_quant._formats.nf4) compute each weight as level * scale in fp32 (rounded to bf16 for
    # bf16 activations) from 16 float32 levels and one float32 scale per block of 32 or more: with the e2m1 values
    # and each block's power of two that is dequantize's value. They read a byte's first value from its high nibble.

    def prepare(self, inner):
        """The fused kernel's inputs, built by the first call that runs it (``native.Lazy``)."""
        return native.Lazy(functools.partial(self.kernel_inputs, inner))

    def kernel_inputs(self, inner):
        """``(codes high nibble first, block scales in float32, levels in float32, rounds)``, or None where NF4's
        kernels cannot run."""
        qdata = inner["qdata"]
        if qdata.device.type != "cpu" or qdata.ndim != 2 or not qdata.shape[0] or nf4_kernel() is None:
            return None
        rows, cols = qdata.shape[0], qdata.shape[1] * 2
        if tuple(inner["scale"].shape) != (rows, cols // BLOCK):
            return None
        swapped = ((qdata << 4) | (qdata >> 4)).contiguous()
        scale = scale_values(qdata.device)[inner["scale"].long()].contiguous()
        # dequantize rounds the fp32 product once, to the output's dtype: only bf16 activations round to bf16
        return swapped, scale, torch.tensor(E2M1_VALUES, dtype=torch.float32), False

    def linear(self, x, prepared, bias):
        """NF4's kernels: one bf16 token through the one-token kernel, bf16 or fp32 activations up to
        ``native.TILES_MAX_TOKENS`` through the tiles; else None (dequantize + mm)."""
        return kernel_linear(x, prepared, bias, BLOCK)

    def __str__(self) -> str:
        return "MXFP4()"
