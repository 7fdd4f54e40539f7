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

Quantize (min-max, the range widened to include 0 as compressed-tensors'
observer does): ``scale = (max - min) / 15`` rounded up to the scale's dtype
(no code clips), ``z = round(-min / scale)``, ``q = clamp(round(w / scale) +
z, 0, 15)``. A group with NaN or Inf gets a NaN scale and dequantizes to NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.format import QuantFormat, Reducer, compact_repr, dtype_param
from ..core.layout import Blocked, OneToOne, Packed
from ..core.reductions import block_reduce, expand_blocks, nibbles_into

_CODES = tuple(float(c) for c in range(16))


def _round_up(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest ``dtype`` value >= ``x64`` (float64), or the dtype's largest finite value if none."""
    y = x64.to(dtype)
    y = torch.where(y.double() < x64, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
    return y.clamp(max=torch.finfo(dtype).max)


@dataclass(frozen=True)
class Int4GroupwiseIntZero(QuantFormat):
    group_size: int = 128
    #: The dtype of ``scale`` (None: the weight's): fp16 for AWQ and GPTQ, bf16 for compressed-tensors.
    scale_dtype: torch.dtype | None = None

    block_size_params = ("group_size",)

    def __post_init__(self):
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
        lo = reduce(block_reduce(weight, 1, g, "min"), "min", "scale").double().clamp(max=0)
        hi = reduce(block_reduce(weight, 1, g, "max"), "max", "scale").double().clamp(min=0)
        finite = lo.isfinite() & hi.isfinite()
        tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
        scale = _round_up(((hi - lo) / 15).clamp(min=tiny), dtype)
        if not weight.is_meta:  # a model built on "meta" has no values to fit
            scale = self._fit_range(scale, lo, finite, dtype)
        zero = torch.where(finite, (-lo / scale.double()).round().clamp(0, 15), 0)
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
        codes = (weight.float() / expand_blocks(scale.float(), 1, g, n_in)).round()
        codes = codes + expand_blocks(zero.float(), 1, g, n_in)
        q = torch.where(codes.isnan(), 0, codes).clamp(0, 15).to(torch.uint8)
        return {"qdata": q[:, ::2] | (q[:, 1::2] << 4), "scale": scale, "zero": zero.to(torch.uint8)}

    @staticmethod
    def _fit_range(scale, lo, finite, dtype):
        """Shrink ``scale`` where an end code would dequantize past ``dtype``'s range (Inf).

        ``(q - z) * scale`` reaches ``max(z, 15 - z) * scale``: a group as wide
        as the dtype's range (fp16 weights near +-65504, or fp16 scales for
        larger weights) gets the widest scale that keeps it finite and clips
        its far end, as rounding to the scale's dtype could otherwise give Inf.
        """
        big = torch.finfo(dtype).max
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

    def __str__(self) -> str:
        return compact_repr(self).replace("torch.", "")
