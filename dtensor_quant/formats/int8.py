"""Int8Rowwise: symmetric int8 with one scale per output row.

Layout: ``qdata`` int8 ``[out, in]`` follows both dims one-to-one; ``scale``
``[out, 1]`` (the weight's dtype) follows rows and is constant along ``in``.
So any row or column sharding is legal, and quantizing a column-sharded
weight all-reduces the row maxima.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.format import QuantFormat, Reducer
from ..core.layout import Constant, OneToOne
from ..core.reductions import block_reduce, safe_scale, scaled_into

_QMAX = 127
# torch 2.13's CPU kernel is vectorized for bf16 only: in fp32/fp16 it runs up to 20x slower
# than dequantize + mm for a batch of 16 (AVX2), so those dtypes dequantize.
_KERNEL_DTYPES = (torch.bfloat16,)


def _has_kernel(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    key = {"cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", key)


def _scale(weight: torch.Tensor, reduce: Reducer, dtype: torch.dtype) -> torch.Tensor:
    """Each row's ``amax / 127`` in ``dtype`` (rows cut into column shards reduce their maxima)."""
    amax = reduce(block_reduce(weight.abs(), 1, None, "max"), "max", "scale")
    return safe_scale(amax, _QMAX, dtype)


@dataclass(frozen=True)
class Int8Rowwise(QuantFormat):
    layout = {
        "qdata": (OneToOne(), OneToOne()),
        "scale": (OneToOne(), Constant()),
    }
    block_size_params = ()  # no blocks: every row and column cut is legal

    def quantize(self, weight: torch.Tensor, reduce: Reducer) -> dict[str, torch.Tensor]:
        scale = _scale(weight, reduce, weight.dtype)
        q = torch.round(weight.float() / scale.float()).clamp(-_QMAX, _QMAX).to(torch.int8)
        return {"qdata": q, "scale": scale}

    def quantize_stochastic(self, weight, reduce, noise, dtype):
        """``floor(w / scale + noise)``: the scale of ``quantize``, the codes rounded at random."""
        scale = _scale(weight, reduce, dtype)
        q = torch.floor(weight.float() / scale.float() + noise).clamp_(-_QMAX, _QMAX).to(torch.int8)
        return {"qdata": q, "scale": scale}

    def dequantize(self, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return (inner["qdata"].float() * inner["scale"].float()).to(dtype)

    def unpack(self, inner, out):
        scaled_into(inner["qdata"], inner["scale"], out)
        return True

    def prepare(self, inner):
        return inner["qdata"].contiguous(), inner["scale"].reshape(-1).contiguous()

    def linear(self, x, prepared, bias):
        """``aten._weight_int8pack_mm`` (per-row scale, bf16 activations): CPU; CUDA if built in (untested here)."""
        q, scale = prepared
        # The CPU kernel reads past the row end (segfaults on torch 2.13) unless in % 8 == 0.
        if x.dtype not in _KERNEL_DTYPES or 0 in q.shape or q.shape[1] % 8 or not _has_kernel(x.device.type):
            return None
        out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scale.to(x.dtype))
        return out + bias if bias is not None else out

    def __str__(self) -> str:
        return "Int8Rowwise()"
