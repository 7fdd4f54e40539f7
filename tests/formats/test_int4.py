"""formats/int4: Int4Groupwise against a reference, and symmetric GPTQ checkpoints it holds, bit for bit."""

from __future__ import annotations

import torch

import dtensor_quant as dq
from dtensor_quant.testing import same_bits
from tests.support.format_cases import assert_dequantizes_like, pack_nibbles, random_scales, stored


def test_int4_matches_reference():
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    q4 = dq.quantize(w, dq.Int4Groupwise(64))
    g = w.float().view(8, 4, 64)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = ((hi - lo).clamp(min=1e-6) / 15).to(torch.bfloat16).float()
    z = (lo + s * 8).to(torch.bfloat16).float()
    codes = ((g - (z - 8 * s)) / s).round().clamp(0, 15)
    assert torch.equal(q4.dequantize(), ((codes - 8) * s + z).view(8, 256).to(torch.bfloat16))


def test_symmetric_gptq_in_int4groupwise_rounds_in_fp16_first():
    """Symmetric GPTQ (z = 8) repacked into Int4Groupwise(scale_dtype=fp16): (q - 8) * s in fp16, then bf16.

    Rounding straight from float32 to bf16 would differ from GPTQ's fp16 result converted to bf16
    (double rounding) on some values; scale_dtype makes the format round where GPTQ does.
    """
    g = torch.Generator().manual_seed(10)
    codes = torch.randint(0, 16, (64, 1024), generator=g, dtype=torch.int8)
    scale = random_scales((64, 8), torch.float16, seed=11, extremes=False)
    reference = scale.repeat_interleave(128, 1) * (codes - 8)
    fmt = dq.Int4Groupwise(128, scale_dtype=torch.float16)
    q = stored(fmt, (64, 1024), qdata=pack_nibbles(codes), scale=scale, zero=torch.zeros_like(scale))
    assert_dequantizes_like(q, lambda dtype: reference.to(dtype))
    direct = ((codes.float() - 8) * scale.float().repeat_interleave(128, 1)).to(torch.bfloat16)
    assert not same_bits(direct, reference.to(torch.bfloat16)), "no double-rounding case in this sample"
