"""formats/float8: Float8Rowwise and Float8Tensorwise against a reference, and compressed-tensors' float8
checkpoints (channel, block and tensor scales) dequantized as the producer does, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import dtensor_quant as dq
from tests.support.format_cases import (
    assert_dequantizes_like,
    ct_scheme,
    needs_compressed_tensors,
    random_scales,
    round_up,
    stored,
)


@pytest.mark.parametrize("fmt", [dq.Float8Rowwise(), dq.Float8Tensorwise()])
def test_float8_matches_reference(fmt):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q = dq.quantize(w, fmt)
    amax = w.float().abs().amax(dim=1, keepdim=True) if isinstance(fmt, dq.Float8Rowwise) else w.float().abs().max()
    scale = round_up(amax / 448, torch.bfloat16).float()
    expected = ((w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)
    assert q.qdata.dtype == torch.float8_e4m3fn and q.scale.numel() == (16 if isinstance(fmt, dq.Float8Rowwise) else 1)
    assert torch.equal(q.dequantize(), expected)


def _e4m3_codes(shape, seed):
    """Every e4m3fn bit pattern but NaN, in random order (so every code, subnormals and +-448 included)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    bits = torch.where((bits & 0x7F) == 0x7F, bits ^ 1, bits)
    return bits.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("strategy", ["channel", "block", "tensor"])
def test_compressed_tensors_float8(strategy, scale_dtype):
    """``float-quantized`` FP8: per channel (Float8Rowwise), per tensor (Float8Tensorwise) or 128x128 blocks
    with partial ones (Float8Blockwise), the scale in bf16 or fp32, in a bf16 model."""
    needs_compressed_tensors()
    from compressed_tensors.compressors import FloatQuantizationCompressor

    out, n_in = (200, 384) if strategy == "block" else (40, 256)
    codes = _e4m3_codes((out, n_in), seed=5)
    blocks = {"block_structure": [128, 128]} if strategy == "block" else {}
    scheme = ct_scheme(num_bits=8, type="float", symmetric=True, strategy=strategy, **blocks)
    if strategy == "block":
        scale = random_scales((2, 3), scale_dtype, seed=6)
        fmt = dq.Float8Blockwise(128, scale_dtype=scale_dtype)
        q = stored(fmt, (out, n_in), qdata=codes, scale_inv=scale)
    else:
        scale = random_scales((out, 1) if strategy == "channel" else (1, 1), scale_dtype, seed=6, extremes=False)
        fmt = (dq.Float8Rowwise if strategy == "channel" else dq.Float8Tensorwise)(scale_dtype=scale_dtype)
        q = stored(fmt, (out, n_in), qdata=codes, scale=scale)
    reference = FloatQuantizationCompressor.decompress({"weight": codes, "weight_scale": scale}, scheme)["weight"]
    assert reference.dtype == scale_dtype
    assert_dequantizes_like(q, lambda dtype: reference.to(dtype))
