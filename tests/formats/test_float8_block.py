"""formats/float8_block: Float8Blockwise (one fp32 scale per 128x128 block) against a reference."""

import torch

import dtensor_quant as dq


def test_float8_blockwise_matches_reference_with_partial_blocks():
    """One fp32 scale per 128x128 block (DeepSeek-V3's layout); the last blocks of each dim are partial."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    q = dq.quantize(w, dq.Float8Blockwise(128))
    assert q.qdata.dtype == torch.float8_e4m3fn and q.scale_inv.dtype == torch.float32
    assert q.scale_inv.shape == (2, 3)
    expected = torch.empty(200, 300, dtype=torch.bfloat16)
    for i in range(2):
        for j in range(3):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            s = block.abs().max() / 448
            assert q.scale_inv[i, j] == s
            codes = (block / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            expected[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (codes.float() * s).to(torch.bfloat16)
    assert torch.equal(q.dequantize(), expected)
