"""Int4GroupwiseIntZero: 4-bit codes with a scale and an *integer* zero point per group of inputs.

The layout pre-quantized asymmetric int4 checkpoints hold, whatever their
packing: compressed-tensors' asymmetric ``pack-quantized`` (``weight_packed``,
``weight_scale``, ``weight_zero_point``), AutoAWQ's GEMM (``qweight``,
``qzeros``, ``scales``) and GPTQ's (``qweight``, ``qzeros`` holding z - 1,
``scales``). A loader repacks their words into these bytes without touching a
value.

Layout: ``qdata`` uint8 ``[out, in/2]`` holds two unsigned codes ``q`` in
``[0, 15]`` per byte along ``in`` (even index in the low nibble, as
:class:`~dtensor_quant.Int4Groupwise` and compressed-tensors' int32 words
store them); ``scale`` ``[out, ceil(in/group_size)]`` (the weight's dtype, or
``scale_dtype``) and ``zero`` uint8 ``[out, ceil(in/group_size)]`` hold one
value per group along ``in``. The zero point is in the codes' domain and may
be anything a uint8 holds: GPTQ v1 checkpoints store ``z - 1`` in four bits,
which reads back as ``z`` in ``[1, 16]``.

Math, the producers' own (compressed-tensors ``(q - z) * scale`` in the
scale's dtype, AWQ and GPTQ ``(q - z) * scales`` in fp16)::

    w ~= scale_dtype((q - z) * scale), then converted to the output dtype

``q - z`` is an exact small integer and its product with a 16-bit scale is
exact in float32, so rounding that once to the scale's dtype is bit-equal
to computing it in the scale's dtype. A compressed-tensors code ``q_ct`` in
``[-8, 7]`` with zero ``z_ct`` is ``q = q_ct + 8``, ``z = z_ct + 8`` here.

Kernels (int4_zero.cpp, built once per machine by
:mod:`~dtensor_quant._core.native`): a fused one-token ``x @ W.T`` (one bf16
token) and the tiled matmul of ``_core/native_tiles.h`` (more tokens, fp32
activations), whose every weight is ``dequantize``'s value bit for bit, fp16
scales rounded there first (tests/core/test_native.py,
tests/core/test_native_tiles.py).

Quantize (min-max, the range widened to include 0 as compressed-tensors'
observer does): ``scale = (max - min) / 15`` rounded up to the scale's dtype
(no code clips), ``z = round(-min / scale)``, ``q = clamp(round(w / scale) +
z, 0, 15)``. A group with a NaN gets a NaN scale and dequantizes to NaN; an Inf
does not enter min and max (its group's range is its finite values' and 0)
and saturates to code 0 or 15. Weights beyond what the scale dtype gives back
finite in the weight's dtype (fp16 scales of larger weights) saturate there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .._core import native
from .._core.format import QuantFormat, Reducer, compact_repr, dtype_param, int_params
from .._core.layout import Blocked, OneToOne, Packed
from .._core.producers import (
    AWQ,
    COMPRESSED_TENSORS,
    CT_BASE_ARGS,
    GPTQ,
    Holds,
    ProducerLayout,
    StoredAs,
    scales_in_model_dtype,
)
from .._core.reductions import block_reduce, expand_blocks, finite_or_nan, largest_finite, nibbles_into

_CODES = tuple(float(c) for c in range(16))


def _round_up(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest ``dtype`` value >= ``x64`` (float64), or the dtype's largest finite value if none."""
    y = x64.to(dtype)
    y = torch.where(y.double() < x64, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
    return y.clamp(max=torch.finfo(dtype).max)


#: AWQ's order of the eight codes in an int32 word: code ``_AWQ_ORDER[i]`` sits at bits ``4i``.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Int4GroupwiseIntZero(QuantFormat):
    group_size: int = 128
    #: The dtype of ``scale`` (None: the weight's): fp16 for AWQ and GPTQ, bf16 for compressed-tensors.
    scale_dtype: torch.dtype | None = None

    block_size_params = ("group_size",)

    producer_notes = {COMPRESSED_TENSORS: "Int4GroupwiseIntZero"}
    #: compressed-tensors' asymmetric int4 groups (zero points stored z + 8: the nibble is the codes' zero),
    #: GPTQ v1 and AWQ GEMM: 4-bit codes and integer zero points, scales per group of the inputs.
    producer_holds = (
        Holds(COMPRESSED_TENSORS, ("pack-quantized",), (("num_bits", 4), ("type", "int"), ("strategy", "group"),
              ("symmetric", False)), ("group_size", "scale_dtype")),
        Holds(GPTQ, ("gptq",), (("num_bits", 4),), ("group_size", "scale_dtype")),
        Holds(AWQ, ("gemm",), (("num_bits", 4), ("zero_point", True)), ("group_size", "scale_dtype")),
    )  # fmt: skip

    def producer_layout(self, producer, dtype):
        """compressed-tensors: int4, asymmetric groups (``pack-quantized``): the codes in int32 words, the scales in
        the model's dtype, the integer zero points packed eight per int32 along the rows.

        GPTQ and AWQ keep ``[in, out]`` orientation and pack eight 4-bit codes per int32: GPTQ's ``qweight``
        ``[in/8, out]`` (along the inputs, code i at bits 4i), AWQ's ``[in, out/8]`` (along the outputs, in AWQ's
        interleaved order); zero points ``[in/g, out/8]`` along the outputs (GPTQ stores z - 1); ``scales``
        ``[in/g, out]``: all transposed into this format's ``[out, in]`` rows, losslessly.
        """
        if producer in (GPTQ, AWQ):
            sd, gptq = self.scale_dtype or dtype, producer == GPTQ
            order = (0, 1, 2, 3, 4, 5, 6, 7) if gptq else _AWQ_ORDER
            codes = StoredAs("packed_codes", "{base}.qweight", torch.int32,
                             (("along", 0 if gptq else 1), ("transposed", True), ("order", order)))  # fmt: skip
            zero = StoredAs("packed_codes", "{base}.qzeros", torch.int32, (("along", 1), ("transposed", True),
                            ("order", order), ("add", 1 if gptq else 0), ("unpacked", True)))  # fmt: skip
            inner = (("qdata", codes), ("scale", StoredAs("transposed", "{base}.scales", sd)), ("zero", zero))
            args = {"bits": 4, "group_size": self.group_size}
            return ProducerLayout(producer, "gptq" if gptq else "gemm", args, inner)
        if producer != COMPRESSED_TENSORS:
            return None
        sd = self.scale_dtype or dtype
        args = dict(CT_BASE_ARGS, num_bits=4, type="int", strategy="group", group_size=self.group_size)
        args["symmetric"] = False
        zero = StoredAs("packed_codes", "{key}_zero_point", torch.int32, (("along", 0), ("unpacked", True)))
        inner = (("qdata", StoredAs("words", "{key}_packed", torch.int32)),
                 ("scale", StoredAs("same", "{key}_scale", sd)), ("zero", zero))  # fmt: skip
        layout = ProducerLayout(producer, "pack-quantized", args, inner, records=("weight_shape",))
        return scales_in_model_dtype(sd, dtype) or layout

    def __post_init__(self):
        int_params(self)
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"Int4GroupwiseIntZero needs an even group_size >= 2, got {self.group_size}")
        dtype_param(self, "scale_dtype")

    __repr__ = compact_repr

    @property
    def layout(self):
        g = self.group_size
        return {
            "qdata": (OneToOne(), Packed(2)),
            "scale": (OneToOne(), Blocked(g)),
            "zero": (OneToOne(), Blocked(g)),
        }

    def check_shape(self, shape):
        super().check_shape(shape)
        if shape[1] % 2:
            raise ValueError(f"{self} packs two values per byte along dim 1, which must be even; got {tuple(shape)}")

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        g, n_in, dtype = self.group_size, weight.shape[1], self.scale_dtype or weight.dtype
        stat = finite_or_nan(weight)  # an Inf does not set its group's range: it saturates to code 0 or 15
        lo = reduce(block_reduce(stat, 1, g, "min"), "min", "scale").double().clamp(max=0)
        hi = reduce(block_reduce(stat, 1, g, "max"), "max", "scale").double().clamp(min=0)
        # weights beyond what the scale dtype can give back in the weight's dtype saturate there
        limit = largest_finite(dtype, weight.dtype)
        lo, hi = lo.clamp(min=-limit), hi.clamp(max=limit)
        finite = lo.isfinite() & hi.isfinite()
        tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
        scale = _round_up(((hi - lo) / 15).clamp(min=tiny), dtype)
        if not weight.is_meta:  # a model built on "meta" has no values to fit
            scale = self._fit_range(scale, lo, finite, dtype, limit)
        zero = torch.where(finite, (-lo / scale.double()).round().clamp(0, 15), 0)
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
        codes = (weight.float() / expand_blocks(scale.float(), 1, g, n_in)).round()
        codes = codes + expand_blocks(zero.float(), 1, g, n_in)
        q = torch.where(codes.isnan(), 0, codes).clamp(0, 15).to(torch.uint8)
        return {"qdata": q[:, ::2] | (q[:, 1::2] << 4), "scale": scale, "zero": zero.to(torch.uint8)}

    @staticmethod
    def _fit_range(scale, lo, finite, dtype, big):
        """Shrink ``scale`` (in ``dtype``) where an end code would dequantize past ``big`` (Inf in the scale's or
        the weight's dtype: ``largest_finite``).

        ``(q - z) * scale`` reaches ``max(z, 15 - z) * scale``: a group as wide
        as the dtype's range (fp16 weights near +-65504, or fp16 scales for
        larger weights) gets the widest scale that keeps it finite and clips
        its far end, as rounding to the scale's dtype could otherwise give Inf.
        """
        for _ in range(4):  # z moves with the scale; two rounds settle it
            zero = (-lo / scale.double()).round().clamp(0, 15)
            reach = torch.maximum(zero, 15 - zero)
            bad = finite & (reach * scale.double() > big)
            if not bool(bad.any()):
                break
            fit = (big / reach).to(dtype)
            fit = torch.where(fit.double() * reach > big, torch.nextafter(fit, torch.zeros_like(fit)), fit)
            scale = torch.where(bad, fit, scale)
        return scale

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        packed, scale = inner["qdata"], inner["scale"]
        q = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float()
        return ((q - inner["zero"].float()) * scale.float()).to(scale.dtype).to(dtype)

    def unpack(self, inner: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
        """Codes by table lookup (one per byte) in fp32, minus each group's zero, times its scale, as ``dequantize``."""
        scale, rows = inner["scale"], out.shape[0]
        fits = out.dtype == torch.float32 == scale.dtype and out.is_contiguous()
        values = out if fits else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        nibbles_into(inner["qdata"], _CODES, values, high_first=False)
        grouped = values.view(rows, -1, self.group_size)
        grouped.sub_(inner["zero"].float().unsqueeze(-1)).mul_(scale.float().unsqueeze(-1))
        if not fits:
            out.copy_(values if out.dtype == scale.dtype else values.to(scale.dtype))
        return True

    def prepare(self, inner):
        """The fused kernel's inputs, built by the first call that runs it (``native.Lazy``)."""
        return native.Lazy(functools.partial(self.kernel_inputs, inner))

    def kernel_inputs(self, inner):
        """``(codes, scales and zeros in float32 [out, in/g], round to fp16, round to bf16)``, or None where they
        cannot run.

        The kernel needs whole groups (``in % group_size == 0``), ``group_size % 32 == 0``, a
        bf16, fp16 or fp32 scale and an x86 CPU with AVX2 (and F16C) or AVX-512.
        """
        qdata, scale, g = inner["qdata"], inner["scale"], self.group_size
        if qdata.device.type != "cpu" or qdata.ndim != 2 or g % 32 or scale.dtype not in _KERNEL_SCALE_DTYPES:
            return None
        rows, cols = qdata.shape[0], qdata.shape[1] * 2
        if not rows or cols % g or tuple(scale.shape) != (rows, cols // g) or kernel() is None:
            return None
        half = int(scale.dtype == torch.float16)  # bf16 and fp32 products need no rounding before bf16's
        rounds = scale.dtype == torch.bfloat16  # dequantize rounds to bf16 whatever the activations
        return qdata.contiguous(), scale.float().contiguous(), inner["zero"].float().contiguous(), half, rounds

    def linear(self, x, prepared, bias):
        """bf16 or fp32 activations: the one-token kernel for one bf16 token, the tiles for up to
        ``native.TILES_MAX_TOKENS``; else None (dequantize + mm)."""
        inputs = native.inputs_for(x, prepared)
        if inputs is None:
            return None
        if x.dtype == torch.bfloat16 and x.shape[0] <= _ONE_TOKEN_MAX:
            out = fused_linear(x, inputs, self.group_size)
        else:
            out = tiled_linear(x, inputs, self.group_size)
        return out + bias if bias is not None and out is not None else out

    def __str__(self) -> str:
        return compact_repr(self).replace("torch.", "")


_KERNEL_SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The one-token kernel reads the codes once per token: from 2 tokens on the tiles, which read them once, win.
_ONE_TOKEN_MAX = 1

# The kernels (int4_zero.cpp). Per group: the 16 weights its codes can stand for, scale_dtype((c - z) * s) for
# c = 0..15 -- (c - z) * s is exact in fp32, fp16 scales round there first, as dequantize does -- in one AVX-512
# register (two with AVX2), each code picking its weight with a permute: multiplied by x as they are made (one
# token) or written into the tiles of _core/native_tiles.h (more tokens). No dense weight is written.
KERNEL = native.declare("int4_zero", Path(__file__).with_name("int4_zero.cpp"), native.MATMUL_PROBE | {"g": 32})


def kernel():
    """``(the kernels' entry point, the best vector level of the tiles here)``, built on first use; None where it
    cannot run. Levels: 1 AVX2, 2 AVX-512, 3 AVX-512 BF16, 4 AMX (the one-token kernel stops at 2)."""
    return native.load(KERNEL)


def _matmul(x, prepared, group_size, tiles, max_level):
    codes, scale, zero, half, rounds = prepared
    k = codes.shape[1] * 2
    if x.shape[1] != k:
        raise ValueError(f"Int4GroupwiseIntZero kernel: activation width {x.shape[1]} != weight width {k}")
    rounds = rounds or x.dtype == torch.bfloat16
    return native.matmul(
        kernel(), (codes, scale, zero), x, codes.shape[0], (group_size, half), tiles=tiles, round_weights=rounds,
        max_level=max_level,
    )  # fmt: skip


def fused_linear(x: torch.Tensor, prepared, group_size: int, max_level: int | None = None) -> torch.Tensor | None:
    """``x @ W.T`` in bf16 through the one-token kernel, from :meth:`Int4GroupwiseIntZero.kernel_inputs` (bf16
    ``x``); None if refused. ``max_level`` caps the vector path (1: AVX2, 2: AVX-512; default: the best here)."""
    return _matmul(x, prepared, group_size, False, max_level)


def tiled_linear(x: torch.Tensor, prepared, group_size: int, max_level: int | None = None) -> torch.Tensor | None:
    """``x @ W.T`` in ``x``'s dtype (bf16 or fp32) through the tiled kernel (_core/native_tiles.h), from
    :meth:`Int4GroupwiseIntZero.kernel_inputs`; None if refused. ``max_level`` caps the vector path (1: AVX2,
    2: AVX-512, 3: AVX-512 BF16, 4: AMX, bf16 ``x`` only)."""
    return _matmul(x, prepared, group_size, True, max_level)
