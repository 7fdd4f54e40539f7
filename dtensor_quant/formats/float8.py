"""Float8Rowwise and Float8Tensorwise: e4m3fn values with one scale per row, or one in all.

Layout: ``qdata`` float8_e4m3fn ``[out, in]`` follows both dims one-to-one;
``scale`` (the weight's dtype) is ``[out, 1]`` (one-to-one on rows, constant
on columns) or ``[1, 1]`` (constant everywhere: never sent by a collective,
and all-reduced over every sharded mesh dim when a sharded weight is
quantized). Collectives move the float8 bytes as uint8: gloo has no float8.

Math: ``q = clamp(w / scale, +-448)`` rounded to e4m3fn with ``scale =
amax / 448``; ``w ~= float(q) * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks import block_reduce, safe_scale, scaled_into
from ..format import QuantFormat, Reducer
from ..layout import Constant, OneToOne

_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def _quantize(weight: torch.Tensor, amax: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = safe_scale(amax, _E4M3_MAX, weight.dtype)
    q = (weight.float() / scale.float()).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return {"qdata": q, "scale": scale}


def _dequantize(inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return (inner["qdata"].float() * inner["scale"].float()).to(dtype)


@dataclass(frozen=True)
class Float8Rowwise(QuantFormat):
    layout = {"qdata": (OneToOne(), OneToOne()), "scale": (OneToOne(), Constant())}
    block_size_params = ()  # no blocks: every row and column cut is legal

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        return _quantize(weight, reduce(block_reduce(weight.abs(), 1, None, "max"), "max", "scale"))

    def dequantize(self, inner, dtype):
        return _dequantize(inner, dtype)

    def unpack(self, inner, out):
        scaled_into(inner["qdata"], inner["scale"], out)
        return True

    def __str__(self) -> str:
        return "Float8Rowwise()"


@dataclass(frozen=True)
class Float8Tensorwise(QuantFormat):
    layout = {"qdata": (OneToOne(), OneToOne()), "scale": (Constant(), Constant())}
    block_size_params = ()  # no blocks: every row and column cut is legal

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        amax = block_reduce(block_reduce(weight.abs(), 1, None, "max"), 0, None, "max")
        return _quantize(weight, reduce(amax, "max", "scale"))

    def dequantize(self, inner, dtype):
        return _dequantize(inner, dtype)

    def unpack(self, inner, out):
        scaled_into(inner["qdata"], inner["scale"], out)
        return True

    def __str__(self) -> str:
        return "Float8Tensorwise()"
