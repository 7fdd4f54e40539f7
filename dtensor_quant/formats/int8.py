"""Int8Rowwise: symmetric int8 with one scale per output row.

Layout: ``qdata`` int8 ``[out, in]`` follows both dims one-to-one; ``scale``
``[out, 1]`` (the weight's dtype) follows rows and is constant along ``in``.
So any row or column sharding is legal, and quantizing a column-sharded
weight all-reduces the row maxima.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import native
from ..core.format import QuantFormat, Reducer
from ..core.layout import Constant, OneToOne
from ..core.reductions import block_reduce, safe_scale, scaled_into
from ..core.stochastic import NOISE_SOURCE, Noise

_QMAX = 127
# torch 2.13's CPU kernel is vectorized for bf16 only: in fp32/fp16 it runs up to 20x slower
# than dequantize + mm for a batch of 16 (AVX2), so those dtypes dequantize.
_KERNEL_DTYPES = (torch.bfloat16,)


def _has_kernel(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    key = {"cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", key)


# floor(u + w / s) clamped to +-127 (NaN to 0) with u the hash noise of each element's global index:
# the torch expression of quantize_stochastic in one pass, the same bits (addcdiv divides, then adds).
_SR_SOURCE = r"""
void kernel(const float* w, const float* scale, int8_t* out, int64_t rows, int64_t cols, int64_t key,
            int64_t row0, int64_t col0, int64_t gcols, int64_t wide, int64_t* level) {
    *level = 1;
    for (int64_t r = 0; r < rows; ++r) {
        const float s = scale[r];
        const uint64_t first = uint64_t(row0 + r) * uint64_t(gcols) + uint64_t(col0);
        const float* wr = w + r * cols;
        int8_t* o = out + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
            float t = wr[c] / s;
            float v = std::floor(dq_noise(uint32_t(key), first + uint64_t(c), wide != 0) + t);
            v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
            o[c] = std::isnan(v) ? 0 : int8_t(v);
        }
    }
}
"""
_SR_ARGTYPES = ["const float*", "const float*", "int8_t*"] + ["int64_t"] * 7 + ["int64_t*"]


def _sr_probe(kernel) -> int:
    level, empty = native.level_out(), torch.empty(0)
    kernel(empty, empty, torch.empty(0, dtype=torch.int8), 0, 0, 0, 0, 0, 1, 0, level)
    return int(level)


def sr_codes(weight: torch.Tensor, scale: torch.Tensor, noise: Noise) -> torch.Tensor | None:
    """The stochastically rounded int8 codes of float32 ``weight`` ``[rows, cols]`` with float32 row ``scale``
    from the C++ kernel, or None where it cannot run (given noise values, not the CPU, no compiler)."""
    if noise.values is not None or weight.device.type != "cpu" or weight.ndim != 2 or len(noise.offsets) != 2:
        return None
    loaded = native.load("int8_stochastic", NOISE_SOURCE + _SR_SOURCE, _SR_ARGTYPES, _sr_probe)
    if loaded is None:
        return None
    run, _ = loaded
    w, s = weight.contiguous(), scale.reshape(-1).contiguous()
    out = torch.empty(w.shape, dtype=torch.int8)
    row0, col0 = noise.offsets
    run(
        w,
        s,
        out,
        w.shape[0],
        w.shape[1],
        noise.key,
        row0,
        col0,
        noise.global_shape[1],
        int(noise.wide),
        native.level_out(),
    )
    return out


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
        """``floor(noise + w / scale)``: the scale of ``quantize``, the codes rounded at random.

        On the CPU a kernel draws the noise and rounds in one pass (:func:`sr_codes`); the same bits.
        """
        scale = _scale(weight, reduce, dtype)
        q = sr_codes(weight.float(), scale.float(), noise)
        if q is None:
            q = torch.addcdiv(noise.uniform(), weight.float(), scale.float()).floor_().clamp_(-_QMAX, _QMAX)
            q = q.nan_to_num_(0.0).to(torch.int8)
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
